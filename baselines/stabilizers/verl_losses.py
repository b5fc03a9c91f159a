"""verl's policy losses on the suite, unchanged: the trainer's policy term replaced by a function of verl's signature.

In verl (`verl.trainer.ppo.core_algos`, 0.9.1) a policy loss is a function registered with
`@register_policy_loss(name)` in `POLICY_LOSS_REGISTRY`, called by the actor as

    pg_loss, pg_metrics = fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                             rollout_is_weights)

on [batch, response_length] tensors; it returns the aggregated loss (0-d) and a dict of float metrics. The
seventh argument is `rollout_is_weights` in verl 0.9.1 (detached, truncated importance weights pi_old / pi_rollout
that verl's trainer computes from the rollout log-probs when `algorithm.rollout_correction.rollout_is` is set;
None by default), not the rollout log-probs themselves.

Methods, resolved by `suite.registry` (the prefix `verl:`):
- `verl:NAME`: `POLICY_LOSS_REGISTRY[NAME]` of the installed verl (`vanilla`, `gspo`, `cispo`, `sapo`, `clip_cov`,
  `kl_cov`, `geo_mean`, `gpg`, `dro`, `dppo_tv`, `dppo_kl`, `bypass_mode` in 0.9.1, and any a verl plugin registers);
  needs verl (`pip install -e ".[verl]"`).
- `verl:path/to/file.py:FUNCTION` (or `verl:package.module:FUNCTION`): your own function of verl's signature, by its
  name in that module (decorated with verl's `@register_policy_loss` or not), recorded as `verl:<module>.<FUNCTION>`.
  It needs verl only if the module imports it; without verl the config it receives is a stand-in with the same
  fields (below).

How the suite's batch (`suite.api.BATCH_SCHEMA`) becomes verl's arguments, in the `loss` hook:
- `log_prob` = `logp` (with the graph), `advantages` = `advantages` (what the trainer's term uses),
  `response_mask` = `mask` as bool (verl's actor passes a bool mask). A step rollout (PPO, [B]) is [B, 1]: each
  action its own one-token sequence, so a sequence-level loss (gspo, geo_mean) is a token-level one there.
- `old_log_prob` = `anchor_logp`, the denominator of the trainer's own ratio (the stored sampling log-prob in PPO
  and tool-PPO, the learner's recomputed pi_old in GRPO and token-PPO). Two of verl's modes name another one:
  `bypass_mode` gets `behaviour_logp` (verl's bypass mode sets old_log_prob = rollout_log_prob), and with
  `rollout_is` set the loss gets `old_logp` (verl's decoupled mode: the trust region around the learner's pi_old).
- `rollout_is_weights` = None (verl's default: no rollout correction). With `rollout_is = "token"` or `"sequence"`
  (a class attribute; subclass to set it) they are verl's truncated importance weights from `old_logp -
  behaviour_logp`: token: min(exp(log r_t), C), sequence: min(exp(sum_t log r_t), C) on every token of the
  answer, C = `rollout_is_threshold` (2.0, verl's default), log-ratios clamped to [-20, 20], zero on padding,
  detached (`compute_rollout_correction_weights` without batch normalization; IcePop's "lower_upper" threshold
  is not offered). Such a method needs `behaviour_policy`: where the learner samples the weights are exactly 1.
- `loss_agg_mode` = the verl mode whose weights equal the trainer's `token_weight` on this minibatch (one rank,
  local counts: `global_batch_info` is empty): GRPO's `token-mean` and the other trainers' token means (PPO's
  1 / minibatch, token-PPO's and tool-PPO's mask / tokens) are verl's `token-mean`; GRPO's `seq-mean` (mean over
  answers of each answer's token mean) is `seq-mean-token-mean`; GRPO's `constant` (sum / (answers x answer_len),
  Dr. GRPO) is `seq-mean-token-sum-norm` (verl divides by the mask's width, the answer length). verl counts only
  sequences with a real token where the suite counts every row; the trainers never make an empty answer. A
  `token_weight` that is none of verl's modes (a rescaled or filtered weighting) cannot be passed through verl's
  signature, which takes a mode name and aggregates inside: the hook then raises (the run is recorded as diverged,
  named). `loss_agg_mode` set to a mode name (a class attribute) overrides the match. Some of verl's losses ignore
  the mode: `sapo` always takes `seq-mean-token-mean`, `geo_mean` a plain mean over sequences.
- `config`: verl's own `ActorConfig` where verl is installed (gspo, cispo and sapo assert that type), else a stand-in
  mapping with the same fields (attribute and item access, `get`). `clip_ratio` = `clip_ratio_low` = the trainer's
  `clip_low`, `clip_ratio_high` = its `clip_high` (from the batch; the settings `clip_ratio_low`/`clip_ratio_high`
  override them where >= 0); `clip_ratio_c` 3.0, `tau_pos` 1.0, `tau_neg` 1.05, `policy_loss.clip_cov_ratio`
  2e-4, `clip_cov_lb` 1.0, `clip_cov_ub` 5.0, `kl_cov_ratio` 2e-4, `ppo_kl_coef` 0.1 (verl's defaults), and
  `policy_loss.dro_beta` 0.1 (verl leaves it unset and its `dro` refuses to run without it: 0.1 is ours),
  `loss_mode` the method's verl name, `global_batch_info` {} (one rank).
The returned loss replaces the trainer's `policy` term; the other terms (KL, value, entropy) stay the trainer's. The
metrics verl returns are kept on the stabilizer (`last_metrics`), not logged: the suite's loss report (`approx_kl`,
`clip_frac`, ...) is the trainer's, computed before the hook.

Where it acts: on every task whose trainer hands the hook these keys, all four policy-gradient trainers (the
rollout-corrected variant only where a sampler differs from the learner). Each method's settings are its verl
knobs (`SEARCH_SPACES`: `verl:sapo@tau_neg=2`, `verl:gspo@clip_ratio_low=0.0003,clip_ratio_high=0.0004`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch
from ray import tune
from stabench.suite.api import BEHAVIOUR_POLICY, StabenchError, Stabilizer

VERL_PREFIX = "verl:"
VERL_VERSION = "0.9.1"  # the release the extra pins and the adapter was checked against
INSTALL_HINT = 'pip install -e ".[verl]"'
# verl's aggregation modes, in the order a trainer's `token_weight` is matched against them (where several give the
# same weights, fixed-length answers, the first is named).
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum",
                              "token-sum")
SAFETY_BOUND = 20.0  # verl's clamp on a log importance ratio before exp()
POLICY_LOSS_KEYS = frozenset({"logp", "anchor_logp", "advantages", "mask", "token_weight", "clip_low", "clip_high"})
# Each verl loss's own knobs, searched by `stabench tune` and set with `verl:NAME@key=value`.
SEARCH_SPACES: dict[str, dict[str, Any]] = {
    "vanilla": {"clip_ratio_c": tune.uniform(1.5, 10.0)},  # the dual clip's bound on negative advantages
    "gspo": {"clip_ratio_low": tune.loguniform(1e-4, 1e-2), "clip_ratio_high": tune.loguniform(1e-4, 1e-2)},
    "cispo": {"clip_ratio_low": tune.uniform(0.1, 1.0), "clip_ratio_high": tune.loguniform(0.1, 10.0)},
    "sapo": {"tau_pos": tune.loguniform(0.3, 30.0), "tau_neg": tune.loguniform(0.3, 30.0)},
    "clip_cov": {"clip_cov_ratio": tune.loguniform(1e-4, 1e-1)},
    "kl_cov": {"kl_cov_ratio": tune.loguniform(1e-4, 1e-1), "ppo_kl_coef": tune.loguniform(0.01, 10.0)},
    "dro": {"dro_beta": tune.loguniform(0.01, 10.0)},
}


def core_algos() -> ModuleType:
    """verl's `verl.trainer.ppo.core_algos`, or one clear error saying how to install it."""
    try:
        return importlib.import_module("verl.trainer.ppo.core_algos")
    except ImportError as exc:
        if (getattr(exc, "name", None) or "").split(".")[0] == "verl":  # verl itself is missing (or blocked)
            raise StabenchError(f"verl is not installed: {INSTALL_HINT} (verl=={VERL_VERSION})") from exc
        raise StabenchError(f"verl failed to import ({type(exc).__name__}: {exc}); {INSTALL_HINT}") from exc


def installed() -> bool:
    """True where verl's `core_algos` imports."""
    try:
        core_algos()
    except StabenchError:
        return False
    return True


def registered_names() -> list[str]:
    """The names in the installed verl's `POLICY_LOSS_REGISTRY` (empty without verl)."""
    return sorted(core_algos().POLICY_LOSS_REGISTRY) if installed() else []


def per_sequence(x: torch.Tensor) -> torch.Tensor:
    """A per-action tensor as verl's [sequences, length]: a step rollout's [B] becomes [B, 1]."""
    return x if x.dim() > 1 else x[:, None]


def mode_weights(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """w with verl's `agg_loss(loss_mat, mask, mode)` = sum(loss_mat * w), on one rank with local counts."""
    m = mask.to(torch.float64)
    rows = (m.sum(-1) > 0).sum().clamp_min(1)  # verl counts the sequences with a real token
    if mode == "token-mean":
        return m / m.sum().clamp_min(1)
    if mode == "seq-mean-token-mean":
        return m / (m.sum(-1, keepdim=True) + 1e-8) / rows
    if mode == "seq-mean-token-sum-norm":
        return m / (rows * m.shape[-1])
    if mode == "seq-mean-token-sum":
        return m / rows
    if mode == "token-sum":
        return m
    raise ValueError(f"unknown loss_agg_mode {mode!r}; verl's: {', '.join(AGG_MODES)}")


def trainer_agg_mode(mask: torch.Tensor, token_weight: torch.Tensor) -> str:
    """The verl `loss_agg_mode` whose weights are the trainer's `token_weight` (both [sequences, length])."""
    w = token_weight.to(torch.float64)
    for mode in AGG_MODES:
        if torch.allclose(w, mode_weights(mask, mode), rtol=1e-5, atol=1e-12):
            return mode
    raise ValueError(f"the trainer's token_weight is none of verl's loss_agg_modes ({', '.join(AGG_MODES)}); "
                     "set loss_agg_mode to aggregate with one of them anyway")


def rollout_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float) -> torch.Tensor:
    """verl's truncated importance weights (TIS) from log(pi_old / pi_rollout) per token, [sequences, length]."""
    m = mask.to(log_ratio.dtype)
    if level == "sequence":
        log_ratio = (log_ratio * m).sum(-1, keepdim=True).expand_as(log_ratio)
    return (torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * m).clamp(max=threshold).detach()


class Fields(dict):
    """verl's config interface without verl: a mapping whose keys are also attributes (`config.clip_ratio`,
    `config.get("clip_ratio_c", 3.0)`, `config.policy_loss.kl_cov_ratio`), like its `BaseConfig` and `DictConfig`."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def actor_config(fields: dict[str, Any], policy_loss: dict[str, Any]) -> Any:
    """verl's `ActorConfig` holding `fields` (its `PolicyLossConfig` holding `policy_loss`) where verl is installed;
    elsewhere a `Fields` stand-in with the same keys."""
    try:
        from verl.workers.config import ActorConfig, PolicyLossConfig
    except ImportError:
        return Fields(fields, policy_loss=Fields(policy_loss), global_batch_info={})
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **fields,
                       policy_loss=PolicyLossConfig(**policy_loss))


class VerlPolicyLoss(Stabilizer):
    """The trainer's policy term replaced by a verl policy loss `fn` (one subclass per method: `method_class`)."""

    name = "verl"
    listed = False  # a base: each verl loss runs as `verl:NAME` (`method_class`)
    needs = POLICY_LOSS_KEYS
    loss_name: ClassVar[str] = "vanilla"  # config.policy_loss.loss_mode
    fn: ClassVar[Callable[..., Any] | None] = None  # a staticmethod in each method's class
    # config fields (verl's defaults; dro_beta is ours: verl leaves it unset); a negative clip: the trainer's
    clip_ratio_low: float = -1.0
    clip_ratio_high: float = -1.0
    clip_ratio_c: float = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    ppo_kl_coef: float = 0.1
    dro_beta: float = 0.1
    loss_agg_mode: str = "trainer"  # or one of AGG_MODES
    rollout_is: str = ""  # "", "token" or "sequence": verl's rollout correction weights from behaviour_logp
    rollout_is_threshold: float = 2.0

    def __init__(self) -> None:
        if self.loss_agg_mode not in ("trainer", *AGG_MODES):
            raise StabenchError(f"{self.name}: loss_agg_mode {self.loss_agg_mode!r} is not 'trainer' or one of "
                                f"verl's: {', '.join(AGG_MODES)}")
        if self.rollout_is not in ("", "token", "sequence"):
            raise StabenchError(f"{self.name}: rollout_is {self.rollout_is!r} is not '', 'token' or 'sequence'")
        extra = {"behaviour_logp"} if self.loss_name == "bypass_mode" else set()
        if self.rollout_is:
            extra |= {"old_logp", "behaviour_logp", BEHAVIOUR_POLICY}
        self.needs = POLICY_LOSS_KEYS | extra  # type: ignore[misc]
        self.last_metrics: dict[str, Any] = {}
        self._configs: dict[tuple[float, float, str], Any] = {}

    def config(self, clip_low: float, clip_high: float, mode: str) -> Any:
        """verl's config for this method at the trainer's clip and aggregation (built once per combination)."""
        low = self.clip_ratio_low if self.clip_ratio_low >= 0 else clip_low
        high = self.clip_ratio_high if self.clip_ratio_high >= 0 else clip_high
        key = (low, high, mode)
        if key not in self._configs:
            fields = {"clip_ratio": low, "clip_ratio_low": low, "clip_ratio_high": high,
                      "clip_ratio_c": self.clip_ratio_c, "tau_pos": self.tau_pos, "tau_neg": self.tau_neg,
                      "loss_agg_mode": mode}
            policy_loss = {"loss_mode": self.loss_name, "clip_cov_ratio": self.clip_cov_ratio,
                           "clip_cov_lb": self.clip_cov_lb, "clip_cov_ub": self.clip_cov_ub,
                           "kl_cov_ratio": self.kl_cov_ratio, "ppo_kl_coef": self.ppo_kl_coef,
                           "dro_beta": self.dro_beta}
            self._configs[key] = actor_config(fields, policy_loss)
        return self._configs[key]

    def arguments(self, batch: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
        """verl's seven arguments built from the suite's batch (the module says how)."""
        mask = per_sequence(batch["mask"])
        if self.loss_agg_mode == "trainer":
            mode = trainer_agg_mode(mask, per_sequence(batch["token_weight"]))
        else:
            mode = self.loss_agg_mode
        weights = None
        if self.loss_name == "bypass_mode":
            old = batch["behaviour_logp"]
        elif self.rollout_is:
            old = batch["old_logp"]
            log_ratio = per_sequence(batch["old_logp"] - batch["behaviour_logp"])
            weights = rollout_is_weights(log_ratio, mask, self.rollout_is, self.rollout_is_threshold)
        else:
            old = batch["anchor_logp"]
        config = self.config(float(batch["clip_low"]), float(batch["clip_high"]), mode)
        return (per_sequence(old).detach(), per_sequence(batch["logp"]), per_sequence(batch["advantages"]),
                mask > 0, mode, config, weights)

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = type(self).fn(*self.arguments(batch))
        value, metrics = out if isinstance(out, tuple) else (out, {})
        self.last_metrics = dict(metrics or {})
        return {**terms, "policy": value}


def _user_function(ref: str) -> tuple[Callable[..., Any], str]:
    """`file.py:FUNCTION` or `module:FUNCTION`: the function, and the method's recorded name."""
    from stabench.suite.registry import load_object

    target, _, attr = ref.rpartition(":")
    try:
        fn = load_object(ref)
    except StabenchError as exc:
        cause = exc.__cause__
        if isinstance(cause, ImportError) and (getattr(cause, "name", None) or "").split(".")[0] == "verl":
            raise StabenchError(f"{VERL_PREFIX}{ref} imports verl, which is not installed: {INSTALL_HINT}") from exc
        raise
    if not callable(fn) or isinstance(fn, type):
        raise StabenchError(f"{VERL_PREFIX}{ref}: {attr!r} is not a function of verl's policy-loss signature")
    stem = Path(target).stem if target.endswith(".py") or "/" in target else target
    return fn, f"{VERL_PREFIX}{stem}.{attr}"


@functools.cache
def method_class(ref: str) -> type:
    """The stabilizer class of the method `verl:<ref>`: a name in verl's `POLICY_LOSS_REGISTRY`, or a
    `file.py:FUNCTION` / `module:FUNCTION` reference (cached: one class per method)."""
    if ":" in ref:
        fn, name = _user_function(ref)
        loss_name, space, version = ref.rpartition(":")[2], {}, "1"
    else:
        algos = core_algos()
        if ref not in algos.POLICY_LOSS_REGISTRY:
            known = ", ".join(f"{VERL_PREFIX}{n}" for n in sorted(algos.POLICY_LOSS_REGISTRY))
            raise StabenchError(f"unknown verl policy loss {ref!r}; verl registers: {known}")
        fn, name, loss_name = algos.POLICY_LOSS_REGISTRY[ref], f"{VERL_PREFIX}{ref}", ref
        space = SEARCH_SPACES.get(ref, {})
        version = f"verl-{importlib.import_module('verl').__version__}"
    qualname = f"VerlPolicyLoss[{name}]"
    doc = f"verl's policy loss {name} (`{getattr(fn, '__name__', loss_name)}`)."
    return type(qualname, (VerlPolicyLoss,), {
        "name": name, "loss_name": loss_name, "fn": staticmethod(fn), "search_space": space, "version": version,
        "__module__": __name__, "__qualname__": qualname, "__doc__": doc})
