"""Shared pieces of the token family: a tiny causal transformer policy, sampling, log-probs, enumeration.

Conventions every token task follows:

- The policy is a `transformers` causal LM built from a config (never downloaded). Its vocabulary is
  `n_actions` answer tokens (ids 0 .. n_actions - 1) plus one special token, id `n_actions`, that serves
  as BOS, EOS and padding. Policies only ever emit answer tokens: their next-token distribution is the
  softmax over the first `n_actions` logits.
- A prompt is a LongTensor [B, P] that starts with BOS; an answer is a LongTensor [B, L] of answer tokens.
- A reward function maps `(prompts, answers)` to a FloatTensor [B]. The gymnasium environment and the
  trainer call the same function, so what the agent is trained on is what the environment pays.
- Answers are short and the vocabulary tiny, so every answer can be enumerated (n_actions ** L of
  them): exact sequence-level quantities (KL, expected reward) need one batched forward.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import itertools
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import gymnasium as gym
import numpy as np
import torch
from safetensors.torch import load, load_file, save_file
from stabench.baselines import tokens as shared_tokens
from stabench.baselines.tokens import (  # noqa: F401  (re-exported for the tasks)
    RewardFn,
    answer_logits,
    on_default_device,
    sample_answers,
    tiny_policy,
)
from stabench.suite.api import StabenchError
from torch import nn

T = TypeVar("T")


def on_one_thread(fn: Callable[[], T]) -> T:
    """fn() on one torch thread whatever the caller uses.

    A warm start is trained on one thread (`warm_start`, `WarmStart.retrain`): its float sums always run in the
    same order, so training it again on the same machine gives the same weights bit for bit.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def cache_dir() -> Path | None:
    """Where plugin tasks' warm starts are cached at run time (built-in ones ship as files, `shipped_dir`):
    `$STABENCH_CACHE`, else `$XDG_CACHE_HOME/stabench` (`~/.cache/stabench`); None when `STABENCH_CACHE=off`."""
    setting = os.environ.get("STABENCH_CACHE", "")
    if setting.lower() == "off":
        return None
    if setting:
        return Path(setting).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stabench"


def warm_start(name: str, train: Callable[[], nn.Module], source: str | Sequence[str]) -> dict[str, torch.Tensor]:
    """The weights of a warm start trained at run time: by `train()` on one thread, or read from the disk cache.

    This is the path of a plugin task's `WarmStart` (one without a declared sha256); the built-in tasks' warm starts
    ship as hash-checked files instead and never come here, since weights trained on another CPU differ in their
    float sums and would shift every run of the task on that machine. Every worker process of a sweep needs the
    same warm starts, and training them takes seconds per task and worker. The cache key covers what could change
    the weights: `name`, the source of the task's module (`source`, its path, or several paths), of this one and of
    the shared policy code, the torch and transformers versions, the device and the CPU's kernel set; any change
    trains afresh. Entries are safetensors (no pickle) written atomically, so concurrent workers at worst train the
    same start twice. A cache that cannot be written is reported as a warning and otherwise ignored.
    """
    import transformers

    folder = cache_dir()
    digest = hashlib.sha256()
    for part in (name, torch.__version__, transformers.__version__, torch.get_default_device().type,
                 torch.backends.cpu.get_cpu_capability()):
        digest.update(part.encode() + b"\0")
    sources = [source] if isinstance(source, str) else list(source)
    for path in (*sources, __file__, shared_tokens.__file__):  # the task, this module, the shared policy code
        digest.update(Path(path).read_bytes())
    path = None if folder is None else folder / f"{name.replace('/', '-')}-{digest.hexdigest()[:20]}.safetensors"
    if path is not None and path.is_file():
        try:
            return load_file(path, device=torch.get_default_device().type)
        except Exception:  # a damaged entry: train afresh and overwrite it
            pass
    state = {k: v.detach().clone() for k, v in on_one_thread(train).state_dict().items()}
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            save_file({k: v.contiguous().cpu() for k, v in state.items()}, tmp)
            os.replace(tmp, path)
        except OSError as err:
            warnings.warn(f"stabench: cannot cache the warm start {name} in {folder}: {err}", stacklevel=2)
    return state


TASK_PACKAGE = "stabench.tasks"
SHIPPED_FOLDER = "warm_starts"  # stabench/tasks/warm_starts/ (`suite.fingerprint` hashes it; keep the two in step)
RETRAIN = "stabench warm-start --retrain"
# The warm starts declared in the package's own modules, by name (filled as each is constructed).
BUILTIN: dict[str, WarmStart] = {}
_deferred = 0  # > 0 inside `deferred_checks()`


def shipped_dir() -> Path:
    """The folder of the built-in warm starts: `stabench/tasks/warm_starts/` (tasks/warm_starts in a checkout);
    `$STABENCH_WARM_STARTS` names another one (tests use a damaged copy)."""
    setting = os.environ.get("STABENCH_WARM_STARTS", "")
    return Path(setting).expanduser() if setting else Path(__file__).resolve().parent.parent / SHIPPED_FOLDER


def file_name(name: str) -> str:
    """A warm start's shipped file: `kl-estimator-bias/reference` -> `kl-estimator-bias-reference.safetensors`."""
    return f"{name.replace('/', '-')}.safetensors"


@contextlib.contextmanager
def deferred_checks() -> Iterator[None]:
    """Construct warm starts without checking their files (to list and retrain them); loading still checks."""
    global _deferred
    _deferred += 1
    try:
        yield
    finally:
        _deferred -= 1


class WarmStart:
    """A task's warm start as a factory: `warm()` is a fresh model holding the warm weights.

    A built-in task declares its warm starts with the sha256 of the file they ship as,
    `WarmStart(name, train, build, sha256="...")`: the weights are read from `shipped_dir() / file_name(name)`,
    never trained at run time and never cached, so every machine starts the task from the same weights (weights
    trained on another CPU differ in their float sums). The file is checked when the warm start is constructed (the
    task module's import, which the driver does when it plans a sweep) and again when it is loaded: a changed or
    missing file raises `StabenchError`, one line naming the warm start, the tasks that use it and how to restore it
    (one declared in a world module, `digits.warm_policy`, stops every task that imports that world).
    `stabench warm-start --retrain NAME` trains it again with `train` (`retrain`) and prints the new sha256 to
    declare; changing `train` or what it calls does not retrain the shipped file by itself.

    Without sha256 (a plugin task) the weights are trained once per process by `train` (on one thread, cached on disk
    by `warm_start` under `name`, keyed on the source of the module that defines `train` and of every shared world
    module, which training code may call). Either way `build` makes the untrained network, under
    `torch.random.fork_rng` so that building a model never moves the caller's random state.
    """

    def __init__(self, name: str, train: Callable[[], nn.Module], build: Callable[[], nn.Module],
                 sha256: str | None = None) -> None:  # fmt: skip
        self.name, self.train, self.build, self.sha256 = name, train, build, sha256
        self.module = sys._getframe(1).f_globals.get("__name__") or train.__module__  # where it is declared
        self._state: dict[str, torch.Tensor] = {}
        if sha256 is not None and not _deferred:
            self._shipped_bytes()  # a changed or missing file stops the import of the task here
        if self.module.startswith(f"{TASK_PACKAGE}."):
            BUILTIN[name] = self

    @property
    def file(self) -> Path:
        """The shipped file (whether or not it exists)."""
        return shipped_dir() / file_name(self.name)

    def file_sha256(self) -> str | None:
        """sha256 of the shipped file; None when it is missing."""
        try:
            return hashlib.sha256(self.file.read_bytes()).hexdigest()
        except OSError:
            return None

    def _shipped_bytes(self) -> bytes:
        path = self.file
        try:
            data = path.read_bytes()
        except OSError:
            data = None
        found = None if data is None else hashlib.sha256(data).hexdigest()
        if found == self.sha256:
            return data
        what = "is missing" if data is None else f"has sha256 {found[:16]}..., not the declared {self.sha256[:16]}..."
        users = ", ".join(self.tasks()) or "no built-in task"
        raise StabenchError(
            f"the warm start {self.name} (used by {users}): {path} {what}; restore the shipped file (`git checkout "
            f"-- tasks/{SHIPPED_FOLDER}/{path.name}` in a checkout, or reinstall stabench) or retrain it "
            f"(`{RETRAIN} {self.name}`, which prints the sha256 to declare)"
        )

    def tasks(self) -> list[str]:
        """The built-in tasks that use this warm start, read from their source: those of the module that declares
        it, and those whose module imports it from there."""
        from stabench.suite.registry import discover

        found = []
        for task, builtin in discover("task").items():
            module = builtin.ref.partition(":")[0]
            if module == self.module or _imports(module, self.module, _bound_name(self.module, self.name)):
                found.append(task)
        return sorted(found)

    def where(self) -> str:
        """`path/to/module.py:line` of the declaration (the module's name when it cannot be read)."""
        node = _declaration(self.module, self.name)
        spec = importlib.util.find_spec(self.module)
        return f"{spec.origin}:{node.lineno}" if node is not None and spec and spec.origin else self.module

    def state(self) -> dict[str, torch.Tensor]:
        if not self._state:
            if self.sha256 is not None:
                device = torch.get_default_device()
                self._state.update({k: v.to(device) for k, v in load(self._shipped_bytes()).items()})
            else:
                worlds = sorted(str(p) for p in Path(__file__).parent.glob("*.py"))
                sources = [inspect.getsourcefile(self.train) or "", *worlds]
                self._state.update(warm_start(self.name, self.train, sources))
        return self._state

    def retrain(self) -> str:
        """Train the weights afresh with `train` (on one thread, as `warm_start` does), write the shipped file
        atomically and return its sha256 (what the declaration must say).

        The file's metadata names the stack that trained it (`made_with`): the same code trains other weights under
        another transformers release (its initialization differs) or on another CPU kernel set, which is why the
        weights ship instead of being trained at run time."""
        import transformers

        state = {k: v.detach().cpu().contiguous().clone() for k, v in on_one_thread(self.train).state_dict().items()}
        path = self.file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        made_with = (f"torch {torch.__version__}, transformers {transformers.__version__}, "
                     f"cpu capability {torch.backends.cpu.get_cpu_capability()}, one thread")
        save_file(state, tmp, metadata={"made_with": made_with})
        tmp.chmod(0o644)  # a shipped file, readable by everyone (safetensors writes 0600)
        os.replace(tmp, path)
        self._state.clear()
        return hashlib.sha256(path.read_bytes()).hexdigest()

    def __call__(self) -> nn.Module:
        state = self.state()
        with torch.random.fork_rng():
            model = self.build()
        model.load_state_dict(state)
        return model


def builtin_warm_starts() -> dict[str, WarmStart]:
    """Every warm start the built-in tasks declare, by name: imports every task module (found by
    `stabench.suite.registry.discover`) with the file checks deferred, so a changed or missing file can be
    listed and retrained."""
    from stabench.suite.registry import discover

    with deferred_checks():
        for builtin in discover("task").values():
            importlib.import_module(builtin.ref.partition(":")[0])
    return dict(sorted(BUILTIN.items()))


@functools.cache
def _tree(module: str) -> ast.Module | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return ast.parse(Path(spec.origin).read_text(), filename=spec.origin)


def _declaration(module: str, name: str) -> ast.Assign | None:
    """The module-level `variable = WarmStart(name, ...)` of `module`."""
    for node in (_tree(module) or ast.Module(body=[], type_ignores=[])).body:
        call = node.value if isinstance(node, ast.Assign) else None
        if (isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Constant)
                and call.args[0].value == name and isinstance(node.targets[0], ast.Name)):  # fmt: skip
            return node
    return None


def _bound_name(module: str, name: str) -> str | None:
    """The module-level variable that `module` binds to `WarmStart(name, ...)`."""
    node = _declaration(module, name)
    return node.targets[0].id if node is not None else None


def _imports(module: str, source: str, variable: str | None) -> bool:
    """Whether `module` uses `source.variable`: `from source import variable`, or `source.variable` through
    `from package import source` / `import source as alias`."""
    if variable is None:
        return False
    package, _, leaf = source.rpartition(".")
    nodes = list(ast.walk(_tree(module) or ast.Module(body=[], type_ignores=[])))
    aliases = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module == source:
            if any(a.name == variable for a in node.names):
                return True
        elif isinstance(node, ast.ImportFrom) and node.module == package:
            aliases.update(a.asname or a.name for a in node.names if a.name == leaf)
        elif isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name == source and a.asname)
    return any(isinstance(node, ast.Attribute) and node.attr == variable and isinstance(node.value, ast.Name)
               and node.value.id in aliases for node in nodes)  # fmt: skip


def enumerate_answers(n_actions: int, length: int) -> torch.Tensor:
    """Every answer, LongTensor [n_actions ** length, length], in `itertools.product` order (last token fastest)."""
    rows = list(itertools.product(range(n_actions), repeat=length))
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), length)


def prefix_logp(model: nn.Module, prompt: torch.Tensor, length: int, n_actions: int) -> torch.Tensor:
    """Next-token log-probs after every prefix: [n_actions ** (length - 1), length, n_actions].

    Row i is the i-th answer prefix of length `length - 1` (`enumerate_answers` order); entry [i, t] is the
    distribution of answer token t given the prompt and the first t tokens of that prefix. One forward.
    """
    prefixes = enumerate_answers(n_actions, length - 1)
    prompts = prompt.reshape(1, -1).expand(len(prefixes), -1)
    # answer_logits drops the last answer token; pad the prefixes with a dummy last token.
    dummy = torch.zeros(len(prefixes), 1, dtype=torch.long)
    logits = answer_logits(model, prompts, torch.cat([prefixes, dummy], dim=1), n_actions)
    return torch.log_softmax(logits.double(), dim=-1)


def all_answers_logp(prefix_lp: torch.Tensor) -> torch.Tensor:
    """log pi(answer) for every answer, [n_actions ** length] in `enumerate_answers` order, from `prefix_logp`."""
    n_prefix, length, n_actions = prefix_lp.shape
    prefixes = enumerate_answers(n_actions, length - 1)
    head = prefix_lp[:, : length - 1].gather(-1, prefixes[..., None]).squeeze(-1).sum(-1)
    return (head[:, None] + prefix_lp[:, -1]).reshape(-1)


def exact_sequence_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> float:
    """KL(pi || ref) = sum_x pi(x) (log pi(x) - log ref(x)) over all enumerated answers."""
    return float((logp.exp() * (logp - ref_logp)).sum())


class AnswerEnv(gym.Env):
    """Write an answer one token at a time; the reward function scores the whole answer at the end.

    Observation: the answer so far, padded to `length` with the special token id `n_actions`.
    Action: the next answer token. Reward: 0 until the last token, then `reward_fn(prompt, answer)`.
    The prompt, a LongTensor [1, P], defaults to the BOS token alone.
    """

    metadata = {"render_modes": []}

    def __init__(self, reward_fn: RewardFn, n_actions: int, length: int, prompt: torch.Tensor | None = None) -> None:
        self.reward_fn, self.n_actions, self.length = reward_fn, n_actions, length
        self.prompt = prompt if prompt is not None else torch.full((1, 1), n_actions, dtype=torch.long)
        self.observation_space = gym.spaces.MultiDiscrete(np.full(length, n_actions + 1, dtype=np.int64))
        self.action_space = gym.spaces.Discrete(n_actions)
        self._tokens: list[int] = []

    def _obs(self) -> np.ndarray:
        obs = np.full(self.length, self.n_actions, dtype=np.int64)
        obs[: len(self._tokens)] = self._tokens
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._tokens = []
        return self._obs(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not an answer token in 0..{self.n_actions - 1}")
        if len(self._tokens) >= self.length:
            raise RuntimeError("the answer is complete; call reset()")
        self._tokens.append(int(action))
        done = len(self._tokens) == self.length
        reward = 0.0
        if done:
            reward = float(self.reward_fn(self.prompt, torch.tensor([self._tokens], dtype=torch.long))[0])
        return self._obs(), reward, done, False, {}


class PromptedAnswerEnv(AnswerEnv):
    """`AnswerEnv` with a prompt drawn at every reset from `prompts` [N, P] (each starting with BOS, id
    `n_actions`). Observation: the prompt's tokens after BOS, then the answer so far padded with `n_actions`."""

    def __init__(self, reward_fn: RewardFn, prompts: torch.Tensor, n_actions: int, length: int) -> None:
        super().__init__(reward_fn, n_actions, length, prompts[:1])
        self.prompts = prompts
        size = prompts.shape[1] - 1 + length
        self.observation_space = gym.spaces.MultiDiscrete(np.full(size, n_actions + 1, dtype=np.int64))

    def _obs(self) -> np.ndarray:
        head = self.prompt[0, 1:].cpu().numpy()
        return np.concatenate([head, super()._obs()])

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        gym.Env.reset(self, seed=seed)
        self.prompt = self.prompts[int(self.np_random.integers(len(self.prompts)))][None]
        self._tokens = []
        return self._obs(), {}
