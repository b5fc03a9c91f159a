"""GRPO with a frozen reference policy, CleanRL-style: one file, read top to bottom, the math in plain sight.

One `iterate` call is one GRPO iteration:

1. Rollout: for each of `n_groups` prompts sample `group_size` answers from the policy (no gradient).
2. Reward each answer with the task's reward function: R_i, one scalar per answer.
3. Group-normalized advantage A_i = (R_i - mean_group R) / (std_group R + eps), broadcast to every token
   of answer i, then `stabilizer.advantages(A, batch)`.
4. `epochs` updates on the batch (default 1, on-policy). Per token, with r = pi / pi_old:
     policy term  -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)
     KL term      k3 = exp(d) - 1 - d, d = log ref - log pi  (TRL's default regularizer),
                  through `stabilizer.kl_loss(k3, batch)`
   Each is aggregated over the answer tokens (`token-mean`: sum over all tokens / number of tokens;
   `seq-mean`: mean over answers of each answer's token mean) into
     terms = {"policy": ..., "kl": beta * ...}, then `stabilizer.loss(terms, batch)`;
   the sum is minimized: backward, `stabilizer.after_backward(policy)`, Adam step.
`stabilizer.model` and `stabilizer.optimizer` are called once, when the trainer is built.

The batch the hooks receive (tensors; [B] per answer, [B, L] per token; B = n_groups * group_size):
  prompts [B, P], answers [B, L], mask [B, L] (1.0 on real answer tokens), rewards [B], group [B]
  (group index), logp [B, L] (log pi of the sampled tokens: detached in `advantages`, carrying the
  graph of the current update in `kl_loss` and `loss`), old_logp [B, L] (at sampling time),
  ref_logp [B, L] (frozen reference), kl_coef (0-d tensor, beta).
The returned `TrainState.batch` holds the same keys, all detached; `extras` holds `entropy` (mean token
entropy of the policy at sampling time), `full_vocab_kl` [B, L] (exact per-token KL(pi || ref) summed
over the vocabulary at each sampled prefix) and `advantages` [B, L] (after the stabilizer).
Task specifics (prompts, reward, answer length, the model) stay in the task.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from suite.api import Diverged, Stabilizer, TrainState
from suite.diagnostics import categorical_entropy, exact_kl
from tasks.tokens import RewardFn, answer_logits, answer_mask, bos_prompts, sample_answers


@dataclass(frozen=True)
class GRPOConfig:
    n_groups: int = 16  # prompts per iteration
    group_size: int = 8  # answers sampled per prompt
    answer_len: int = 4  # tokens per answer
    n_actions: int = 6  # the policy emits token ids 0 .. n_actions - 1
    lr: float = 1e-2  # Adam
    beta: float = 0.5  # KL coefficient
    adv_eps: float = 1e-4  # A = (R - mean) / (std + adv_eps)
    epochs: int = 1  # updates per batch; with 1 the ratio is 1 and the clip never binds
    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: Literal["token-mean", "seq-mean"] = "token-mean"
    eos_id: int | None = None  # None: every answer has exactly answer_len tokens
    seed: int = 0  # seeds the sampler's numpy Generator


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    if how == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp_min(1)
    if how == "seq-mean":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).mean()
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
        self.optimizer = stabilizer.optimizer(torch.optim.Adam(self.policy.parameters(), lr=config.lr), self.policy)
        self.rng = np.random.default_rng(config.seed)
        self.iteration = 0
        self.tokens = 0  # answer tokens generated so far

    def iterate(self, reward_fn: RewardFn | None = None, prompts: torch.Tensor | None = None) -> TrainState:
        """One GRPO iteration. `reward_fn` overrides the trainer's reward for this iteration (an injection);
        `prompts` [n_groups, P] default to BOS alone."""
        cfg = self.config
        reward_fn = reward_fn or self.reward_fn
        if prompts is None:
            prompts = bos_prompts(self.policy, cfg.n_groups)
        prompts = prompts.repeat_interleave(cfg.group_size, dim=0)  # [B, P], group members adjacent

        # 1-2. Rollout and reward.
        answers = sample_answers(self.policy, prompts, cfg.answer_len, cfg.n_actions, self.rng)
        mask = answer_mask(answers, cfg.eos_id)
        rewards = reward_fn(prompts, answers).float()
        with torch.no_grad():
            ref_logits = answer_logits(self.reference, prompts, answers, cfg.n_actions)
        ref_logp = torch.log_softmax(ref_logits, -1).gather(-1, answers[..., None]).squeeze(-1)

        # 3. Group-normalized advantages, broadcast to tokens.
        r = rewards.view(cfg.n_groups, cfg.group_size)
        adv_answer = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + cfg.adv_eps)).view(-1)
        adv = adv_answer[:, None].expand_as(mask) * mask

        logits = answer_logits(self.policy, prompts, answers, cfg.n_actions)
        logp = torch.log_softmax(logits, -1).gather(-1, answers[..., None]).squeeze(-1)
        old_logp = logp.detach()
        sampling_logits = logits.detach()  # the policy that sampled the batch: what the diagnostics describe
        group = torch.arange(cfg.n_groups).repeat_interleave(cfg.group_size)
        batch = {
            "prompts": prompts, "answers": answers, "mask": mask, "rewards": rewards, "group": group,
            "logp": old_logp, "old_logp": old_logp, "ref_logp": ref_logp, "kl_coef": torch.tensor(cfg.beta),
        }  # fmt: skip
        adv = self.stabilizer.advantages(adv, batch).detach()

        # 4. Updates.
        for epoch in range(cfg.epochs):
            if epoch > 0:
                logits = answer_logits(self.policy, prompts, answers, cfg.n_actions)
                logp = torch.log_softmax(logits, -1).gather(-1, answers[..., None]).squeeze(-1)
            batch["logp"] = logp
            ratio = torch.exp(logp - old_logp)
            policy_tok = -torch.min(ratio * adv, ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv)
            d = ref_logp - logp
            k3 = torch.expm1(d) - d
            kl_tok = self.stabilizer.kl_loss(k3, batch)
            terms = {
                "policy": aggregate(policy_tok, mask, cfg.aggregation),
                "kl": cfg.beta * aggregate(kl_tok, mask, cfg.aggregation),
            }
            terms = self.stabilizer.loss(terms, batch)
            loss = sum(terms.values())
            if not torch.isfinite(loss):
                raise Diverged(f"non-finite GRPO loss at iteration {self.iteration}: {float(loss)}")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.stabilizer.after_backward(self.policy)
            grads = {n: p.grad.detach().clone() for n, p in self.policy.named_parameters() if p.grad is not None}
            self.optimizer.step()

        self.iteration += 1
        self.tokens += int(mask.sum())
        batch["logp"] = old_logp
        extras = {
            "entropy": float((categorical_entropy(sampling_logits) * mask).sum() / mask.sum().clamp_min(1)),
            "full_vocab_kl": exact_kl(sampling_logits, ref_logits),
            "advantages": adv,
        }
        return TrainState(
            model=self.policy,
            batch={k: v.detach() for k, v in batch.items()},
            grads=grads,
            losses={k: float(v.detach()) for k, v in terms.items()},
            extras=extras,
        )
