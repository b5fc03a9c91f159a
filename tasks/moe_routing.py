"""moe-routing (experimental): an inference engine whose Mixture-of-Experts routers choose other experts than the
learner's, while each batch is reused for several minibatch updates (off-policy GRPO). At this scale the mismatch
barely hurts: the task misses the bar and stays experimental (`results/calibration.md` holds the measured
numbers).

The world is the digit world (`tasks.worlds.digits`): a prompt is two digits (a, b) from 0-5 (28 training
prompts, 8 held out, none holding a 5); an answer is 3 digits (216 answers, all enumerable). The policy is a tiny
Mixtral built from a config (`TinyMoE`: vocabulary 7, hidden 32, 2 layers, 4 experts, top-2, jitter 0, never
downloaded), warmed up by a supervised phase on uniformly drawn answers avoiding a and b (the old rule) with
Mixtral's load-balancing loss (0.02) so every expert is used (fixed per task version, cached by
`tasks.worlds.tokens.WarmStart`). The frozen reference is that warm start. GRPO: k3 KL at beta 0.1, clipping
0.2/0.2, 8 prompts x groups of 8, Adam lr 2e-3, one pass in 4 minibatches (so every update after the first is
off-policy), both branches alike.

What must be learned after onset (both branches). Before onset `correct` pays (avoid a and b); from onset
`correct_new` (also avoid 5), which the warm start writes often.

The injection. Every iteration the answers are sampled by an `Engine`: the policy's own weights with its own
log-probs (the trainer's `behaviour_logp`). In the control and before onset its routers are the learner's
(bit-identical: behaviour_logp equals old_logp exactly). From onset the injected engine rounds the router
weights to multiples of 0.5 (`ROUTER_STEP`, a low-precision router kernel): a deterministic perturbation of
the router logits that flips near-tied routes and tracks the learner's weights. Nothing else differs. GRPO's
term is against the learner's recomputed pi_old, so the mismatch enters only through which answers are drawn.

Routing replay. `ReplayRouter` (Mixtral's router, g = softmax of the logits over the chosen set) records the
engine's routes per input row (keyed by the row's token bytes) and, when the policy's `route_replay` is
"sampler" (R3, `routing-replay`) or "old" (R2, `routing-replay-old`: the learner's own routes at its first
forward of the iteration, the pi_old of the update), overwrites the chosen experts in every learner forward
of the iteration; the gate weights stay g_i = 1[i in S] e^{z_i} / sum_{j in S} e^{z_j} so the router still
learns. The task clears the store every iteration and replays only inside it (evaluation routes itself).
In the control R3 and R2 coincide (the engine is the learner): both replay pi_old's routes.

Return: the held-out accuracy under the new rule, exactly by enumeration (the learner's own routes). Ground
truth: `heldout_accuracy`, its mean over the last 25% of the run below 0.55 (chosen on seeds 0-3: above the
policies frozen at onset, below every control).

Why no failure. The engine flips about half of the routing decisions (`flip_engine`) yet stays close to the
learner in KL (`engine_kl`): the experts are alike, and GRPO's advantage is right for whatever was sampled, so
learning from the engine's samples without correction teaches the learner the same rule, almost as well as the
control. R3 removes most of the mismatch but does not raise the learner's return; what it improves is the engine
itself, the policy as served (`engine_heldout_accuracy`, privileged). The paper's collapse (Zheng et al. 2025:
no replay at two or more minibatches collapses) does not appear at this scale.

Settings and where they were chosen (baseline injected against control, quick tier, seeds 0-1 unless said):
router steps 0.05, 0.2, 0.5 and 1.0 (0.5 gave the largest consistent gap, chosen), top-1 routing at steps 0.2
and 0.5, lr 1e-2 (the control itself degrades), 2 epochs x 4 minibatches at lr 5e-3 (the noise swamps the
effect), 2 minibatches (the control also learns less) and 2 epochs x 8 minibatches. Step 0.5 was then run on
seeds 0-3 with `routing-replay`, `routing-replay-old` and `token-tis`, and the calibration on seeds 0-9;
nothing was tuned on seeds 100-109.

Detector: `engine_kl` above 0.03 (not calibrated on fresh seeds). It separates the injected engine from the
control's (the control's is exactly 0) but, with no failure to predict, its score means nothing.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from stabench.baselines.grpo import GRPOConfig
from stabench.suite.api import Budget, DetectorSpec, Figure, GroundTruth, StabenchError, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS
from stabench.tasks.worlds import digits
from stabench.tasks.worlds.digits import (
    ANSWER_LEN,
    BOS,
    BUDGETS,
    N_ACTIONS,
    PROMPT_LEN,
    TRAIN_PROMPTS,
    correct,
    correct_new,
    fit_old_rule,
    heldout_accuracy,
    seeded,
)
from stabench.tasks.worlds.scaffold import GRPORun, OnsetKnobs
from stabench.tasks.worlds.tokens import PromptedAnswerEnv, RewardFn, WarmStart, answer_logits
from torch import nn
from torch.nn import functional as F
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter, load_balancing_loss_func

if TYPE_CHECKING:
    import pandas as pd

# --- The world: the digit world's prompts, answers and rules. -----------------------------------------------
ACCURACY_FLOOR = 0.55  # ground truth: tail mean of the held-out accuracy under the new rule

# --- The policy, the engine and the trainer. ---------------------------------------------------------------
MODEL = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
}  # fmt: skip
ROUTER_STEP = 0.5  # the engine's router weights are rounded to multiples of this (0: the learner's own)
WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR, WARMUP_AUX = 150, 256, 1e-2, 0.02
GRPO_CONFIG = replace(digits.GRPO_CONFIG, epochs=1, minibatches=4)  # one pass in 4 minibatches: off-policy


class MoERoutingEnv(PromptedAnswerEnv):
    """One episode: a training prompt (a, b), then one answer of ANSWER_LEN digits (observation: a, b, the
    answer so far). Reward at the last token: `correct` before onset (`after_onset=False`), `correct_new` after
    it, in both branches: the injection is in the inference engine, not in the reward."""

    def __init__(self, after_onset: bool = True) -> None:
        super().__init__(correct_new if after_onset else correct, TRAIN_PROMPTS, N_ACTIONS, ANSWER_LEN)


# --- The MoE policy: Mixtral routers that an engine can perturb and a learner can replay. ------------------
class Routes:
    """Routing state shared by a policy's routers (a plain object, so `copy.deepcopy` of the policy copies it).

    `rows` the input ids of the forward under way (a router sees only the flattened hidden states);
    `engine_step` > 0 while the inference engine runs (its router weights rounded to that step);
    `replay` None, "sampler" (R3: the engine's routes) or "old" (R2: the learner's own at its first forward);
    `active` replay only inside a training iteration; `store` maps (layer, row bytes) to that row's experts
    [T, k] per source; `last` the experts [B, T, k] each layer chose in the latest forward.
    """

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.engine_step = 0.0
        self.sampling = False
        self.replay: str | None = None
        self.active = False
        self.store: dict[str, dict[tuple[int, bytes], torch.Tensor]] = {"sampler": {}, "old": {}}
        self.last: dict[int, torch.Tensor] = {}

    def clear(self) -> None:
        self.store = {"sampler": {}, "old": {}}


class ReplayRouter(MixtralTopKRouter):
    """Mixtral's top-k router, g = softmax of the logits over the chosen set, with an engine mode and replay.

    Replay fixes the set S and keeps the weights differentiable: g_i = 1[i in S] e^{z_i} / sum_{j in S} e^{z_j}
    (Megatron's router replay), so the router still learns from every token.
    """

    def __init__(self, config: MixtralConfig, layer: int, routes: Routes) -> None:
        super().__init__(config)
        self.layer, self.routes = layer, routes

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = self.routes
        h = hidden_states.reshape(-1, self.hidden_dim)
        weight = self.weight
        if r.sampling and r.engine_step > 0:  # the engine's kernel: low-precision router weights
            weight = torch.round(weight / r.engine_step) * r.engine_step
        logits = F.linear(h, weight)
        n_rows, length = r.rows.shape
        chosen = logits.topk(self.top_k, dim=-1).indices.view(n_rows, length, self.top_k)
        if r.sampling:
            self._remember(r.store["sampler"], chosen)
        elif r.active and r.replay is not None:
            chosen = self._replay(r.store[r.replay], chosen, record=r.replay == "old")
        r.last[self.layer] = chosen
        chosen = chosen.reshape(-1, self.top_k)
        scores = torch.softmax(logits.float().gather(-1, chosen), dim=-1).to(h.dtype)
        return logits, scores, chosen

    def _keys(self) -> list[tuple[int, bytes]]:
        # rows of one numpy array: the same bytes as each row's own tensor, without a tensor per row
        return [(self.layer, row.tobytes()) for row in self.routes.rows.cpu().numpy()]

    def _remember(self, store: dict, chosen: torch.Tensor) -> None:
        for key, experts in zip(self._keys(), chosen, strict=True):
            store[key] = experts

    def _replay(self, store: dict, chosen: torch.Tensor, record: bool) -> torch.Tensor:
        chosen = chosen.clone()
        for i, key in enumerate(self._keys()):
            if key in store:
                chosen[i] = store[key]
            elif record:
                store[key] = chosen[i]
        return chosen


class TinyMoE(MixtralForCausalLM):
    """A 2-layer Mixtral (4 experts, top-2) whose routers share one `Routes`; `route_replay` is what a
    routing-replay stabilizer sets (`Task.provides` "route_replay")."""

    def __init__(self, config: MixtralConfig) -> None:
        super().__init__(config)
        self.routes = Routes()
        for i, layer in enumerate(self.model.layers):
            router = ReplayRouter(config, i, self.routes)
            router.weight = layer.mlp.gate.weight
            layer.mlp.gate = router

    @property
    def route_replay(self) -> str | None:
        return self.routes.replay

    @route_replay.setter
    def route_replay(self, mode: str | None) -> None:
        if mode not in (None, "sampler", "old"):
            raise ValueError(f"route_replay must be None, 'sampler' or 'old', got {mode!r}")
        self.routes.replay = mode

    def forward(self, input_ids: torch.Tensor, **kwargs):  # noqa: ANN201 (transformers' output)
        self.routes.rows = input_ids
        return super().forward(input_ids=input_ids, **kwargs)

    def chosen_experts(self) -> torch.Tensor:
        """The experts every layer chose in the latest forward: [layers, B, T, k]."""
        return torch.stack([self.routes.last[i] for i in range(len(self.model.layers))])


class Engine(nn.Module):
    """The inference engine: the policy's own weights, its routers run with weights rounded to `step` (a
    different kernel; 0: bit-identical to the learner). It keeps the routes of its latest call in `chosen`."""

    def __init__(self, policy: TinyMoE, step: float) -> None:
        super().__init__()
        self.policy, self.step = policy, step
        self.chosen: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False):  # noqa: ANN201
        routes = self.policy.routes
        routes.sampling, routes.engine_step = True, self.step
        try:
            out = self.policy(input_ids=input_ids, use_cache=use_cache)
        finally:
            routes.sampling, routes.engine_step = False, 0.0
        self.chosen = self.policy.chosen_experts()
        return out


def tiny_moe() -> TinyMoE:
    config = MixtralConfig(
        vocab_size=N_ACTIONS + 1, max_position_embeddings=PROMPT_LEN + ANSWER_LEN, bos_token_id=BOS,
        eos_token_id=BOS, pad_token_id=BOS, router_jitter_noise=0.0, attention_dropout=0.0, **MODEL,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return TinyMoE(config)


# --- The warm start (also the frozen reference). ----------------------------------------------------------
def _balanced_loss(model: nn.Module, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the answers plus Mixtral's load-balancing loss, so that every expert is used."""
    inputs = torch.cat([prompts, answers[:, :-1]], 1)
    out = model(input_ids=inputs, use_cache=False, output_router_logits=True)
    logits = out.logits[:, PROMPT_LEN - 1 :, :N_ACTIONS]
    loss = F.cross_entropy(logits.reshape(-1, N_ACTIONS), answers.reshape(-1))
    config = model.config
    aux = load_balancing_loss_func(out.router_logits, config.num_local_experts, config.num_experts_per_tok)
    return loss + WARMUP_AUX * aux


def _warm_up() -> nn.Module:
    return fit_old_rule(seeded(tiny_moe), WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR, loss=_balanced_loss)


# The MoE after a supervised warm-up on uniformly drawn old-rule answers of the training prompts, with Mixtral's
# load-balancing loss so that every expert is used.
warm_policy = WarmStart("moe-routing", _warm_up, tiny_moe)


# --- Diagnostics: pure functions on tensors. ---------------------------------------------------------------
def flip_rate(chosen_a: torch.Tensor, chosen_b: torch.Tensor) -> float:
    """Share of routing decisions (one per layer and token: [..., k] expert ids) whose expert SET differs."""
    a, b = chosen_a.sort(-1).values, chosen_b.sort(-1).values
    return float((a != b).any(-1).double().mean())


def extreme_ratio_share(logp: torch.Tensor, base_logp: torch.Tensor, mask: torch.Tensor, bound: float = 2.0) -> float:
    """Share of masked tokens whose probability ratio p / p_base is above `bound` or below 1 / `bound`."""
    far = ((logp - base_logp).abs() > math.log(bound)).double()
    return float((far * mask).sum() / mask.sum()) if float(mask.sum()) > 0 else math.nan


# --- Knobs. ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs(OnsetKnobs):
    """`MoERouting(**knobs)`; the defaults are the calibrated task."""

    router_step: float = ROUTER_STEP  # the engine's router precision after onset (injected branch)

    def check(self, shortest_run: int) -> None:
        if not (isinstance(self.router_step, (int, float)) and self.router_step > 0):
            raise StabenchError(f"moe-routing: router_step must be a positive number, got {self.router_step!r}")


# --- One run. ----------------------------------------------------------------------------------------------
class MoERoutingRun(GRPORun):
    """One seed: the GRPO trainer (policy with its route store, reference, Adam, sampler Generator) and the
    prompt Generator live here, so `copy.deepcopy` branches everything. Its step is its own: every iteration
    samples through the engine, with the route store cleared and replay active only inside it, and its row
    compares the routes of the engine, pi_old and the updated policy."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...],
                 router_step: float = ROUTER_STEP, config: GRPOConfig = GRPO_CONFIG) -> None:  # fmt: skip
        super().__init__(budget, seed, stabilizer, diagnostics, warm=warm_policy, config=config,
                         default_reward=correct, prompts=TRAIN_PROMPTS)  # fmt: skip
        self.router_step = router_step

    def reward(self, injected: bool, after_onset: bool) -> RewardFn:
        return correct_new if after_onset else correct

    def step(self, injected: bool) -> dict[str, float]:
        policy = self.trainer.policy
        which = self.prompt_rng.integers(len(self.prompts), size=self.trainer.config.n_groups)
        after_onset = self.trainer.iteration >= self.budget.onset
        engine = Engine(policy, self.router_step if injected and after_onset else 0.0)
        before = copy.deepcopy(policy)  # pi_old, for the route-flip diagnostics
        policy.routes.clear()
        policy.routes.active = True
        try:
            state = self.trainer.iterate(self.reward(injected, after_onset), self.prompts[which], sampler=engine)
        finally:
            policy.routes.active = False
            policy.routes.clear()
        batch = state.batch
        mask = batch["mask"]
        # The routes and log-probs of pi_old and of the updated policy on the batch, neither replayed.
        with torch.no_grad():
            old_logits = answer_logits(before, batch["prompts"], batch["answers"], N_ACTIONS)
            old_chosen = before.chosen_experts()
            new_logits = answer_logits(policy, batch["prompts"], batch["answers"], N_ACTIONS)
            new_chosen = policy.chosen_experts()
        answers = batch["answers"][..., None]
        old_logp = torch.log_softmax(old_logits, -1).gather(-1, answers).squeeze(-1)
        new_logp = torch.log_softmax(new_logits, -1).gather(-1, answers).squeeze(-1)
        on_answer = slice(PROMPT_LEN - 1, None)  # the positions that predict answer tokens
        row: dict[str, float] = {
            "step": float(self.trainer.tokens),
            "entropy": state.extras["entropy"],
            "reward": float(batch["rewards"].mean()),
            "heldout_accuracy": heldout_accuracy(policy),
            "engine_heldout_accuracy": heldout_accuracy(Engine(policy, engine.step)),
            "flip_engine": flip_rate(engine.chosen[:, :, on_answer], old_chosen[:, :, on_answer]),
            "flip_update": flip_rate(old_chosen[:, :, on_answer], new_chosen[:, :, on_answer]),
            "engine_ratio_share": extreme_ratio_share(batch["old_logp"], batch["behaviour_logp"], mask),
            "update_ratio_share": extreme_ratio_share(new_logp, old_logp, mask),
        }
        row["return"] = row["heldout_accuracy"]
        policy.routes.clear()  # the engine's evaluation recorded the held-out rows
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


# --- The figure. -------------------------------------------------------------------------------------------
def draw_route_flips(table: pd.DataFrame, out: Path) -> list[Path]:
    """The share of routes the engine flips over training and against each run's normalized return."""
    from stabench.suite import figures

    rows = figures.need(table, "moe-routing", "flip_engine")
    return figures.gap_against_return(rows, "flip_engine", "share of routes flipped, engine vs learner", out,
                                      "16_moe_routing")  # fmt: skip


class MoERouting(Task):
    """See the module docstring."""

    id = "moe-routing"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    experimental = True
    budgets = BUDGETS  # the digit world's schedule (quick: 50 iterations, onset 3)
    ground_truth = GroundTruth(
        metric="heldout_accuracy", threshold=ACCURACY_FLOOR, fails_when="below", reduce="tail_mean"
    )
    matched_fix = "routing-replay"
    methods = ("baseline", "routing-replay", "routing-replay-old", "token-tis", "clip-higher", "dual-clip")
    detector = DetectorSpec(metric="engine_kl", threshold=0.03, above=True)
    diagnostics = ("engine_gap",)  # engine_kl and the other training-inference gap estimates
    privileged = ("engine_heldout_accuracy",)  # exact by enumeration over the held-out prompts
    provides = frozenset({"route_replay"})
    return_floor = 0.3262  # frozen-at-onset: post-onset mean held-out accuracy, mean of seeds 0-9 (exact per seed)
    return_ceiling = 0.5896  # the control (baseline method): its post-onset mean, mean of seeds 0-9
    knobs_type = Knobs
    environments = {"stabench/MoERouting-v0": "MoERoutingEnv"}
    figures = (
        Figure(
            "16_moe_routing",
            "route flips against return",
            "moe-routing: the share of routes the engine flips against the learner over training (left) and "
            "against each run's normalized return (right).",
            draw_route_flips,
        ),
    )
    paper = """On moe-routing the policy is a tiny Mixture-of-Experts, each batch is reused for several minibatch
updates, and from onset the answers are drawn by an inference engine whose rounded routers choose other experts
than the learner's. The routing failure Zheng et al. (2025) report did not appear at this scale, and the task
stays experimental: an engine that chooses other experts than the learner for about half of the routing
decisions costs the off-policy learner little, and replaying the engine's routes shrinks the gap without raising
the return. The figure below shows the share of flipped routes and the return of every run."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> MoERoutingRun:
        return MoERoutingRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs.router_step)
