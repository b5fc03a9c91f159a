"""Registries of tasks, stabilizers (methods), detectors and diagnostics.

A name resolves, in order, to a built-in, to a Python entry point of an installed package (groups
`stabench.tasks`, `stabench.stabilizers`, `stabench.detectors`; a world's environments: `stabench.worlds`), or to a
reference of the form `path/to/file.py:ClassName` or `package.module:ClassName`. Built-ins are found in the
source of their own modules (`discover`), so that `stabench list` and the CLI's argument checks stay fast until a
class is actually needed, and no list names them by hand. A stabilizer named
`verl:NAME` is verl's registered policy loss NAME, `verl:path/to/file.py:function` a function of verl's signature
(`baselines/stabilizers/verl_losses.py`).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NamedTuple

from stabench.suite.api import LISTED, Budget, Detector, StabenchError, Stabilizer, Task

# Built-ins register themselves, each from its own module: `discover(kind)` reads the source of the kind's modules
# (never importing them, so `stabench list`, the CLI's argument checks and `import stabench` stay fast) and finds every
# class that descends from the kind's contract class and sets a literal `name` (a task: `id`) in its own body, unless
# that body sets `listed = False` (`api.LISTED`). A world module of `stabench.tasks.worlds` declares its gymnasium
# environments in a module-level literal `environments`, in the format of `Task.environments`. A plugin of any kind
# joins through an entry point of the kind's group (a world's: gymnasium id = entry point), a `path/to/file.py:Class`
# reference, or (a task) `register_task(cls)`.


@dataclass(frozen=True)
class Kind:
    """Where the built-ins of one kind live and how a class says it is one."""

    key: str  # the literal class attribute that names a built-in (a world module: its `environments`)
    root: str  # the contract class every built-in descends from
    sources: tuple[str, ...]  # modules, and packages whose every top-level module is read, in this order
    group: str  # the entry-point group of plugins
    fields: tuple[str, ...] = ()  # further literal class attributes read with the name (inherited)
    root_listed: bool = False  # the contract class itself is a built-in under its own name (the plain baseline)


KINDS: dict[str, Kind] = {
    "task": Kind("id", "Task", ("stabench.tasks",), "stabench.tasks", ("environments", "experimental")),
    "stabilizer": Kind("name", "Stabilizer", ("stabench.suite.api", "stabench.suite.references",
                                              "stabench.baselines.stabilizers"), "stabench.stabilizers",
                       root_listed=True),
    "detector": Kind("name", "Detector", ("stabench.suite.api", "stabench.suite.detectors", "stabench.suite.crossfit"),
                     "stabench.detectors", ("from_metadata",)),
    "world": Kind("environments", "", ("stabench.tasks.worlds",), "stabench.worlds"),
}


class Builtin(NamedTuple):
    """A discovered built-in: `package.module:Class` (a world's environment: its entry point, and `kwargs`), and the
    kind's literal `fields` of the class (a detector's also `learned`: it or a parent below `Detector` defines
    `fit`)."""

    ref: str
    fields: Mapping[str, Any]


def _literal_fields(node: ast.ClassDef | ast.Module, names: tuple[str, ...]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        else:
            targets = [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        value = getattr(stmt, "value", None)
        for target in targets:
            if isinstance(target, ast.Name) and target.id in names and value is not None:
                try:
                    found[target.id] = ast.literal_eval(value)
                except ValueError as exc:
                    what = f"{getattr(node, 'name', 'the module')}.{target.id}"
                    raise StabenchError(f"{what} must be a literal (it is read without importing)") from exc
    return found


def _modules(sources: tuple[str, ...], declares: str = "") -> list[tuple[str, ast.Module]]:
    """(module name, parsed source) of every module of `sources`, in order (a package's modules by file name);
    `declares`: only the modules whose source assigns that name at the start of a line (the others are not parsed)."""
    out = []
    for source in sources:
        spec = importlib.util.find_spec(source)
        if spec is None:
            raise StabenchError(f"cannot find the built-in modules {source!r}")
        if spec.submodule_search_locations:
            paths = [(f"{source}.{p.stem}", p) for folder in spec.submodule_search_locations
                     for p in sorted(Path(folder).glob("*.py")) if not p.name.startswith("_")]
        else:
            paths = [(source, Path(str(spec.origin)))]
        texts = [(module, path, path.read_text()) for module, path in paths]
        out += [(module, ast.parse(text, filename=str(path))) for module, path, text in texts
                if not declares or re.search(rf"^{declares}\b", text, re.MULTILINE)]
    return out


def _base_names(node: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]


@functools.cache
def discover(kind: str) -> dict[str, Builtin]:
    """The built-ins of `kind` (task, stabilizer, detector or world), read from the source of their modules: name
    (a world's: gymnasium id) -> `Builtin`, in source order. Two classes that claim one name are an error."""
    spec = KINDS[kind]
    found: dict[str, Builtin] = {}

    def claim(name: Any, builtin: Builtin) -> None:
        if name in found:
            raise StabenchError(f"two built-in {kind}s are named {name!r}: {found[name].ref} and {builtin.ref}")
        found[name] = builtin

    if kind == "world":
        for module, tree in _modules(spec.sources, declares=spec.key):
            declared = _literal_fields(tree, ("environments",)).get("environments", {})
            for env_id, (entry, kwargs) in environment_entries(module, declared).items():
                claim(env_id, Builtin(entry, {"kwargs": kwargs}))
        return found
    modules = _modules(spec.sources)
    classes = {node.name: node for _, tree in modules for node in tree.body if isinstance(node, ast.ClassDef)}

    def chain(name: str) -> list[ast.ClassDef] | None:
        """The class and its parents among the read classes, up to the root (None: not a descendant)."""
        node = classes.get(name)
        if name == spec.root:
            return [node] if node is not None else []
        for base in _base_names(node) if node is not None else []:
            above = chain(base) if base != name else None
            if above is not None:
                return [node, *above]
        return None

    for module, tree in modules:
        for node in tree.body:
            parents = chain(node.name) if isinstance(node, ast.ClassDef) else None
            if parents is None:
                continue
            own = _literal_fields(node, (spec.key, LISTED))
            if not isinstance(own.get(spec.key), str) or own.get(LISTED) is False:
                continue
            if node.name == spec.root and not spec.root_listed:
                continue
            fields: dict[str, Any] = {}
            for parent in reversed(parents):
                fields.update(_literal_fields(parent, spec.fields))
            if spec.root == "Detector":  # learned: a class below the contract's defines `fit`
                fields["learned"] = any(isinstance(s, ast.FunctionDef) and s.name == "fit"
                                        for parent in parents if parent.name != spec.root for s in parent.body)
            claim(own[spec.key], Builtin(f"{module}:{node.name}", fields))
    return found


def builtins(kind: str) -> dict[str, str]:
    """The built-ins of `kind` by name -> `package.module:Class`."""
    return {name: builtin.ref for name, builtin in discover(kind).items()}


def environment_entries(module: str, environments: Any) -> dict[str, tuple[str, dict[str, Any]]]:
    """A task's `environments` as gymnasium ids -> (absolute entry point, kwargs); bare names are in `module`."""
    entries = {}
    for env_id, value in dict(environments).items():
        entry, kwargs = (value, {}) if isinstance(value, str) else value
        entries[env_id] = (entry if ":" in entry else f"{module}:{entry}", dict(kwargs))
    return entries


def register_environments(entries: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """Register gymnasium ids (lazily: an entry point is a string); ids already registered are left as they are."""
    import gymnasium as gym

    for env_id, (entry_point, kwargs) in entries.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry_point, kwargs=dict(kwargs))


def builtin_environments() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every gymnasium id the built-in tasks and worlds declare, and those of installed world plugins (entry points
    of the group `stabench.worlds`: gymnasium id = entry point)."""
    entries: dict[str, tuple[str, dict[str, Any]]] = {}
    for builtin in discover("task").values():
        entries.update(environment_entries(builtin.ref.rpartition(":")[0], builtin.fields.get("environments", {})))
    entries.update({env_id: (b.ref, dict(b.fields["kwargs"])) for env_id, b in discover("world").items()})
    for env_id, ep in _entry_points(KINDS["world"].group).items():
        entries.setdefault(env_id, (ep.value, {}))
    return entries


_REGISTERED_TASKS: dict[str, type] = {}


def register_task(cls: type) -> type:
    """Add a task class to the registry at run time (usable as a class decorator) and register its gymnasium
    environments. A Ray worker process must make the same call (import the module that makes it)."""
    if not (isinstance(cls, type) and issubclass(cls, Task)) or not isinstance(getattr(cls, "id", None), str):
        raise StabenchError(f"{cls!r} is not a stabench.Task subclass with an `id`")
    builtin = discover("task").get(cls.id)
    if builtin is not None and builtin.ref != f"{cls.__module__}:{cls.__qualname__}":
        raise StabenchError(f"task id {cls.id!r} is a built-in task's")
    _REGISTERED_TASKS[cls.id] = cls
    register_environments(environment_entries(cls.__module__, cls.environments))
    return cls


# Detectors computed from the run's metadata at scoring time (`Detector.from_metadata`: the ground truth, the
# injection, the method's failures on other seeds), not from rows.
SCORED_DETECTORS: tuple[str, ...] = tuple(n for n, b in discover("detector").items() if b.fields.get("from_metadata"))
# Learned detectors (they declare `Detector.fit`): cross-fitted over a finished run's rows (`suite.crossfit`).
LEARNED_DETECTORS: tuple[str, ...] = tuple(n for n, b in discover("detector").items() if b.fields["learned"])
# Detectors whose alarms a run records.
DEFAULT_DETECTORS: tuple[str, ...] = tuple(d for d in discover("detector")
                                           if d not in SCORED_DETECTORS and d not in LEARNED_DETECTORS)

_BASES: dict[str, type] = {"task": Task, "stabilizer": Stabilizer, "detector": Detector}


def is_reference(name: str) -> bool:
    """True for `file.py:Class` and `module:Class` references (as opposed to registered names)."""
    return ":" in name


def load_object(ref: str) -> Any:
    """Import `path/to/file.py:Name` or `package.module:Name`; errors are one line for the user."""
    target, _, attr = ref.rpartition(":")
    if not target or not attr:
        raise StabenchError(f"plugin reference {ref!r} must look like path/to/file.py:ClassName")
    if target.endswith(".py") or "/" in target:
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise StabenchError(f"plugin file {target!r} does not exist")
        module_name = f"stabench_plugin_{path.stem}_{abs(hash(str(path))) & 0xFFFFFF:x}"
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise StabenchError(f"cannot import plugin file {target!r}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as exc:  # the plugin's own code failed: say so, by name
                del sys.modules[module_name]
                raise StabenchError(f"plugin file {target!r} failed to import: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise StabenchError(f"cannot import module {target!r} for {ref!r}: {exc}") from exc
    if not hasattr(module, attr):
        raise StabenchError(f"{target!r} has no {attr!r}")
    return getattr(module, attr)


# A method reference may carry a setting of the method's declared `search_space`: `kl-anchor@coef=0.1`,
# `path/to/fix.py:Fix@max_norm=2`. It names a class whose attributes hold that setting; the run records the method
# as `<name>@<setting>`, so a method's default and another setting of it sit side by side in one run.
SETTING_MARK = "@"
VERL_PREFIX = "verl:"  # a method that runs a verl policy loss (`resolve_class`)


def split_setting(ref: str) -> tuple[str, str | None]:
    """`kl-anchor@coef=0.1` -> ("kl-anchor", "coef=0.1"); a reference without a setting -> (ref, None)."""
    start = ref.find(".py:") + 4 if ".py:" in ref else 0  # a folder of a plugin path may hold an @
    at = ref.find(SETTING_MARK, start)
    return (ref, None) if at < 0 else (ref[:at], ref[at + 1:])


def base_name(method: str) -> str:
    """A recorded method name without its setting: `kl-anchor@coef=0.1` -> `kl-anchor`."""
    return method.split(SETTING_MARK, 1)[0]


def format_value(value: Any) -> str:
    """A setting's value as it is written in a method's name (floats to 3 significant digits: what runs is what
    the name says, since `parse_setting` reads the value back from this text)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def setting_text(setting: dict[str, Any]) -> str:
    """`coef=0.1,estimator=k2`: a setting in its canonical written form (keys sorted)."""
    return ",".join(f"{key}={format_value(value)}" for key, value in sorted(setting.items()))


def _cast(raw: str, default: Any, where: str) -> Any:
    """A written value as the type of the class attribute's default."""
    try:
        if isinstance(default, bool):
            if raw.lower() not in ("true", "false"):
                raise ValueError(raw)
            return raw.lower() == "true"
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            value = float(raw)
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(raw)
            return value
        return raw
    except ValueError:
        raise StabenchError(f"{where}: expected a {type(default).__name__}, got {raw!r}") from None


def parse_setting(cls: type, text: str) -> dict[str, Any]:
    """The setting `key=value[,key=value]` of a stabilizer class, each key one of its `search_space`, each value
    cast to the type of the attribute's default."""
    space = dict(getattr(cls, "search_space", {}) or {})
    name = getattr(cls, "name", cls.__name__)
    setting: dict[str, Any] = {}
    for item in text.split(","):
        key, eq, raw = (part.strip() for part in item.partition("="))
        if not eq or not key or not raw:
            raise StabenchError(f"malformed setting {text!r} of {name}: write {name}@key=value[,key=value]")
        if key not in space:
            known = ", ".join(sorted(space)) or "none (its class declares no search_space)"
            raise StabenchError(f"{name} has no setting {key!r}; its settings: {known}")
        if key in setting:
            raise StabenchError(f"malformed setting {text!r} of {name}: {key} is given twice")
        value = _cast(raw, getattr(cls, key), f"setting {key} of {name}")
        setting[key] = _cast(format_value(value), value, key)  # what runs is what the recorded name says
    return setting


def setting_class(plain: str, text: str) -> tuple[type, dict[str, Any]]:
    """The class of `plain` holding the setting `text`, and the setting; `@tuned` is resolved before (a sweep's
    request reads the tuning record, `suite.tune.resolve_tuned`)."""
    if text == "tuned" or text.startswith("tuned="):
        raise StabenchError(f"{plain}@{text}: a tuned setting is read when a sweep is requested "
                            f"(`stabench run --methods {plain}@{text}`)")
    cls = resolve_class("stabilizer", plain)
    setting = parse_setting(cls, text)
    return _with_setting(cls, tuple(sorted(setting.items()))), setting


@functools.cache
def _with_setting(cls: type, items: tuple[tuple[str, Any], ...]) -> type:
    """A subclass whose class attributes hold the setting (cached: one class per setting)."""
    return type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       "__doc__": cls.__doc__, **dict(items)})


def canonical(name: str) -> str:
    """A file reference with an absolute path (Ray workers do not share the driver's working folder)."""
    base, setting = split_setting(name)
    if setting is not None:
        return f"{canonical(base)}{SETTING_MARK}{setting}"
    if name.startswith(VERL_PREFIX) and is_reference(name[len(VERL_PREFIX):]):  # verl:file.py:function
        return VERL_PREFIX + canonical(name[len(VERL_PREFIX):])
    target, sep, attr = name.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target):
        return f"{Path(target).expanduser().resolve()}:{attr}"
    return name


def _entry_points(group: str) -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=group)}


def names(kind: str) -> list[str]:
    """Registered names of one kind (a world's: gymnasium ids): built-ins first, then tasks registered at run time,
    then installed entry points."""
    found = discover(kind)
    extra = [n for n in _REGISTERED_TASKS if n not in found] if kind == "task" else []
    return list(found) + extra + sorted(set(_entry_points(KINDS[kind].group)) - set(found) - set(extra))


def resolve_class(kind: str, name: str) -> type:
    """The class behind a name or reference, checked to be of the right kind."""
    if kind not in _BASES:
        raise StabenchError(f"a {kind} is not a class: its names are {', '.join(names(kind))}")
    found, group, base = builtins(kind), KINDS[kind].group, _BASES[kind]
    if kind == "stabilizer" and split_setting(name)[1] is not None:
        return setting_class(*split_setting(name))[0]
    if kind == "stabilizer" and name.startswith(VERL_PREFIX):  # a verl policy loss (stabilizers/verl_losses.py)
        from stabench.baselines.stabilizers.verl_losses import method_class

        return method_class(name[len(VERL_PREFIX):])
    if name in found:
        cls = load_object(found[name])
    elif kind == "task" and name in _REGISTERED_TASKS:
        cls = _REGISTERED_TASKS[name]
    elif is_reference(name):
        cls = load_object(name)
    else:
        eps = _entry_points(group)
        if name not in eps:
            raise StabenchError(f"unknown {kind} {name!r}; known: {', '.join(names(kind))}")
        try:
            cls = eps[name].load()
        except Exception as exc:
            raise StabenchError(f"{kind} entry point {name!r} failed to load: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise StabenchError(f"{name!r} is not a {base.__module__}.{base.__name__} subclass")
    if kind == "task" and name not in found:  # a plugin task's environments join gymnasium's registry
        register_environments(environment_entries(cls.__module__, cls.environments))
    return cls


def get_task(name: str, **knobs: Any) -> Task:
    """The task behind a name, built with `knobs` (its constructor checks them)."""
    return resolve_class("task", name)(**knobs)


def method_name(ref: str) -> str:
    """The name a method is recorded under: its registered name, or the plugin class's `name`; with a setting,
    `<name>@<setting>` in canonical form (`kl-anchor@coef=0.1`)."""
    plain, text = split_setting(ref)
    if text is not None:
        return f"{method_name(plain)}{SETTING_MARK}{setting_text(setting_class(plain, text)[1])}"
    if not is_reference(ref):
        return ref
    cls = resolve_class("stabilizer", ref)
    name = getattr(cls, "name", "")
    if not name or name == Stabilizer.name or name in discover("stabilizer"):
        raise StabenchError(f"stabilizer {ref!r} must set a class attribute `name` not used by a built-in")
    return name


class PluginError(Exception):
    """A stabilizer hook raised, returned the wrong type, or produced non-finite values."""


class Guarded(Stabilizer):
    """Wraps a stabilizer so that a failure names it and the hook where it happened.

    A hook that raises, returns the wrong type or shape, turns finite values into non-finite ones, or (`rollout`)
    drops a batch key raises `PluginError("<name>.<hook>: ...")`; the runner records the run as diverged with that
    text.
    """

    def __init__(self, inner: Stabilizer) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.needs = inner.needs  # type: ignore[misc]
        self.trainers = inner.trainers  # type: ignore[misc]

    def _call(self, hook: str, *args: Any) -> Any:
        try:
            return getattr(self.inner, hook)(*args)
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(f"{self.name}.{hook} raised {type(exc).__name__}: {exc}") from exc

    def _tensor_like(self, hook: str, before: Any, after: Any) -> Any:
        import torch

        if not isinstance(after, torch.Tensor):
            raise PluginError(f"{self.name}.{hook} returned {type(after).__name__}, expected a torch.Tensor")
        if after.shape != before.shape:
            raise PluginError(f"{self.name}.{hook} returned shape {tuple(after.shape)}, expected {tuple(before.shape)}")
        if bool(torch.isfinite(before).all()) and not bool(torch.isfinite(after).all()):
            raise PluginError(f"{self.name}.{hook} produced non-finite values")
        return after

    def model(self, model: Any, spec: Any) -> Any:
        from torch import nn

        out = self._call("model", model, spec)
        if not isinstance(out, nn.Module):
            raise PluginError(f"{self.name}.model returned {type(out).__name__}, expected a torch.nn.Module")
        return out

    def optimizer(self, optimizer: Any, model: Any) -> Any:
        import torch

        out = self._call("optimizer", optimizer, model)
        if not isinstance(out, torch.optim.Optimizer):
            raise PluginError(f"{self.name}.optimizer returned {type(out).__name__}, expected a torch Optimizer")
        return out

    def rollout(self, batch: Any, info: Any) -> Any:
        import torch

        out = self._call("rollout", dict(batch), info)
        if not isinstance(out, dict) or not all(isinstance(v, torch.Tensor) for v in out.values()):
            raise PluginError(f"{self.name}.rollout returned {type(out).__name__}, expected a dict of tensors")
        dropped = sorted(set(batch) - set(out))
        if dropped:
            raise PluginError(f"{self.name}.rollout dropped the batch keys {', '.join(dropped)}")
        for key, value in batch.items():
            self._tensor_like(f"rollout[{key!r}]", value, out[key])
        return out

    def advantages(self, advantages: Any, batch: Any) -> Any:
        return self._tensor_like("advantages", advantages, self._call("advantages", advantages, batch))

    def kl_loss(self, per_token_kl: Any, batch: Any) -> Any:
        return self._tensor_like("kl_loss", per_token_kl, self._call("kl_loss", per_token_kl, batch))

    def loss(self, terms: Any, batch: Any) -> Any:
        import torch

        if type(self.inner).loss is Stabilizer.loss and "loss" not in vars(self.inner):
            return dict(terms)  # the contract's own hook returns its terms: nothing to check
        out = self._call("loss", dict(terms), batch)
        if not isinstance(out, dict) or not all(isinstance(v, torch.Tensor) for v in out.values()):
            raise PluginError(f"{self.name}.loss returned {type(out).__name__}, expected a dict of tensors")
        for key, value in out.items():
            was_finite = key not in terms or bool(torch.isfinite(terms[key]).all())
            if was_finite and not bool(torch.isfinite(value).all()):
                raise PluginError(f"{self.name}.loss produced a non-finite term {key!r}")
        return out

    def after_backward(self, model: Any) -> None:
        self._call("after_backward", model)

    def drops_all_gradients(self) -> bool:
        return self._call("drops_all_gradients") is True

    def applies_to(self, task: Task) -> bool:
        return self.inner.applies_to(task)

    def __getattr__(self, attribute: str) -> Any:
        """Anything else a trainer reads of its stabilizer comes from the plugin itself."""
        if attribute == "inner":  # not set yet (copying): no recursion
            raise AttributeError(attribute)
        return getattr(self.inner, attribute)


def make_stabilizer(ref: str) -> Stabilizer:
    return Guarded(resolve_class("stabilizer", ref)())


def make_detector(ref: str, task: Task, budget: Budget) -> Detector:
    return resolve_class("detector", ref).for_task(task, budget)
