"""Multi-turn token PPO with group advantages, CleanRL-style: one file, read top to bottom, the math visible.

The policy writes tokens into a fixed layout of slots; between its turns a tool writes its reply into the
same sequence, and the policy reads the reply as tokens. A `world` (the task's batched environment)
provides the layout and the tool:

  world.n_slots, world.policy_slots (the slots the policy writes, in order), world.turn_of_slot (turn id of
  each policy slot), world.n_actions (tokens the policy may emit), world.reset(queries, rng, rare_prob)
  -> (ctx [B, S] with the query written and PAD elsewhere, info), world.write(ctx, slot, info) (the tool
  fills a non-policy slot), world.tool_state(ctx, slot) -> [B] bool (this policy token is written in a tool
  state), world.reward(ctx, info) -> [B], world.inputs(ctx) -> model inputs [B, P, ...] (one row per policy
  slot, seeing only the slots before it).

One `iterate(rare_prob)` call is one iteration:

1. Rollout: `n_groups` queries x `group_size` episodes. At each policy slot the *sampler* draws a token and
   logs its log-probability (the behaviour log-prob, what an inference engine returns). The sampler is the
   policy, except on tokens written in a tool state where it applies `tool_temperature` to the logits (a
   sampling/training mismatch confined to tool turns; 1.0 = none).
2. Reward R_i (outcome, per episode); group advantage A_i = (R_i - mean_group R) / (std_group R + eps),
   broadcast to every policy token of episode i, then `stabilizer.advantages(A, batch)`.
3. One forward of the trainer's policy gives old_logp (log pi_old, the learner at the start of the
   update; the cost of a recompute, which the baseline does not use for its ratio).
4. `epochs` passes, each in `minibatches` Adam steps on disjoint sets of whole groups. Per token, with the
   ratio taken against the STORED behaviour log-probs (as an asynchronous pipeline that reuses the
   engine's log-probs does), r = exp(logp - behaviour_logp):
     policy term  max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)),
   aggregated as sum(per_token * token_weight) (token mean) into terms = {"policy": ...}, then
   `stabilizer.loss(terms, minibatch)`; backward, `stabilizer.after_backward(policy)`, Adam step.
   No KL term, no entropy bonus.

The minibatch the `loss` hook sees follows `suite.api.BATCH_SCHEMA` ([b, P] per token, [b] per episode):
actions, mask, turn (turn id per token), rewards, group, behaviour_logp, old_logp, advantages,
token_weight, logp and entropy (current, with grad), clip_low, clip_high (0-d); beyond the schema ctx,
inputs and tool_mask (token written in a tool state).
`TrainState.losses` follows `suite.api.LOSS_SCHEMA` (each update's value averaged over the iteration: loss,
policy_loss, entropy_loss, approx_kl, clip_frac, ratio_p99, ratio_max, and entropy). `TrainState.extras`:
loss_terms (the last update's terms after the `loss` hook), entropy (mean token entropy of the trainer's policy
at sampling time), ratio [B, P] (exp(logp after the update - behaviour_logp): what `ratio_tails` reads),
tool_mask [B, P], clip_frac (the updates' clip fractions averaged by numpy, as the task's rows record it),
minibatch_grads, advantages, logits [B, P, V] (the policy's logits after the update, on the batch's inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from stabench.baselines import adam
from stabench.baselines.losses import LossReport, ratio_statistics
from stabench.baselines.models import sequential
from stabench.baselines.tokens import group_std, on_default_device
from stabench.suite.api import Diverged, Stabilizer, TrainState
from stabench.suite.diagnostics import categorical_entropy
from torch import nn


@dataclass(frozen=True)
class ToolPPOConfig:
    n_groups: int = 12  # queries per iteration
    group_size: int = 8  # episodes per query
    lr: float = 3e-3  # Adam
    epochs: int = 4  # passes over each rollout (the reuse that lets ratios drift)
    minibatches: int = 1  # Adam steps per pass, each on whole groups
    clip_low: float = 0.2
    clip_high: float = 0.2
    adv_eps: float = 1e-4
    tool_temperature: float = 1.0  # the sampler's temperature on tool-state tokens
    seed: int = 0  # seeds the trainer's numpy Generator (queries, tool, sampling)


def sample_tokens(logits: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """One token per row by inverse-CDF sampling with uniforms from `rng` (reproducible, deepcopy-safe)."""
    cdf = torch.softmax(logits.double(), -1).cumsum(-1)
    u = on_default_device(rng.random(len(logits)))[:, None] * cdf[:, -1:]
    return (cdf < u).sum(-1).clamp_max(logits.shape[-1] - 1)


def token_logp(policy: nn.Module, inputs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(action), logits) per policy slot: [b, P] and [b, P, V]."""
    logits = sequential(policy, inputs)
    return torch.log_softmax(logits, -1).gather(-1, actions[..., None]).squeeze(-1), logits


class ToolPPO:
    name = "tool-ppo"

    def __init__(self, policy: nn.Module, world: Any, config: ToolPPOConfig, stabilizer: Stabilizer) -> None:
        self.config, self.world, self.stabilizer = config, world, stabilizer
        spec = {"kind": "token-mlp", "trainer": self.name, "n_actions": world.n_actions}
        self.policy = stabilizer.model(policy, spec)
        # foreach: on the CPU the same per-tensor arithmetic as the default loop, without Python per parameter
        opt = torch.optim.Adam(self.policy.parameters(), lr=config.lr, foreach=True)
        self.optimizer = stabilizer.optimizer(opt, self.policy)
        self.rng = np.random.default_rng(config.seed)
        self.iteration = 0
        self.tokens = 0  # policy tokens generated so far

    @torch.no_grad()
    def rollout(self, rare_prob: float) -> dict[str, torch.Tensor]:
        cfg, world = self.config, self.world
        queries = on_default_device(self.rng.integers(0, world.n_queries, cfg.n_groups))
        queries = queries.repeat_interleave(cfg.group_size)
        ctx, info = world.reset(queries, self.rng, rare_prob)
        actions, behaviour_logp, tool_mask, inputs = [], [], [], []
        for slot in range(1, world.n_slots):
            if slot not in world.policy_slots:
                world.write(ctx, slot, info)
                continue
            k = world.policy_slots.index(slot)
            inputs.append(world.inputs(ctx, k))  # the slots before this one: final once it is written
            logits = sequential(self.policy, inputs[-1])
            tool = world.tool_state(ctx, slot)
            temperature = torch.where(tool, cfg.tool_temperature, 1.0)[:, None]
            sampler_logp = torch.log_softmax(logits.double() / temperature, -1)
            token = sample_tokens(sampler_logp, self.rng)
            ctx[:, slot] = token
            actions.append(token)
            behaviour_logp.append(sampler_logp.gather(-1, token[:, None]).squeeze(-1).float())
            tool_mask.append(tool)
        rewards = world.reward(ctx, info).float()
        actions_t = torch.stack(actions, 1)
        turn = torch.tensor(world.turn_of_slot)[None].expand_as(actions_t)
        engine_logp = torch.stack(behaviour_logp, 1)
        return {
            "ctx": ctx, "inputs": torch.stack(inputs, 1), "actions": actions_t, "mask": torch.ones(actions_t.shape),
            "tool_mask": torch.stack(tool_mask, 1), "turn": turn, "rewards": rewards,
            "group": torch.arange(cfg.n_groups).repeat_interleave(cfg.group_size),
            "behaviour_logp": engine_logp,
            "anchor_logp": engine_logp,  # the term is formed against the engine's log-probs
        }  # fmt: skip

    def iterate(self, rare_prob: float) -> TrainState:
        cfg = self.config
        batch = self.rollout(rare_prob)
        mask = batch["mask"]

        # 2. Group-normalized outcome advantages, broadcast to every policy token of the episode.
        r = batch["rewards"].view(cfg.n_groups, cfg.group_size)
        adv_episode = ((r - r.mean(1, keepdim=True)) / (group_std(r) + cfg.adv_eps)).view(-1)
        adv = adv_episode[:, None].expand_as(mask) * mask

        # 3. The learner's own log-probs at the start of the update (pi_old).
        with torch.no_grad():
            old_logp, old_logits = token_logp(self.policy, batch["inputs"], batch["actions"])
        batch["old_logp"] = old_logp
        batch["advantages"] = self.stabilizer.advantages(adv, batch).detach()
        batch["clip_low"], batch["clip_high"] = torch.tensor(cfg.clip_low), torch.tensor(cfg.clip_high)

        # 4. Updates: ratio against the stored behaviour log-probs, clipped surrogate, token mean.
        chunks = torch.arange(cfg.n_groups * cfg.group_size).chunk(cfg.minibatches)
        clip_fracs = []
        report = LossReport()
        for epoch in range(cfg.epochs):
            minibatch_grads = []
            for rows in chunks:
                mb = {k: v[rows] if v.dim() > 0 else v for k, v in batch.items()}
                mb["token_weight"] = mb["mask"] / mb["mask"].sum().clamp_min(1)
                logp, logits = token_logp(self.policy, mb["inputs"], mb["actions"])
                mb["logp"], mb["entropy"] = logp, categorical_entropy(logits)
                ratio = torch.exp(logp - mb["anchor_logp"])
                a = mb["advantages"]
                policy_tok = torch.max(-a * ratio, -a * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high))
                terms = {"policy": (policy_tok * mb["token_weight"]).sum()}
                with torch.no_grad():
                    reported = {
                        "policy_loss": float(terms["policy"]),
                        "entropy_loss": float((mb["entropy"] * mb["token_weight"]).sum()),
                        **ratio_statistics(ratio, logp - mb["anchor_logp"], cfg.clip_low, cfg.clip_high, mb["mask"]),
                    }
                clip_fracs.append(reported["clip_frac"])
                terms = self.stabilizer.loss(terms, mb)
                loss = sum(terms.values())
                if not torch.isfinite(loss):
                    raise Diverged(f"non-finite tool-PPO loss at iteration {self.iteration}: {float(loss)}")
                raw = adam.update(loss, self.policy, self.optimizer, self.stabilizer, reported=epoch == cfg.epochs - 1)
                if raw is not None:  # the last epoch's gradients, one flat vector per minibatch step
                    grads = raw
                    minibatch_grads.append(torch.cat([g.reshape(-1) for g in raw.values()]) if raw else torch.zeros(0))
                report.add({"loss": float(loss.detach()), **reported})

        with torch.no_grad():
            new_logp, new_logits = token_logp(self.policy, batch["inputs"], batch["actions"])
        self.iteration += 1
        self.tokens += int(mask.sum())
        entropy = float((categorical_entropy(old_logits) * mask).sum() / mask.sum())
        extras = {
            "loss_terms": {k: float(v.detach()) for k, v in terms.items()},
            "entropy": entropy,
            "ratio": torch.exp(new_logp - batch["behaviour_logp"]),
            "logits": new_logits,
            "tool_mask": batch["tool_mask"],
            "clip_frac": float(np.mean(clip_fracs)),
            "minibatch_grads": minibatch_grads,
            "advantages": batch["advantages"],
        }
        return TrainState(
            model=self.policy,
            batch={k: v.detach() for k, v in batch.items()},
            grads=grads,
            losses=report.means(entropy=entropy),
            extras=extras,
        )
