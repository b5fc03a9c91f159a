"""PPO with a critic for token policies, CleanRL-style: one file, read top to bottom, the math in plain sight.

The policy is a tiny causal LM (see `tasks/worlds/tokens.py`); the critic is a separate small network that maps an
answer prefix to a value, `critic(prompts, answers) -> [B, L]`: entry [i, t] is V(s_t), the value of the
state before answer token t of answer i (the prompt and the first t answer tokens). `PrefixCritic` below is
one: an MLP over the one-hot encoding of the prefix. One `iterate` call is one PPO iteration:

1. Rollout: sample `n_answers` answers from the policy (no gradient); reward each with the task's reward
   function, R_i (a dict {"reward": [B], other per-answer tensors} adds those to the batch the hooks see).
2. Values V(s_t) from the critic (no gradient); the reward is terminal: r_t = R_i on the answer's last
   token (the last 1.0 of the mask), 0 elsewhere; V(s_T) = 0 after the last token.
3. GAE over the answer tokens (`gae`):
     delta_t = r_t + gamma V(s_{t+1}) - V(s_t),   A_t = delta_t + gamma lambda A_{t+1},
   value targets G_t = A_t + V(s_t) (the lambda-returns), then `stabilizer.advantages(A, batch)`.
4. `epochs` passes over the batch, each in `minibatches` steps on disjoint sets of answers. In each
   minibatch the advantages are normalized (mean 0, std 1 over its answer tokens, `norm_adv`); per token,
   with r = pi / pi_old:
     policy term   -min(r A, clip(r, 1 - clip_coef, 1 + clip_coef) A)
     value term    (V(s_t) - G_t)^2 / 2
     entropy term  -H(pi(. | s_t))
   each averaged over the minibatch's answer tokens into
     terms = {"policy": ..., "value": vf_coef * ..., "entropy": ent_coef * ...}, then `stabilizer.loss(terms,
   batch)`; the sum is minimized: backward, `stabilizer.after_backward(policy)`, a step of the policy's Adam
   and a step of the critic's Adam (two optimizers: a critic can be replaced, with fresh optimizer state,
   without touching the policy's).
`stabilizer.model` and `stabilizer.optimizer` are called once, on the policy and its optimizer, when the
trainer is built.

`reset_critic(critic)` replaces the critic (a new, untrained value head) and its optimizer; `critic_age`
counts the iterations since the critic was built or last replaced (0 during the first iteration after).

The batch the hooks receive follows `suite.api.BATCH_SCHEMA` ([B] per answer, [B, L] per token): prompts
[B, P], answers [B, L] (also as `actions`), mask [B, L], rewards [B], logp [B, L] (log pi of the sampled tokens:
detached in `advantages`, carrying the graph of the current update in `loss`), old_logp [B, L], behaviour_logp
[B, L] (the learner sampled: old_logp), values [B, L] (critic at sampling time), returns [B, L] (the value
targets G_t), and beyond the schema mc_returns [B, L] (the Monte-Carlo return-to-go gamma^(T-1-t) R_i),
critic_age and critic_resets (0-d long tensors: iterations since the critic was built or replaced, and how
many times it was replaced). In `loss` the batch is the minibatch being updated and also holds advantages [B,
L] (after the stabilizer and the normalization), entropy [B, L] (per-token entropy carrying the graph),
new_values [B, L] (carrying the critic's graph), token_weight [B, L] (mask / number of tokens: a rewritten
term aggregates as sum(per_token * token_weight)) and clip_low = clip_high = clip_coef (0-d). The returned
`TrainState.batch` holds the same keys, detached; `losses` follows `suite.api.LOSS_SCHEMA` (each update's value
averaged over the iteration: loss, policy_loss, value_loss (without vf_coef), entropy_loss, approx_kl, clip_frac,
ratio_p99, ratio_max, and entropy); `extras` holds `loss_terms` (the last update's terms after the `loss` hook,
with their coefficients), `values` [B, L] (the critic's
predictions before its update), `returns` [B, L] (the Monte-Carlo return-to-go: what a perfect critic
predicts on average; the `value_fit` diagnostic compares the two), `advantages` [B, L] (GAE after the
stabilizer, before normalization), `entropy` (mean token entropy at sampling time), `critic_age` and
`minibatch_grads`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
from stabench.baselines import adam
from stabench.baselines.losses import LossReport, ratio_statistics
from stabench.baselines.tokens import RewardFn, answer_logits, answer_mask, bos_prompts, sample_answers
from stabench.suite.api import Diverged, Stabilizer, TrainState
from stabench.suite.diagnostics import categorical_entropy
from torch import nn


@dataclass(frozen=True)
class TokenPPOConfig:
    n_answers: int = 64  # answers sampled per iteration (all from the same prompt unless prompts are given)
    answer_len: int = 5  # tokens per answer
    n_actions: int = 4  # the policy emits token ids 0 .. n_actions - 1
    lr: float = 3e-3  # the policy's Adam
    critic_lr: float = 3e-3  # the critic's Adam
    gamma: float = 1.0
    gae_lambda: float = 0.9
    epochs: int = 2
    minibatches: int = 2
    clip_coef: float = 0.2
    vf_coef: float = 0.5
    ent_coef: float = 0.0
    norm_adv: bool = True
    eos_id: int | None = None  # None: every answer has exactly answer_len tokens
    seed: int = 0  # seeds the sampler's numpy Generator


class PrefixCritic(nn.Module):
    """V(s_t) from the one-hot encoding of the answer prefix (the first t tokens, padded) and of t.

    A tanh MLP of one hidden layer. `out_scale` is the standard deviation of the output layer's weights times
    sqrt(width): 1 is CleanRL's critic head; a large value is a head bolted on with the wrong scale (its
    initial predictions have a spread of about `out_scale`, whatever the returns are).
    """

    def __init__(self, n_actions: int, answer_len: int, width: int = 32, out_scale: float = 1.0) -> None:
        super().__init__()
        self.n_actions, self.answer_len = n_actions, answer_len
        n_in = answer_len + (answer_len - 1) * (n_actions + 1)
        self.hidden = nn.Linear(n_in, width)
        self.out = nn.Linear(width, 1)
        nn.init.normal_(self.out.weight, std=out_scale / width**0.5)
        nn.init.zeros_(self.out.bias)

    def features(self, answers: torch.Tensor) -> torch.Tensor:
        """[B, L, n_in]: for each t, one-hot(t) and the one-hot tokens of positions < t (pad id n_actions after)."""
        b, length = answers.shape
        t = torch.arange(length)
        visible = t[None, :, None] > t[None, None, : length - 1]  # [1, L, L-1]: position j visible at step t
        grid = torch.where(visible, answers[:, None, : length - 1], torch.tensor(self.n_actions))
        tokens = nn.functional.one_hot(grid, self.n_actions + 1).float().reshape(b, length, -1)
        position = torch.eye(length).expand(b, length, length)
        return torch.cat([position, tokens], dim=-1)

    def forward(self, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        """Values [B, L]. The prompt is not read: the token tasks that use this critic have one prompt."""
        return self.out(torch.tanh(self.hidden(self.features(answers)))).squeeze(-1)


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the answer tokens: (advantages, value targets), both [B, L].

    delta_t = r_t + gamma V_{t+1} m_{t+1} - V_t and A_t = delta_t + gamma lam A_{t+1} m_{t+1}, where m is
    the mask (1.0 on real tokens): past an answer's last token the value and advantage are 0 (terminal).
    Value targets are A_t + V_t. Both are 0 on masked tokens.
    """
    b, length = values.shape
    adv = torch.zeros_like(values)
    next_value = torch.zeros(b, dtype=values.dtype)
    next_adv = torch.zeros(b, dtype=values.dtype)
    for t in reversed(range(length)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv[:, t] = (delta + gamma * lam * next_adv) * mask[:, t]
        next_value = values[:, t] * mask[:, t]
        next_adv = adv[:, t]
    return adv, (adv + values) * mask


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L]: R_i on answer i's last real token, 0 elsewhere."""
    last = (mask.sum(1).long() - 1).clamp_min(0)
    out = torch.zeros_like(mask)
    out[torch.arange(len(rewards)), last] = rewards.to(mask.dtype)
    return out


class TokenPPO:
    name = "token-ppo"

    def __init__(
        self, policy: nn.Module, critic: nn.Module, reward_fn: RewardFn, config: TokenPPOConfig,
        stabilizer: Stabilizer,
    ) -> None:
        self.config, self.reward_fn, self.stabilizer = config, reward_fn, stabilizer
        spec = {"kind": "causal-lm", "trainer": self.name, "model_config": policy.config.to_dict(), **asdict(config)}
        self.policy = stabilizer.model(policy, spec)
        # foreach: on the CPU the same per-tensor arithmetic as the default loop, without Python per parameter
        opt = torch.optim.Adam(self.policy.parameters(), lr=config.lr, foreach=True)
        self.optimizer = stabilizer.optimizer(opt, self.policy)
        self.reset_critic(critic)
        self.rng = np.random.default_rng(config.seed)
        # sample(policy, prompts, length, n_actions, rng) -> answers [B, L]; a task may swap in an exact sampler
        # that draws from the same distribution (from the enumerated next-token tables, say) to save forwards.
        self.sample = sample_answers
        self.iteration = 0
        self.tokens = 0  # answer tokens generated so far

    def reset_critic(self, critic: nn.Module) -> None:
        """Replace the critic (and its optimizer state); `critic_age` starts again from 0."""
        self.critic = critic
        self.critic_optimizer = torch.optim.Adam(critic.parameters(), lr=self.config.critic_lr, foreach=True)
        self.critic_age = 0
        self.critic_resets = getattr(self, "critic_resets", -1) + 1  # 0 for the critic the trainer was built with

    def iterate(self, reward_fn: RewardFn | None = None, prompts: torch.Tensor | None = None) -> TrainState:
        """One PPO iteration. `reward_fn` overrides the trainer's reward for this iteration (an injection);
        `prompts` [n_answers, P] default to BOS alone."""
        cfg = self.config
        reward_fn = reward_fn or self.reward_fn
        if prompts is None:
            prompts = bos_prompts(self.policy, cfg.n_answers)

        # 1. Rollout and reward.
        answers = self.sample(self.policy, prompts, cfg.answer_len, cfg.n_actions, self.rng)
        mask = answer_mask(answers, cfg.eos_id)
        scored = reward_fn(prompts, answers)
        extra: dict[str, torch.Tensor] = {}
        if isinstance(scored, dict):
            extra = {k: v for k, v in scored.items() if k != "reward"}
            scored = scored["reward"]
        rewards = scored.float()

        # 2-3. Values at sampling time, GAE with the terminal reward. With one minibatch the first update
        # reuses this forward of the policy (it carries the graph), as its parameters have not moved yet.
        with torch.no_grad():
            values = self.critic(prompts, answers) * mask
        with torch.set_grad_enabled(cfg.minibatches == 1):
            logits = answer_logits(self.policy, prompts, answers, cfg.n_actions)
        old_logp = torch.log_softmax(logits.detach(), -1).gather(-1, answers[..., None]).squeeze(-1)
        adv, value_targets = gae(terminal_rewards(rewards, mask), values, mask, cfg.gamma, cfg.gae_lambda)
        # Monte-Carlo return-to-go (terminal reward): gamma^(steps left) R_i on each token.
        steps_left = (mask.sum(1, keepdim=True) - 1 - torch.arange(mask.shape[1])).clamp_min(0)
        returns = rewards[:, None] * cfg.gamma**steps_left * mask
        batch = {
            "prompts": prompts, "answers": answers, "actions": answers, "mask": mask, "rewards": rewards,
            "logp": old_logp,
            "old_logp": old_logp, "behaviour_logp": old_logp, "anchor_logp": old_logp,
            "values": values, "returns": value_targets,
            "mc_returns": returns,
            "critic_age": torch.tensor(self.critic_age),
            "critic_resets": torch.tensor(self.critic_resets), **extra,
        }  # fmt: skip
        adv = self.stabilizer.advantages(adv, batch).detach()

        # 4. Updates: `epochs` passes, each in `minibatches` steps over disjoint sets of answers.
        batch["advantages"] = adv
        batch["clip_low"] = batch["clip_high"] = torch.tensor(cfg.clip_coef)
        chunks = torch.arange(len(answers)).chunk(cfg.minibatches)
        report = LossReport()
        for epoch in range(cfg.epochs):
            minibatch_grads = []
            for rows in chunks:
                mb = {k: v[rows] if v.dim() > 0 else v for k, v in batch.items()}
                mb_mask = mask[rows]
                n_tok = mb_mask.sum().clamp_min(1)
                mb["token_weight"] = mb_mask / n_tok
                mb_adv = mb["advantages"]
                if cfg.norm_adv:
                    mean = (mb_adv * mb_mask).sum() / n_tok
                    std = (((mb_adv - mean) * mb_mask).pow(2).sum() / n_tok).sqrt()
                    mb_adv = (mb_adv - mean) / (std + 1e-8) * mb_mask
                mb["advantages"] = mb_adv
                if epoch == 0 and cfg.minibatches == 1:
                    new_logits = logits
                else:
                    new_logits = answer_logits(self.policy, mb["prompts"], mb["answers"], cfg.n_actions)
                logp = torch.log_softmax(new_logits, -1).gather(-1, mb["answers"][..., None]).squeeze(-1)
                entropy = categorical_entropy(new_logits)
                new_values = self.critic(mb["prompts"], mb["answers"])
                mb["logp"], mb["entropy"], mb["new_values"] = logp, entropy, new_values
                ratio = torch.exp(logp - mb["anchor_logp"])
                policy_tok = -torch.min(ratio * mb_adv, ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef) * mb_adv)
                value_tok = 0.5 * (new_values - mb["returns"]).pow(2)
                terms = {
                    "policy": (policy_tok * mb_mask).sum() / n_tok,
                    "value": cfg.vf_coef * (value_tok * mb_mask).sum() / n_tok,
                    "entropy": -cfg.ent_coef * (entropy * mb_mask).sum() / n_tok,
                }
                with torch.no_grad():
                    reported = {"policy_loss": float(terms["policy"]),
                                "value_loss": float((value_tok * mb_mask).sum() / n_tok),
                                "entropy_loss": float((entropy * mb_mask).sum() / n_tok),
                                **ratio_statistics(ratio, logp - mb["anchor_logp"], cfg.clip_coef, cfg.clip_coef,
                                                   mb_mask)}
                terms = self.stabilizer.loss(terms, mb)
                loss = sum(terms.values())
                if not torch.isfinite(loss):
                    raise Diverged(f"non-finite token-PPO loss at iteration {self.iteration}: {float(loss)}")
                adam.zero_grad(self.optimizer)
                adam.zero_grad(self.critic_optimizer)
                loss.backward()
                # the raw gradients, before the stabilizer edits them (a `None` gradient: no update there)
                grads = {n: p.grad.detach().clone() for n, p in self.policy.named_parameters() if p.grad is not None}
                minibatch_grads.append(torch.cat([g.reshape(-1) for g in grads.values()]) if grads else torch.zeros(0))
                self.stabilizer.after_backward(self.policy)
                adam.step(self.optimizer)
                adam.step(self.critic_optimizer)
                report.add({"loss": float(loss.detach()), **reported})

        self.iteration += 1
        self.critic_age += 1
        self.tokens += int(mask.sum())
        batch["logp"] = old_logp
        batch["advantages"] = adv
        entropy = float((categorical_entropy(logits.detach()) * mask).sum() / mask.sum().clamp_min(1))
        extras = {
            "loss_terms": {k: float(v.detach()) for k, v in terms.items()},
            "values": values,
            "returns": returns,
            "advantages": adv,
            "entropy": entropy,
            "critic_age": int(batch["critic_age"]),
            "minibatch_grads": minibatch_grads,
        }
        return TrainState(
            model=self.policy,
            batch={k: v.detach() for k, v in batch.items()},
            grads=grads,
            losses=report.means(entropy=entropy),
            extras=extras,
        )
