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

import hashlib
import inspect
import itertools
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import gymnasium as gym
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from stabench.baselines import tokens as shared_tokens
from stabench.baselines.tokens import (  # noqa: F401  (re-exported for the tasks)
    RewardFn,
    answer_logits,
    on_default_device,
    sample_answers,
    tiny_policy,
)
from torch import nn

T = TypeVar("T")


def on_one_thread(fn: Callable[[], T]) -> T:
    """fn() on one torch thread whatever the caller uses.

    A task's warm start is trained once and cached (`warm_start`); on one thread its float sums always run in
    the same order, so every run of the task starts from the same weights.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def cache_dir() -> Path | None:
    """Where warm starts are cached: `$STABENCH_CACHE`, else `$XDG_CACHE_HOME/stabench` (`~/.cache/stabench`);
    None when `STABENCH_CACHE=off`."""
    setting = os.environ.get("STABENCH_CACHE", "")
    if setting.lower() == "off":
        return None
    if setting:
        return Path(setting).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stabench"


def warm_start(name: str, train: Callable[[], nn.Module], source: str | Sequence[str]) -> dict[str, torch.Tensor]:
    """The weights of a task's warm start: trained by `train()` on one thread, or read from the disk cache.

    Every worker process of a sweep needs the same warm starts, and training them took seconds per task and
    worker. The cache key covers what could change the weights: `name`, the source of the task's module (`source`,
    its path, or several paths), of this one and of the shared policy code, the torch and transformers versions,
    the device and the CPU's kernel set; any change trains afresh. Entries are safetensors (no pickle) written
    atomically, so concurrent workers at worst train the same start twice. A cache that cannot be written is
    reported as a warning and otherwise ignored.
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


class WarmStart:
    """A task's warm start as a factory: `warm()` is a fresh model holding the warm weights.

    The weights are trained once per process by `train` (on one thread, cached on disk by `warm_start` under
    `name`, keyed on the source of the module that defines `train` and of every shared world module, which
    training code may call); `build` makes the untrained network, under `torch.random.fork_rng` so that building a
    model never moves the caller's random state.
    """

    def __init__(self, name: str, train: Callable[[], nn.Module], build: Callable[[], nn.Module]) -> None:
        self.name, self.train, self.build = name, train, build
        self._state: dict[str, torch.Tensor] = {}

    def state(self) -> dict[str, torch.Tensor]:
        if not self._state:
            worlds = sorted(str(p) for p in Path(__file__).parent.glob("*.py"))
            sources = [inspect.getsourcefile(self.train) or "", *worlds]
            self._state.update(warm_start(self.name, self.train, sources))
        return self._state

    def __call__(self) -> nn.Module:
        state = self.state()
        with torch.random.fork_rng():
            model = self.build()
        model.load_state_dict(state)
        return model


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
