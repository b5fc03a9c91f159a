"""Diagnostics: pure functions from a trainer's state (or plain tensors) to named scalars.

A metric that cannot be computed is reported as NaN (missing), never as zero. Definitions:

- KL estimators (Schulman's k1, k2, k3) of KL(q || p) from samples x ~ q with log-ratio
  d = log p(x) - log q(x): k1 = -d, k2 = d^2 / 2, k3 = (e^d - 1) - d. k1 and k3 are unbiased, k2 is
  biased (it estimates a second-order approximation). In RL q is the policy and p the reference.
- Per-layer gradient norm: the L2 norm of the concatenated gradients of one layer's parameters.
- Dormant unit (Sokar et al.): s_i = E|h_i| / mean_k E|h_k| over a batch; dormant if s_i <= tau.
- Effective rank: exp of the entropy of the normalized singular values of a feature matrix.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

import torch
from stabench.suite.api import TrainState
from torch import nn

Diagnostic = Callable[[TrainState], dict[str, float]]


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-sample estimate of KL(policy || reference) from samples of the policy, d = ref_logp - logp:
    k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d (keeps the graph of `logp`)."""
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.pow(2)
    if estimator == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"unknown KL estimator {estimator!r}")


def kl_estimators(logp: torch.Tensor, ref_logp: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample k1, k2, k3 estimates of KL(policy || reference) from samples of the policy."""
    return {k: kl_estimate(logp, ref_logp, k) for k in ("k1", "k2", "k3")}


# Below these a float's exp is 0 (float32 underflows below about -104, float64 below about -745).
_EXP_ZERO = {torch.float32: -110.0, torch.float64: -750.0}


def probs_of(logp: torch.Tensor) -> torch.Tensor:
    """`logp.exp()`, the same numbers: log-probabilities far below the underflow (a masked token's -1e9) are
    raised to a value whose exp is 0 as well, because the CPU's exp takes a slow path on underflow (about 30x
    on a batch of masked logits). The gradient there is 0 either way."""
    floor = _EXP_ZERO.get(logp.dtype)
    return logp.exp() if floor is None else logp.clamp_min(floor).exp()


def kl_of_logp(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last axis, from normalized log-probabilities (a caller that has them saves a
    log-softmax, which costs as much as a forward on a tiny vocabulary)."""
    return (probs_of(logp) * (logp - logq)).sum(-1)


def exact_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last axis, from unnormalized logits."""
    return kl_of_logp(torch.log_softmax(p_logits, dim=-1), torch.log_softmax(q_logits, dim=-1))


def entropy_of_logp(logp: torch.Tensor) -> torch.Tensor:
    """Entropy in nats from normalized log-probabilities over the last axis (see `kl_of_logp`)."""
    p = probs_of(logp)
    return -(p * logp).masked_fill(p == 0, 0.0).sum(-1)  # 0 log 0 = 0 (a -inf logit is an impossible token)


def categorical_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of the categorical distributions given by logits over the last axis."""
    return entropy_of_logp(torch.log_softmax(logits, dim=-1))


def layer_groups(model: nn.Module) -> OrderedDict[str, list[nn.Parameter]]:
    """The model's parameters grouped by the module that owns them, in registration order.

    A "layer" is any module with parameters of its own (a Linear, a LayerNorm, an Embedding).
    """
    groups: OrderedDict[str, list[nn.Parameter]] = OrderedDict()
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own:
            groups[name or "root"] = own
    return groups


def per_layer_grad_norms(model: nn.Module, grads: Mapping[str, torch.Tensor] | None = None) -> dict[str, float]:
    """L2 gradient norm of each layer (see `layer_groups`). Layers with no gradient report NaN.

    `grads` maps parameter names to gradients; by default the parameters' `.grad` are read.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, float] = {}
    for layer, params in layer_groups(model).items():
        sq, seen = 0.0, False
        for p in params:
            g = grads.get(names[id(p)]) if grads is not None else p.grad
            if g is not None:
                sq += float(g.detach().pow(2).sum())
                seen = True
        out[layer] = math.sqrt(sq) if seen else math.nan
    return out


def total_grad_norm(norms: Mapping[str, float]) -> float:
    finite = [v for v in norms.values() if math.isfinite(v)]
    return math.sqrt(sum(v * v for v in finite)) if finite else math.nan


def dormant_share(activations: torch.Tensor, tau: float = 0.025) -> float:
    """Share of units (columns of a batch x units activation matrix) that are dormant at `tau`."""
    score = activations.detach().abs().mean(0)
    mean = score.mean()
    if not torch.isfinite(mean) or mean <= 0:
        return 1.0 if torch.isfinite(mean) else math.nan
    return float((score / mean <= tau).float().mean())


def effective_rank(features: torch.Tensor) -> float:
    """exp(H(p)), p = singular values / their sum; NaN for an all-zero matrix."""
    s = torch.linalg.svdvals(features.detach().double())
    total = s.sum()
    if total <= 0 or not torch.isfinite(total):
        return math.nan
    p = s / total
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


# Registry of named diagnostics that a task can list in `Task.diagnostics`; each reads a TrainState.
DIAGNOSTICS: dict[str, Diagnostic] = {}


def diagnostic(name: str) -> Callable[[Diagnostic], Diagnostic]:
    def register(fn: Diagnostic) -> Diagnostic:
        DIAGNOSTICS[name] = fn
        return fn

    return register


def diagnose(names: Iterable[str], state: TrainState) -> dict[str, float]:
    """The columns of the named diagnostics on one iteration's state, in the order named."""
    row: dict[str, float] = {}
    for name in names:
        row.update(DIAGNOSTICS[name](state))
    return row


class DiagnosedRun:
    """A run (`suite.api.Run`) whose rows carry its task's declared diagnostics, computed here for every task.

    A subclass trains one iteration in `train`, which returns the task's own columns and the iteration's
    `TrainState`; `step` appends to them the columns of each diagnostic in `self.diagnostics` (the task's
    `Task.diagnostics`, handed to the run when the task builds it), read from that state."""

    diagnostics: tuple[str, ...] = ()

    def train(self, injected: bool) -> tuple[dict[str, float], TrainState]:
        raise NotImplementedError

    def step(self, injected: bool) -> dict[str, float]:
        row, state = self.train(injected)
        row.update(diagnose(self.diagnostics, state))
        return row


@diagnostic("grad_norms")
def grad_norms(state: TrainState) -> dict[str, float]:
    """Per-layer gradient norms as columns `grad_norm/<layer index>` plus `grad_norm_total`."""
    norms = per_layer_grad_norms(state.model, state.grads)
    row = {f"grad_norm/{i:02d}": v for i, v in enumerate(norms.values())}
    row["grad_norm_total"] = total_grad_norm(norms)
    return row


@diagnostic("dormant")
def dormant(state: TrainState) -> dict[str, float]:
    """Dormant-unit share over the hidden activations the trainer stored in `extras["activations"]`."""
    acts = state.extras.get("activations")
    if not acts:
        return {"dormant_share": math.nan}
    units = sum(a.shape[1] for a in acts)
    dormant_units = sum(dormant_share(a) * a.shape[1] for a in acts)
    return {"dormant_share": dormant_units / units}


@diagnostic("kl_estimators")
def kl_estimator_means(state: TrainState) -> dict[str, float]:
    """Batch means of k1, k2, k3 per token, the full-vocabulary per-token KL, and their disagreement.

    Reads `batch["logp"]`, `batch["ref_logp"]`, `batch["mask"]` and, when present,
    `extras["full_vocab_kl"]` (per-token KL summed over the vocabulary, same shape as the mask).
    """
    mask = state.batch["mask"].float()
    n = mask.sum().clamp_min(1)
    est = kl_estimators(state.batch["logp"].detach(), state.batch["ref_logp"].detach())
    row = {f"kl_{k}": float((v * mask).sum() / n) for k, v in est.items()}
    full = state.extras.get("full_vocab_kl")
    row["kl_full_vocab"] = float((full * mask).sum() / n) if full is not None else math.nan
    row["kl_k2_over_k3"] = row["kl_k2"] / row["kl_k3"] if row["kl_k3"] > 0 else math.nan
    return row


@diagnostic("churn")
def churn(state: TrainState) -> dict[str, float]:
    """Policy and value churn on a fixed set of held-out states, per gradient update (Schaul et al. 2022).

    Reads `extras["heldout_q"]`, a tensor (U + 1) x S x A of Q on S held-out states before each of the
    iteration's U updates and after the last, and, when present, `extras["heldout_in_batch"]` (U x S, True
    where a held-out state's observation is in that update's batch). Columns:
    - `policy_churn`: share of held-out states whose greedy action argmax_a Q changes across one update,
      averaged over the U updates;
    - `policy_churn_out`: the same, counting only the states outside that update's batch (Schaul et al.'s
      out-of-batch churn; NaN without the mask);
    - `value_churn`: mean |dQ| over held-out states and actions across one update;
    - `policy_churn_iter`: share whose greedy action differs between the start and the end of the iteration.
    All NaN when no update ran.
    """
    q = state.extras.get("heldout_q")
    if q is None or q.shape[0] < 2:
        return {"policy_churn": math.nan, "policy_churn_out": math.nan, "value_churn": math.nan,
                "policy_churn_iter": math.nan}
    q = q.detach()
    greedy = q.argmax(-1)
    flips = greedy[1:] != greedy[:-1]  # U x S
    mask = state.extras.get("heldout_in_batch")
    if mask is not None and mask.shape == flips.shape and bool((~mask).any()):
        out = float((flips & ~mask).sum() / (~mask).sum())
    else:
        out = math.nan
    return {
        "policy_churn": float(flips.float().mean()),
        "policy_churn_out": out,
        "value_churn": float((q[1:] - q[:-1]).abs().mean()),
        "policy_churn_iter": float((greedy[-1] != greedy[0]).float().mean()),
    }


SPECTRUM_COLUMNS = 16


@diagnostic("spectrum")
def spectrum(state: TrainState) -> dict[str, float]:
    """Effective rank and normalized singular values of a fixed batch's features, `extras["features"]`.

    `features` is batch x units (a task stores its penultimate features on a fixed held-out batch there).
    Columns: `effective_rank` and `sv/00`..`sv/15`, the singular values divided by their sum, largest first
    (0 past the matrix's smaller side); all NaN when no features were stored or they are all zero.
    """
    z = state.extras.get("features")
    names = [f"sv/{i:02d}" for i in range(SPECTRUM_COLUMNS)]
    if z is None:
        return {"effective_rank": math.nan, **dict.fromkeys(names, math.nan)}
    s = torch.linalg.svdvals(z.detach().double())
    total = s.sum()
    if total <= 0 or not torch.isfinite(total):
        return {"effective_rank": math.nan, **dict.fromkeys(names, math.nan)}
    p = (s / total).tolist()
    row = {name: p[i] if i < len(p) else 0.0 for i, name in enumerate(names)}
    row["effective_rank"] = effective_rank(z)
    return row


# --- Token-family diagnostics: pure functions on tensors, then the registered readers of a TrainState. ----
def gradient_variance(grads: list[torch.Tensor]) -> tuple[float, float]:
    """Spread of the policy gradient across minibatches of one iteration.

    With flat per-minibatch gradients g_1..g_K and their mean g: the trace of their unbiased sample
    covariance, sum_k ||g_k - g||^2 / (K - 1), and that trace relative to ||g||^2 (a noise-to-signal
    ratio: above 1 the minibatches disagree more than they agree). NaN for fewer than two minibatches.
    """
    if len(grads) < 2:
        return math.nan, math.nan
    g = torch.stack([x.detach().double() for x in grads])
    mean = g.mean(0)
    trace = float((g - mean).pow(2).sum() / (len(grads) - 1))
    signal = float(mean.pow(2).sum())
    return trace, (trace / signal if signal > 0 else math.nan)


def effective_sample_size(weights: torch.Tensor) -> float:
    """Kish's effective sample size as a share of the sample: (sum w)^2 / (N sum w^2), in (0, 1]; NaN if empty."""
    w = weights.detach().double().reshape(-1)
    if w.numel() == 0 or float(w.pow(2).sum()) == 0:
        return math.nan
    return float(w.sum().pow(2) / (w.numel() * w.pow(2).sum()))


def ratio_tails(ratio: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(99th percentile, Kish ESS share) of the importance ratios where `mask` is true; NaN where none are."""
    selected = ratio.detach().double()[mask.bool()]
    if selected.numel() == 0:
        return math.nan, math.nan
    return float(torch.quantile(selected, 0.99)), effective_sample_size(selected)


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): 1 for a perfect critic, 0 for a constant one, NaN if Var = 0."""
    v, r = values.detach().double().reshape(-1), returns.detach().double().reshape(-1)
    var = float(r.var(unbiased=False))
    return 1 - float((r - v).var(unbiased=False)) / var if var > 0 else math.nan


@diagnostic("grad_variance")
def grad_variance(state: TrainState) -> dict[str, float]:
    """`grad_var` and `grad_var_rel` (see `gradient_variance`) over `extras["minibatch_grads"]`."""
    trace, rel = gradient_variance(state.extras.get("minibatch_grads") or [])
    return {"grad_var": trace, "grad_var_rel": rel}


@diagnostic("lengths")
def lengths(state: TrainState) -> dict[str, float]:
    """Answer lengths (tokens up to and including EOS, from the batch mask): mean, 90th percentile, share at the cap."""
    mask = state.batch["mask"].float()
    n = mask.sum(1)
    return {
        "length_mean": float(n.mean()),
        "length_p90": float(torch.quantile(n, 0.9)),
        "length_cap_share": float((n >= mask.shape[1]).float().mean()),
    }


@diagnostic("ratio_tails")
def ratio_tail_split(state: TrainState) -> dict[str, float]:
    """Ratio p99 and ESS share over all tokens, tool-state tokens and text tokens.

    Reads `extras["ratio"]` (per-token pi_theta / pi_behaviour after the update), `batch["mask"]` and
    `extras["tool_mask"]` (true on tokens the policy wrote in a tool state).
    """
    ratio, mask = state.extras.get("ratio"), state.batch["mask"].bool()
    if ratio is None:
        return {f"ratio_{s}{k}": math.nan for s in ("p99", "ess") for k in ("", "_tool", "_text")}
    tool = state.extras.get("tool_mask", torch.zeros_like(mask)).bool() & mask
    row = {}
    for suffix, where in (("", mask), ("_tool", tool), ("_text", mask & ~tool)):
        row[f"ratio_p99{suffix}"], row[f"ratio_ess{suffix}"] = ratio_tails(ratio, where)
    return row


@diagnostic("value_fit")
def value_fit(state: TrainState) -> dict[str, float]:
    """Critic quality on the iteration's batch: `value_explained_variance` and `value_error` (RMSE).

    Reads `extras["values"]` and `extras["returns"]` (same shape), the critic's predictions before its update.
    """
    v, r = state.extras.get("values"), state.extras.get("returns")
    if v is None or r is None:
        return {"value_explained_variance": math.nan, "value_error": math.nan}
    err = float((v.detach().double() - r.detach().double()).pow(2).mean().sqrt())
    return {"value_explained_variance": explained_variance(v, r), "value_error": err}


@diagnostic("reward_disagreement")
def reward_disagreement(state: TrainState) -> dict[str, float]:
    """`rm_disagreement`: batch mean of the std across a reward-model ensemble, `extras["reward_ensemble"]` [M, B]."""
    preds = state.extras.get("reward_ensemble")
    if preds is None or preds.shape[0] < 2:
        return {"rm_disagreement": math.nan}
    return {"rm_disagreement": float(preds.detach().double().std(0).mean())}


def engine_gap(behaviour_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The training-inference gap on the sampled tokens, as verl's rollout correction logs it.

    With mu the sampler (`behaviour_logp`) and pi_old the learner (`old_logp`), over the masked tokens drawn
    from mu, d = log pi_old - log mu:
    `engine_kl` = E_mu[-d] (k1 estimate of KL(mu || pi_old)), `engine_k3` = E_mu[exp(d) - 1 - d] (k3, >= 0),
    `engine_chi2` = E_mu[exp(2 d)] - 1 (chi-square divergence estimate of pi_old from mu),
    `engine_prob_diff_max` = max |pi_old - mu| of a sampled token,
    `engine_low_ratio` = share of tokens with pi_old / mu < 1e-2. All 0 when the learner sampled.
    """
    keep = mask > 0
    d = (old_logp - behaviour_logp)[keep].double()
    if d.numel() == 0:
        return {k: float("nan") for k in ("engine_kl", "engine_k3", "engine_chi2", "engine_prob_diff_max",
                                          "engine_low_ratio")}
    diff = (old_logp.double().exp() - behaviour_logp.double().exp())[keep].abs()
    return {
        "engine_kl": float((-d).mean()),
        "engine_k3": float((torch.expm1(d) - d).mean()),
        "engine_chi2": float(torch.exp(2 * d).mean() - 1),
        "engine_prob_diff_max": float(diff.max()),
        "engine_low_ratio": float((d < math.log(1e-2)).double().mean()),
    }


@diagnostic("engine_gap")
def engine_gap_of(state: TrainState) -> dict[str, float]:
    """`engine_gap` of the iteration's batch (sampler `behaviour_logp` against the learner's `old_logp`)."""
    b = state.batch
    return engine_gap(b["behaviour_logp"], b["old_logp"], b["mask"])


def live_groups(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """[n_groups] bool: True where a group's rewards are not all equal (group indices 0 .. n_groups - 1)."""
    members = group[None, :] == torch.arange(int(group.max()) + 1)[:, None]  # [n_groups, B]
    r = rewards.float()[None].expand_as(members)
    return r.masked_fill(~members, -torch.inf).amax(1) > r.masked_fill(~members, torch.inf).amin(1)


def group_means(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """[n_groups]: each group's mean reward (its success rate under a 0/1 reward)."""
    n = int(group.max()) + 1
    total = torch.zeros(n, dtype=rewards.dtype).index_add_(0, group, rewards)
    count = torch.zeros(n, dtype=rewards.dtype).index_add_(0, group, torch.ones_like(rewards))
    return total / count


def rare_successes(rewards: torch.Tensor, group: torch.Tensor, advantages: torch.Tensor,
                   most: float = 1 / 8) -> dict[str, float]:
    """Where a batch's push comes from when problems are nearly impossible: `rare_success_share`, the share of
    groups whose success rate is above 0 and at most `most`, and `rare_push_share`, the share of the batch's
    positive advantage (per answer, [B]) that the answers of those groups carry."""
    success = group_means(rewards.float(), group)
    rare = (success > 0) & (success <= most + 1e-9)
    push = advantages.float().clamp_min(0)
    total = float(push.sum())
    return {"rare_success_share": float(rare.double().mean()),
            "rare_push_share": float(push[rare[group]].sum()) / total if total > 0 else 0.0}


def confidence_gap(confidence: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
    """Does a stated confidence track being right, on one batch: `confidence_gap`, the mean stated confidence
    less the mean reward (above 0: overconfident), and `confidence_reward_cov`, their covariance across answers
    (0: the confidence says nothing about which answers are right)."""
    c, r = confidence.double(), rewards.double()
    return {"confidence_gap": float(c.mean() - r.mean()),
            "confidence_reward_cov": float(((c - c.mean()) * (r - r.mean())).mean())}


def group_signal(rewards: torch.Tensor, group: torch.Tensor) -> dict[str, float]:
    """How much of a batch of groups can compare anything: `zero_variance_share`, the share of groups whose
    rewards are all equal (all correct or all wrong: zero group-relative advantage), and `effective_batch`,
    the share of answers in the other groups."""
    live = live_groups(rewards, group)
    return {"zero_variance_share": float(1 - live.double().mean()),
            "effective_batch": float(live[group].double().mean())}


@diagnostic("group_signal")
def group_signal_of(state: TrainState) -> dict[str, float]:
    """`group_signal` of the iteration's batch (trainers with groups)."""
    return group_signal(state.batch["rewards"], state.batch["group"])
