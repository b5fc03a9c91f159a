"""The environments the tasks declare: read from the source as registered, equal to the classes' declarations,
and each passes gymnasium's checker."""

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env
from stabench.suite import registry

pytestmark = pytest.mark.smoke

DECLARED = registry.builtin_environments()  # what `import stabench` registered, read without importing tasks


def test_the_source_reading_equals_what_the_task_classes_declare():
    from_classes = {}
    for name in registry.BUILTIN_TASKS:
        cls = registry.resolve_class("task", name)
        from_classes.update(registry.environment_entries(cls.__module__, cls.environments))
    assert from_classes == DECLARED
    assert {i for i in gym.registry if i.startswith("stabench/")} == set(DECLARED)


def test_every_builtin_task_is_found_and_importable():
    for name, ref in registry.BUILTIN_TASKS.items():
        assert registry.resolve_class("task", name).id == name, ref


def test_a_task_whose_environments_are_not_a_literal_is_refused(tmp_path):
    import ast

    tree = ast.parse("class T(Task):\n    id = 'x'\n    environments = make()\n")
    with pytest.raises(registry.StabenchError, match="T.environments must be a literal"):
        registry._literal_class_fields(tree.body[0], ("id", "environments"))


@pytest.mark.parametrize("env_id", sorted(DECLARED))
def test_check_env(env_id):
    env = gym.make(env_id)
    try:
        check_env(env.unwrapped, skip_render_check=True)
    finally:
        env.close()
