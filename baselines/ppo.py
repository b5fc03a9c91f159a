"""PPO with a clipped objective and GAE, CleanRL-style: one file, read top to bottom, the math visible.

`PPO(envs, model, config, stabilizer).iterate()` performs one update:

1. collect `num_steps` x `num_envs` transitions from a gymnasium `SyncVectorEnv` built with
   `autoreset_mode=SAME_STEP` (a finished env is reset inside the same `step`; the episode's true
   statistics arrive in `info["final_info"]["episode"]`, recorded by `RecordEpisodeStatistics`);
2. compute GAE(lambda) advantages and returns; like CleanRL, a truncated episode counts as done;
3. run `update_epochs` x `num_minibatches` steps of Adam on the clipped surrogate
   L = -min(r A, clip(r, 1-eps, 1+eps) A) + vf_coef * 0.5 (V - R)^2 - ent_coef * H.

Stabilizer hooks are called in the order of `suite.api.Stabilizer`: `model` and `optimizer` once at
construction; per iteration `rollout` -> `advantages` (the whole rollout, before normalization); per
minibatch `loss` -> backward -> `after_backward` -> optimizer step. Gradient clipping is *not* part of the
trainer (CleanRL clips at 0.5 by default; here that is the `grad-clip` stabilizer). `Stabilizer.rollout(batch,
info)` is called once per iteration after GAE with the whole flattened rollout (t-major: row
t * num_envs + e) and `info` = num_steps, num_envs, gamma, gae_lambda, next_value, next_done; it may
replace `advantages` and `returns` (V-trace does).

The batch follows `suite.api.BATCH_SCHEMA`, one action per environment step. The minibatch the `loss` hook
sees holds the rollout keys below for its rows and, added by the trainer: `logp` (log pi_theta(a|s), with
grad), `advantages` (replaced by what the policy term uses: normalized per minibatch), `entropy` (with
grad), `new_values` (with grad), `mask` (ones), `token_weight` (1 / minibatch size: the trainer's means are
sums with these weights) and `clip_low` = `clip_high` = clip_coef (0-d tensors).

Lagged actors (asynchronous collection): with `actor_history = H > 0` the trainer keeps the learner's
parameters of the last H updates, and with `actor_lag = k > 0` it collects the rollout with the parameters
of k updates ago (the oldest kept, if fewer exist). `logprobs` are then the behaviour (actor) policy's
stored log-probabilities (`behaviour_logp`), which the clipped ratio is formed against (classic
asynchronous PPO), and one batched learner forward after the rollout gives `values` and `old_logp` (log
pi_old, the learner at the start of the update). With no lag the actor is the learner: `old_logp` is
`behaviour_logp`.

Randomness: action sampling and minibatch shuffles draw from one `numpy.random.Generator` held by the
trainer, and the envs are seeded at construction, so a trainer's whole state lives in the object and
`copy.deepcopy` branches it completely (the model is built by the caller, under its own torch seed).

What `iterate()` returns (`suite.api.TrainState`):
- `batch`: the iteration's rollout, flattened to (num_steps * num_envs, ...): obs, actions, behaviour_logp,
  values, advantages (after the `advantages` hook, before normalization), returns, rewards (as the learner
  saw them, i.e. after any reward scaling), dones, old_logp (see lagged actors);
- `grads`: each parameter's gradient on the last minibatch, cloned right after backward, *before* the
  stabilizer's `after_backward` edits it and before the optimizer step (so a clipping stabilizer does
  not hide the raw gradient from the diagnostics);
- `losses` (`suite.api.LOSS_SCHEMA`, every minibatch's value averaged over the iteration): `loss`, `policy_loss`,
  `value_loss` (0.5 MSE, without vf_coef), `entropy_loss` (the minibatch entropy), `approx_kl`, `clip_frac`,
  `ratio_p99` (the minibatches' 99th percentile of the ratio); plus `entropy`, the mean entropy of the policy
  that collected the rollout, and `ratio_max` (the largest ratio of the iteration);
- `extras`: `loss_terms` (the last minibatch's terms after the `loss` hook), `global_step` (env steps so far),
  `episode_return` (mean undiscounted true return of the episodes that ended during this iteration's
  collection, NaN if none), `episodes` (their count),
  `actor_lag` (the lag the rollout was collected at), `behaviour_kl` (mean exact KL(behaviour || pi_old)
  over the rollout's states; 0 without lag),
  `activations` (the trunk's hidden units on a held batch: the first iteration's observations).
"""

from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
from stabench.baselines import adam
from stabench.baselines.losses import LossReport, ratio_statistics, upper_quantile  # noqa: F401  (re-exported)
from stabench.suite.api import Diverged, Stabilizer, TrainState
from torch import nn


@dataclass
class PPOConfig:
    num_envs: int = 8
    num_steps: int = 32  # steps per env per update; batch = num_steps * num_envs
    learning_rate: float = 5e-4
    adam_eps: float = 1e-5
    gamma: float = 0.99
    gae_lambda: float = 0.95
    update_epochs: int = 4
    num_minibatches: int = 2
    clip_coef: float = 0.2
    clip_vloss: bool = False  # CleanRL's optional clipped value loss
    norm_adv: bool = True  # normalize advantages per minibatch
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    seed: int = 0


def categorical_logprob_entropy(logits: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(a|s) of the given actions and the entropy H(pi(.|s)), from unnormalized logits."""
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


class PPO:
    name = "ppo"

    def __init__(self, envs: gym.vector.SyncVectorEnv, model: nn.Module, config: PPOConfig,
                 stabilizer: Stabilizer | None = None) -> None:
        self.envs, self.cfg = envs, config
        self.stabilizer = stabilizer if stabilizer is not None else Stabilizer()
        self.rng = np.random.default_rng(config.seed)
        self.model = self.stabilizer.model(model, getattr(model, "spec", {}))
        # fused: the whole Adam step in one kernel; the foreach path spent 13% of training in Python overhead
        opt = torch.optim.Adam(self.model.parameters(), lr=config.learning_rate, eps=config.adam_eps, fused=True)
        self.optimizer = self.stabilizer.optimizer(opt, self.model)

        self.batch_size = config.num_steps * config.num_envs
        self.minibatch_size = self.batch_size // config.num_minibatches
        obs, _ = envs.reset(seed=config.seed)
        self.next_obs = torch.as_tensor(obs, dtype=torch.float32)
        self.next_done = torch.zeros(config.num_envs)
        self.global_step = 0
        self.iteration = 0
        self.held_obs: torch.Tensor | None = None  # fixed batch for the activation diagnostics
        self.actor_lag = 0  # collect with the parameters of this many updates ago (0: the learner)
        self.actor_history = 0  # how many past parameter snapshots to keep (at least the largest lag)
        self.snapshots: deque[dict[str, torch.Tensor]] = deque()
        self.actor: nn.Module | None = None  # the lagged copy of the model, built on first use

    # ---- acting -------------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Draw one action per row from softmax(logits) by inverse CDF on the trainer's own generator."""
        probs = torch.softmax(logits.double(), dim=-1).numpy()
        actions = (probs.cumsum(-1) < self.rng.random(probs.shape[0])[:, None]).sum(-1)
        return torch.from_numpy(np.minimum(actions, probs.shape[1] - 1))

    def acting_model(self) -> tuple[nn.Module, int]:
        """The network that collects this iteration's rollout, and its lag in updates (0: the learner)."""
        if self.actor_history > 0:
            self.snapshots.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
            while len(self.snapshots) > self.actor_history + 1:
                self.snapshots.popleft()
        lag = min(self.actor_lag, len(self.snapshots) - 1)
        if lag <= 0:
            return self.model, 0
        if self.actor is None:
            self.actor = copy.deepcopy(self.model)
        self.actor.load_state_dict(self.snapshots[-1 - lag])
        return self.actor, lag

    # ---- one update ---------------------------------------------------------------------------------
    def iterate(self) -> TrainState:
        cfg, model, T, N = self.cfg, self.model, self.cfg.num_steps, self.cfg.num_envs
        # the rollout is written to numpy buffers (a torch write costs microseconds of dispatch per call)
        obs_np = np.zeros((T, N) + tuple(self.next_obs.shape[1:]), dtype=np.float32)
        rewards_np, dones_np = np.zeros((T, N), dtype=np.float32), np.zeros((T, N), dtype=np.float32)
        ended: list[float] = []
        actor, lag = self.acting_model()
        behaviour_logits, step_values, step_actions = [], [], []

        # 1. rollout
        for t in range(T):
            obs_np[t], dones_np[t] = self.next_obs.numpy(), self.next_done.numpy()
            with torch.inference_mode():
                logits, value = actor(self.next_obs)
            behaviour_logits.append(logits)
            action = self.sample(logits)
            step_values.append(value)
            step_actions.append(action)

            next_obs, reward, terminated, truncated, info = self.envs.step(action.numpy())
            self.global_step += N
            rewards_np[t] = reward
            self.next_obs = torch.as_tensor(next_obs, dtype=torch.float32)
            self.next_done = torch.from_numpy(np.logical_or(terminated, truncated).astype(np.float32))
            final = info.get("final_info", {})
            if "episode" in final:
                ended.extend(float(r) for r in final["episode"]["r"][final["_episode"]])
        obs, rewards, dones = torch.from_numpy(obs_np), torch.from_numpy(rewards_np), torch.from_numpy(dones_np)
        values, actions = torch.stack(step_values), torch.stack(step_actions)

        logprobs, entropies = categorical_logprob_entropy(torch.stack(behaviour_logits), actions)  # [T, N] each
        old_logprobs, behaviour_kl = logprobs, 0.0
        if lag > 0:  # the learner's own values and log pi_old on the actors' states, in one forward
            with torch.no_grad():
                learner_logits, learner_values = model(obs.reshape((T * N,) + tuple(obs.shape[2:])))
            values = learner_values.reshape(T, N)
            old_logprobs = categorical_logprob_entropy(learner_logits, actions.reshape(-1))[0].reshape(T, N)
            b_logp = torch.log_softmax(torch.cat(behaviour_logits), dim=-1)
            behaviour_kl = float((b_logp.exp() * (b_logp - torch.log_softmax(learner_logits, -1))).sum(-1).mean())

        # 2. GAE: delta_t = r_t + gamma V(s_{t+1}) (1 - done_{t+1}) - V(s_t)
        #         A_t = delta_t + gamma lambda (1 - done_{t+1}) A_{t+1};  R_t = A_t + V(s_t)
        #         (in float32 numpy: the same operations in the same order as torch, without its dispatch cost)
        with torch.no_grad():
            next_value = model(self.next_obs)[1]
        values_np, advantages_np = values.numpy(), np.zeros((T, N), dtype=np.float32)
        lastgaelam = np.zeros(N, dtype=np.float32)
        for t in reversed(range(T)):
            if t == T - 1:
                nextnonterminal, nextvalues = 1.0 - self.next_done.numpy(), next_value.numpy()
            else:
                nextnonterminal, nextvalues = 1.0 - dones_np[t + 1], values_np[t + 1]
            delta = rewards_np[t] + cfg.gamma * nextvalues * nextnonterminal - values_np[t]
            advantages_np[t] = lastgaelam = delta + cfg.gamma * cfg.gae_lambda * nextnonterminal * lastgaelam
        advantages = torch.from_numpy(advantages_np)
        returns = advantages + values

        batch = {
            "obs": obs.reshape((self.batch_size,) + tuple(obs.shape[2:])),
            "actions": actions.reshape(-1),
            "behaviour_logp": logprobs.reshape(-1),
            "anchor_logp": logprobs.reshape(-1),  # the clipped ratio is formed against the stored log-probs
            "values": values.reshape(-1),
            "advantages": advantages.reshape(-1),
            "returns": returns.reshape(-1),
            "rewards": rewards.reshape(-1),
            "dones": dones.reshape(-1),
            "old_logp": old_logprobs.reshape(-1),
        }
        info = {"num_steps": T, "num_envs": N, "gamma": cfg.gamma, "gae_lambda": cfg.gae_lambda,
                "next_value": next_value, "next_done": self.next_done}
        batch = self.stabilizer.rollout(batch, info)
        batch["advantages"] = self.stabilizer.advantages(batch["advantages"], batch).detach()
        if self.held_obs is None:
            self.held_obs = batch["obs"].clone()

        # 3. clipped-objective epochs
        report = LossReport()
        grads: dict[str, torch.Tensor] = {}
        ones, weight = torch.ones(self.minibatch_size), torch.full((self.minibatch_size,), 1.0 / self.minibatch_size)
        clip = torch.tensor(cfg.clip_coef)
        # the rollout's float vectors as the rows of one matrix: a minibatch takes them in one gather
        vectors = [key for key, v in batch.items() if v.dim() == 1 and v.dtype == torch.float32]
        stacked = torch.stack([batch[key] for key in vectors]) if vectors else None
        for epoch in range(cfg.update_epochs):
            perm = torch.as_tensor(self.rng.permutation(self.batch_size))
            for k in range(cfg.num_minibatches):
                idx = perm[k * self.minibatch_size:(k + 1) * self.minibatch_size]
                mb = {key: v[idx] for key, v in batch.items() if key not in vectors}
                if stacked is not None:
                    mb.update(zip(vectors, stacked.index_select(1, idx).unbind(0)))
                logits, newvalue = model(mb["obs"])
                newlogprob, entropy = categorical_logprob_entropy(logits, mb["actions"])
                logratio = newlogprob - mb["anchor_logp"]
                ratio = logratio.exp()
                ratio_stats = ratio_statistics(ratio, logratio, cfg.clip_coef, cfg.clip_coef)

                mb_adv = mb["advantages"]
                if cfg.norm_adv:
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)

                pg_loss = torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()
                if cfg.clip_vloss:
                    v_clipped = mb["values"] + (newvalue - mb["values"]).clamp(-cfg.clip_coef, cfg.clip_coef)
                    v_loss = 0.5 * torch.max((newvalue - mb["returns"]) ** 2, (v_clipped - mb["returns"]) ** 2).mean()
                else:
                    v_loss = 0.5 * ((newvalue - mb["returns"]) ** 2).mean()
                entropy_mean = entropy.mean()

                terms = {"policy": pg_loss, "value": cfg.vf_coef * v_loss, "entropy": -cfg.ent_coef * entropy_mean}
                mb.update(logp=newlogprob, advantages=mb_adv, entropy=entropy, new_values=newvalue, mask=ones,
                          token_weight=weight, clip_low=clip, clip_high=clip)
                terms = self.stabilizer.loss(terms, mb)
                loss = sum(terms.values())
                loss_value = float(loss.detach())
                if not math.isfinite(loss_value):
                    raise Diverged(f"non-finite PPO loss {loss_value} at iteration {self.iteration}")

                last = epoch == cfg.update_epochs - 1 and k == cfg.num_minibatches - 1  # the reported gradients
                raw = adam.update(loss, model, self.optimizer, self.stabilizer, reported=last)
                grads = raw if last else grads

                report.add({"loss": loss_value, "policy_loss": float(pg_loss.detach()),
                            "value_loss": float(v_loss.detach()), "entropy_loss": float(entropy_mean.detach()),
                            **ratio_stats})

        for p in model.parameters():
            if not torch.isfinite(p).all():
                raise Diverged(f"non-finite parameters after iteration {self.iteration}")

        self.iteration += 1
        losses = report.means(entropy=float(entropies.mean()))
        extras = {
            "loss_terms": {key: float(v.detach()) for key, v in terms.items()},
            "global_step": self.global_step,
            "episode_return": float(np.mean(ended)) if ended else math.nan,
            "episodes": len(ended),
            "actor_lag": lag,
            "behaviour_kl": behaviour_kl,
        }
        if hasattr(model, "hidden"):
            with torch.no_grad():
                extras["activations"] = [a.detach() for a in model.hidden(self.held_obs)]
        return TrainState(model=model, batch=batch, grads=grads, losses=losses, extras=extras)
