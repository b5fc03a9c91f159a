"""Every built-in is found in its own module (`registry.discover`), and a plugin of any kind joins through an entry
point the same way: no list names them by hand."""

import ast
import importlib
import inspect
import textwrap

import pytest
from stabench.suite import registry
from stabench.suite.api import Detector, Stabilizer, Task

pytestmark = pytest.mark.smoke

PLUGIN = '''
"""A stabilizer and a detector outside the suite, each one class."""

from stabench.suite.api import Detector, Stabilizer


class HalfAdvantages(Stabilizer):
    """Halves every advantage."""

    name = "plug-half"

    def advantages(self, advantages, batch):
        return advantages / 2


class EveryThird(Detector):
    """Alarms on every third row."""

    name = "plug-every-third"

    def __init__(self):
        self.rows = 0

    def update(self, row):
        self.rows += 1
        return self.rows % 3 == 0
'''


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    """A package `plugkinds` with entry points in the groups `stabench.stabilizers` and `stabench.detectors`."""
    (tmp_path / "plugkinds.py").write_text(textwrap.dedent(PLUGIN))
    dist = tmp_path / "plugkinds-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plugkinds\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[stabench.stabilizers]\nplug-half = plugkinds:HalfAdvantages\n\n"
                                           "[stabench.detectors]\nplug-every-third = plugkinds:EveryThird\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_plugin_stabilizer_and_detector_join_through_entry_points(plugin):
    import torch

    assert "plug-half" in registry.names("stabilizer") and "plug-half" not in registry.discover("stabilizer")
    assert "plug-every-third" in registry.names("detector")
    stabilizer = registry.make_stabilizer("plug-half")
    assert torch.equal(stabilizer.advantages(torch.ones(3), {}), torch.full((3,), 0.5))
    assert registry.method_name("plug-half") == "plug-half"
    detector = registry.resolve_class("detector", "plug-every-third")()
    assert [detector.update({}) for _ in range(6)] == [False, False, True, False, False, True]


def defined_classes(kind: str, base: type) -> dict[str, type]:
    """Every class of `base` that the modules of `kind` define with a `name` (a task: `id`) of its own and no
    `listed = False`, imported: `module:Class` -> class (the contract class itself only as the plain baseline)."""
    found = {}
    for module_name, _ in registry._modules(registry.KINDS[kind].sources):
        module = importlib.import_module(module_name)
        for cls in vars(module).values():
            own = vars(cls) if inspect.isclass(cls) else {}
            key = registry.KINDS[kind].key
            if (inspect.isclass(cls) and issubclass(cls, base) and cls.__module__ == module_name
                    and isinstance(own.get(key), str) and own.get("listed", True) is not False
                    and (cls is not base or registry.KINDS[kind].root_listed)):
                found[f"{module_name}:{cls.__qualname__}"] = cls
    return found


@pytest.mark.parametrize(("kind", "base"), [("task", Task), ("stabilizer", Stabilizer), ("detector", Detector)])
def test_no_builtin_is_left_undiscovered(kind, base):
    """What the source reading finds equals what importing every module of the kind finds, names and classes."""
    key = registry.KINDS[kind].key
    imported = {ref: getattr(cls, key) for ref, cls in defined_classes(kind, base).items()}
    assert {b.ref: name for name, b in registry.discover(kind).items()} == imported
    assert list(registry.discover(kind)) == registry.names(kind)[:len(registry.discover(kind))]


def test_an_ablation_opts_out_and_still_runs_by_reference():
    ref = "stabench.baselines.stabilizers.reward_models:ConservativeEnsembleNoAnchor"
    assert ref not in registry.builtins("stabilizer").values()
    assert registry.method_name(ref) == "conservative-ensemble-no-anchor"
    assert "conservative-ensemble" in registry.discover("stabilizer") and "verl" not in registry.discover("stabilizer")


def test_the_detectors_a_run_records_follow_from_their_classes():
    from stabench.suite import crossfit

    for name in registry.discover("detector"):
        cls = registry.resolve_class("detector", name)
        assert (name in registry.SCORED_DETECTORS) == cls.from_metadata, name
        assert (name in registry.LEARNED_DETECTORS) == crossfit.is_learned(cls), name
    assert registry.DEFAULT_DETECTORS == ("threshold", "calibrated-threshold", "cusum", "page-hinkley", "never",
                                          "always", "random-1", "random", "random-20")  # the committed runs' order


def test_discovery_reads_names_opt_outs_and_inherited_fields(tmp_path, monkeypatch):
    (tmp_path / "kinds_probe").mkdir()
    (tmp_path / "kinds_probe" / "__init__.py").write_text("")
    (tmp_path / "kinds_probe" / "a.py").write_text(textwrap.dedent('''
        class Detector:
            name = "detector"
        class Base(Detector):
            from_metadata = True
            def fit(cls, rows, task, budget): ...
        class Kept(Base):
            name = "kept"
        class Dropped(Base):
            name = "dropped"
            listed = False
        class Unrelated:
            name = "unrelated"
        '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = registry.Kind("name", "Detector", ("kinds_probe",), "none", ("from_metadata",))
    monkeypatch.setitem(registry.KINDS, "probe", probe)
    registry.discover.cache_clear()
    try:
        assert registry.discover("probe") == {
            "kept": registry.Builtin("kinds_probe.a:Kept", {"from_metadata": True, "learned": True})}
        (tmp_path / "kinds_probe" / "b.py").write_text("from kinds_probe.a import Base\nclass Again(Base):\n"
                                                       "    name = 'kept'\n")
        registry.discover.cache_clear()
        with pytest.raises(registry.StabenchError, match="two built-in probes are named 'kept'"):
            registry.discover("probe")
    finally:
        registry.discover.cache_clear()


def test_a_world_registers_its_own_environments():
    worlds = registry.discover("world")
    assert worlds["stabench/EmptyFlat-5x5-v0"] == registry.Builtin(
        "stabench.tasks.worlds.grids:make_empty_flat", {"kwargs": {"size": 5}})
    declared_by_tasks = {env for b in registry.discover("task").values() for env in b.fields.get("environments", {})}
    assert not set(worlds) & declared_by_tasks  # a world's environment is its own, no task declares it again


def test_no_task_imports_a_stabilizer_class():
    for module_name, tree in registry._modules(("stabench.tasks", "stabench.tasks.worlds")):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("stabench.baselines.stabilizers"), module_name
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("stabench.baselines.stabilizers") for a in node.names), module_name
