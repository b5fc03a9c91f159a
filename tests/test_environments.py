"""The environments the tasks declare: read from the source as registered, equal to the classes' declarations,
and each passes gymnasium's checker."""

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env
from stabench.suite import registry

pytestmark = pytest.mark.smoke

DECLARED = registry.builtin_environments()  # what `import stabench` registered, read without importing tasks


def test_the_source_reading_equals_what_the_task_classes_and_worlds_declare():
    import importlib

    from_classes = {}
    for name in registry.discover("task"):
        cls = registry.resolve_class("task", name)
        from_classes.update(registry.environment_entries(cls.__module__, cls.environments))
    for builtin in registry.discover("world").values():
        module = builtin.ref.partition(":")[0]
        from_classes.update(registry.environment_entries(module, importlib.import_module(module).environments))
    assert from_classes == DECLARED
    assert {i for i in gym.registry if i.startswith("stabench/")} == set(DECLARED)


def test_every_builtin_task_is_found_and_importable():
    for name, builtin in registry.discover("task").items():
        assert registry.resolve_class("task", name).id == name, builtin.ref


def test_a_task_whose_environments_are_not_a_literal_is_refused(tmp_path):
    import ast

    tree = ast.parse("class T(Task):\n    id = 'x'\n    environments = make()\n")
    with pytest.raises(registry.StabenchError, match="T.environments must be a literal"):
        registry._literal_fields(tree.body[0], ("id", "environments"))


@pytest.mark.parametrize("env_id", sorted(DECLARED))
def test_check_env(env_id):
    env = gym.make(env_id)
    try:
        check_env(env.unwrapped, skip_render_check=True)
    finally:
        env.close()
