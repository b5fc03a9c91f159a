"""GRPO with a frozen reference policy, CleanRL-style: one file, read top to bottom, the math in plain sight.

One `iterate` call is one GRPO iteration:

1. Rollout: for each of `n_groups` prompts sample `group_size` answers from the policy (no gradient), or
   from `sampler`, an inference engine's copy of it (a module called like the policy, returning its own
   logits for the same weights: mu). The learner recomputes pi_old itself and forms its term against
   pi_old, never reading mu (verl's default): the factor pi_old / mu is left uncorrected.
2. Reward each answer with the task's reward function: R_i, one scalar per answer. A reward function may
   return a dict instead: "reward" [B] and other per-answer tensors, which join the batch the hooks see
   (a reward-model ensemble's predictions, say).
3. Group-normalized advantage A_i = (R_i - mean_group R) / (std_group R + eps), broadcast to every token
   of answer i, then `stabilizer.advantages(A, batch)`. Variants: `baseline="batch"` subtracts the
   batch mean instead of the group mean (REINFORCE with a batch-mean baseline); `std_normalize=False`
   drops the division by the group std (Dr. GRPO). A group of one answer (`group_size=1`) has no std: it is
   taken as 1 (verl's convention), so its advantage is 0 under the group baseline.
4. `epochs` passes over the batch, each in `minibatches` Adam steps on disjoint sets of whole groups
   (default 1 x 1: one on-policy update). Per token, with r = pi / pi_old:
     policy term  -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)   (r against `anchor_logp` = pi_old)
     KL term      k3 = exp(d) - 1 - d, d = log ref - log pi  (TRL's default regularizer),
                  through `stabilizer.kl_loss(k3, batch)`; not clamped (verl's `low_var_kl` clamps d to
                  [-20, 20] and k3 to at most 10), so a token the reference finds far likelier weighs in full.
   Each is aggregated over the minibatch's answer tokens as sum(per_token * token_weight), the weights
   set by `aggregation` (`token-mean`: 1 / number of tokens; `seq-mean`: 1 / (answers x |o_i|), the
   length-biased GRPO normalization; `constant`: 1 / (answers x answer_len), Dr. GRPO) into
     terms = {"policy": ..., "kl": beta * ...}, then `stabilizer.loss(terms, batch)`;
   the sum is minimized: backward, `stabilizer.after_backward(policy)`, Adam step.
`stabilizer.model` and `stabilizer.optimizer` are called once, when the trainer is built.

The batch the hooks receive follows `suite.api.BATCH_SCHEMA` ([B] per answer, [B, L] per token;
B = n_groups * group_size): prompts [B, P], answers [B, L] (also as `actions`), mask [B, L] (1.0 on real answer tokens),
rewards [B], group [B] (group index), logp [B, L] (log pi of the sampled tokens: detached in `advantages`,
carrying the graph of the current update in `kl_loss` and `loss`), old_logp [B, L] (at sampling time),
behaviour_logp [B, L] (log mu under the sampler; old_logp when the learner sampled), anchor_logp [B, L]
(old_logp: the term's denominator), ref_logp [B, L] (frozen reference), kl_coef (0-d
tensor, beta). In `kl_loss` and `loss` the batch is the minibatch being updated and also holds advantages
[B, L] (after the stabilizer), entropy [B, L] (per-token entropy with the graph), token_weight [B, L]
(the aggregation weights: a stabilizer that rewrites the policy term aggregates it as
sum(per_token * token_weight), like the trainer) and clip_low, clip_high (0-d tensors).
The returned `TrainState.batch` holds the same keys, all detached; `losses` follows `suite.api.LOSS_SCHEMA`
(each update's value averaged over the iteration: loss, policy_loss, kl_loss (without beta), entropy_loss,
approx_kl, clip_frac, ratio_p99, ratio_max, and entropy); `extras` holds `loss_terms` (the last update's terms
after the `loss` hook), `entropy` (mean token entropy of the policy at sampling time), `full_vocab_kl` [B, L]
(exact per-token KL(pi || ref) summed over the vocabulary at each sampled prefix), `advantages` [B, L] (after
the stabilizer), `minibatch_grads` (one flat gradient vector per minibatch step of the last epoch: what a
gradient-variance diagnostic reads) and `answer_len` [B] (tokens up to and including EOS).
Task specifics (prompts, reward, answer length, the model) stay in the task.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch
from stabench.baselines import adam
from stabench.baselines.losses import LossReport, ratio_statistics
from stabench.baselines.tokens import (
    RewardFn,
    answer_logits,
    answer_mask,
    bos_prompts,
    group_std,
    sample_answers,
)
from stabench.suite.api import Diverged, Stabilizer, TrainState
from stabench.suite.diagnostics import categorical_entropy, entropy_of_logp, kl_estimate, kl_of_logp
from torch import nn


@dataclass(frozen=True)
class GRPOConfig:
    n_groups: int = 16  # prompts per iteration
    group_size: int = 8  # answers sampled per prompt
    answer_len: int = 4  # tokens per answer
    n_actions: int = 6  # the policy emits token ids 0 .. n_actions - 1
    lr: float = 1e-2  # Adam
    beta: float = 0.5  # KL coefficient
    adv_eps: float = 1e-4  # A = (R - mean) / (std + adv_eps)
    epochs: int = 1  # passes over the batch; with 1 pass and 1 minibatch the ratio is 1 and the clip never binds
    minibatches: int = 1  # Adam steps per pass, each on n_groups / minibatches whole groups
    clip_low: float = 0.2
    clip_high: float = 0.2
    baseline: Literal["group", "batch"] = "group"  # what is subtracted from R
    std_normalize: bool = True  # divide by the group std (GRPO); False: Dr. GRPO
    aggregation: Literal["token-mean", "seq-mean", "constant"] = "token-mean"
    eos_id: int | None = None  # None: every answer has exactly answer_len tokens
    seed: int = 0  # seeds the sampler's numpy Generator


def token_weights(mask: torch.Tensor, how: str) -> torch.Tensor:
    """Weights [B, L] such that sum(per_token * weights) is the aggregated loss of a batch of answers."""
    if how == "token-mean":
        return mask / mask.sum().clamp_min(1)
    if how == "seq-mean":
        return mask / (mask.sum(1, keepdim=True).clamp_min(1) * mask.shape[0])
    if how == "constant":
        return mask / mask.numel()
    raise ValueError(f"unknown aggregation {how!r}")


def aggregate_tokens(per_token: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """sum(per_token * token_weights(mask, how)), computed in the order of each definition."""
    if how == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp_min(1)
    if how == "seq-mean":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).mean()
    if how == "constant":
        return (per_token * mask).sum() / mask.numel()
    raise ValueError(f"unknown aggregation {how!r}")


class GRPO:
    name = "grpo"

    def __init__(
        self, policy: nn.Module, reference: nn.Module, reward_fn: RewardFn, config: GRPOConfig, stabilizer: Stabilizer
    ) -> None:
        self.config, self.reward_fn, self.stabilizer = config, reward_fn, stabilizer
        spec = {"kind": "causal-lm", "trainer": self.name, "model_config": policy.config.to_dict(), **asdict(config)}
        self.policy = stabilizer.model(policy, spec)
        self.reference = reference.eval().requires_grad_(False)  # frozen: never updated
        # foreach: on the CPU the same per-tensor arithmetic as the default loop, without Python per parameter
        opt = torch.optim.Adam(self.policy.parameters(), lr=config.lr, foreach=True)
        self.optimizer = stabilizer.optimizer(opt, self.policy)
        self.rng = np.random.default_rng(config.seed)
        self.iteration = 0
        self.tokens = 0  # answer tokens generated so far

    def iterate(
        self, reward_fn: RewardFn | None = None, prompts: torch.Tensor | None = None, sampler: nn.Module | None = None
    ) -> TrainState:
        """One GRPO iteration. `reward_fn` overrides the trainer's reward for this iteration (an injection);
        `prompts` [n_groups, P] default to BOS alone; `sampler` (default: the policy itself) draws the answers."""
        cfg = self.config
        reward_fn = reward_fn or self.reward_fn
        if prompts is None:
            prompts = bos_prompts(self.policy, cfg.n_groups)
        prompts = prompts.repeat_interleave(cfg.group_size, dim=0)  # [B, P], group members adjacent

        # 1-2. Rollout and reward.
        drawer = self.policy if sampler is None else sampler
        answers = sample_answers(drawer, prompts, cfg.answer_len, cfg.n_actions, self.rng)
        mask = answer_mask(answers, cfg.eos_id)
        scored = reward_fn(prompts, answers)
        extra: dict[str, torch.Tensor] = {}
        if isinstance(scored, dict):  # {"reward": [B], other per-answer tensors the hooks may read}
            extra = {k: v for k, v in scored.items() if k != "reward"}
            scored = scored["reward"]
        rewards = scored.float()
        with torch.no_grad():
            ref_logits = answer_logits(self.reference, prompts, answers, cfg.n_actions)
            if sampler is not None:  # the sampler's own log-probs of its answers (before any learner forward)
                mu_logits = answer_logits(sampler, prompts, answers, cfg.n_actions)
                sampler_logp = torch.log_softmax(mu_logits, -1).gather(-1, answers[..., None]).squeeze(-1)
        ref_all = torch.log_softmax(ref_logits, -1)  # [B, L, V]: also the exact KL's reference side
        ref_logp = ref_all.gather(-1, answers[..., None]).squeeze(-1)

        # 3. Group-normalized advantages, broadcast to tokens.
        r = rewards.view(cfg.n_groups, cfg.group_size)
        centred = r - (r.mean(1, keepdim=True) if cfg.baseline == "group" else r.mean())
        adv_answer = (centred / (group_std(r) + cfg.adv_eps) if cfg.std_normalize else centred).view(-1)
        adv = adv_answer[:, None].expand_as(mask) * mask

        logits = answer_logits(self.policy, prompts, answers, cfg.n_actions)
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, answers[..., None]).squeeze(-1)
        old_logp = logp.detach()
        sampling_logp = logp_all.detach()  # the learner at sampling time: what the diagnostics describe
        behaviour_logp = old_logp if sampler is None else sampler_logp
        group = torch.arange(cfg.n_groups).repeat_interleave(cfg.group_size)
        batch = {
            "prompts": prompts, "answers": answers, "actions": answers, "mask": mask, "rewards": rewards,
            "group": group,
            "logp": old_logp, "old_logp": old_logp, "behaviour_logp": behaviour_logp, "anchor_logp": old_logp,
            "ref_logp": ref_logp,
            "kl_coef": torch.tensor(cfg.beta), **extra,
        }  # fmt: skip
        adv = self.stabilizer.advantages(adv, batch).detach()

        # 4. Updates: `epochs` passes, each in `minibatches` steps over disjoint sets of whole groups.
        batch["advantages"] = adv
        batch["clip_low"], batch["clip_high"] = torch.tensor(cfg.clip_low), torch.tensor(cfg.clip_high)
        chunks = torch.arange(len(answers)).chunk(cfg.minibatches)
        report = LossReport()
        for epoch in range(cfg.epochs):
            minibatch_grads = []
            for rows in chunks:
                mb = {k: v[rows] if v.dim() > 0 else v for k, v in batch.items()}
                mb_mask = mask[rows]
                mb["token_weight"] = token_weights(mb_mask, cfg.aggregation)
                if epoch > 0 or len(chunks) > 1:
                    logits = answer_logits(self.policy, mb["prompts"], mb["answers"], cfg.n_actions)
                    logp = torch.log_softmax(logits, -1).gather(-1, mb["answers"][..., None]).squeeze(-1)
                mb["logp"], mb["entropy"] = logp, categorical_entropy(logits)
                ratio = torch.exp(logp - mb["anchor_logp"])
                mb_adv = mb["advantages"]
                policy_tok = -torch.min(ratio * mb_adv, ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * mb_adv)
                k3 = kl_estimate(logp, mb["ref_logp"], "k3")
                kl_tok = self.stabilizer.kl_loss(k3, mb)
                policy_loss = aggregate_tokens(policy_tok, mb_mask, cfg.aggregation)
                kl_loss = aggregate_tokens(kl_tok, mb_mask, cfg.aggregation)
                terms = {"policy": policy_loss, "kl": cfg.beta * kl_loss}
                with torch.no_grad():
                    logratio = logp - mb["anchor_logp"]
                    entropy_loss = (mb["entropy"] * mb["token_weight"]).sum()
                reported = {
                    "policy_loss": float(policy_loss.detach()),
                    "kl_loss": float(kl_loss.detach()),
                    "entropy_loss": float(entropy_loss),
                    **ratio_statistics(ratio, logratio, cfg.clip_low, cfg.clip_high, mb_mask),
                }
                terms = self.stabilizer.loss(terms, mb)
                loss = sum(terms.values())
                if not torch.isfinite(loss):
                    raise Diverged(f"non-finite GRPO loss at iteration {self.iteration}: {float(loss)}")
                raw = adam.update(loss, self.policy, self.optimizer, self.stabilizer, reported=epoch == cfg.epochs - 1)
                if raw is not None:  # the last epoch's gradients, one flat vector per minibatch step
                    grads = raw
                    minibatch_grads.append(torch.cat([g.reshape(-1) for g in raw.values()]) if raw else torch.zeros(0))
                report.add({"loss": float(loss.detach()), **reported})

        self.iteration += 1
        self.tokens += int(mask.sum())
        batch["logp"] = old_logp
        entropy = float((entropy_of_logp(sampling_logp) * mask).sum() / mask.sum().clamp_min(1))
        extras = {
            "loss_terms": {k: float(v.detach()) for k, v in terms.items()},
            "minibatch_grads": minibatch_grads,
            "answer_len": mask.sum(1),
            "entropy": entropy,
            "full_vocab_kl": kl_of_logp(sampling_logp, ref_all),
            "advantages": adv,
        }
        return TrainState(
            model=self.policy,
            batch={k: v.detach() for k, v in batch.items()},
            grads=grads,
            losses=report.means(entropy=entropy),
            extras=extras,
        )
