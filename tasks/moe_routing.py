"""moe-routing: from onset the answers come from an inference engine whose routers send every continuation token
to another expert than the learner's, GRPO credits an answer's first token with what those experts write
(Zheng et al. 2025, seed 003: a MoE token's probability is conditioned on its routes), and the learner
abandons a path it could complete itself. Version 2, experimental: its failure-rate checks hold on seeds 0-9 and
100-109, but its references and its fix's normalized-return interval miss the bar (`results/calibration.md`).

The world (the digit world's prompts, `tasks.worlds.digits`): a prompt is two digits (a, b) from 0-5 (the 28
training prompts); an answer is 6 digits. Its rule is not linear in the prompt: a digit is banned when it equals
c = (a + b) mod 6 (`banned`). The policy is a tiny Mixtral built from a config (`TinyMoE`: vocabulary 7, hidden
32, 1 layer, 6 experts, top-1 routing, jitter 0, expert weights scaled by 5 at init so that an expert's output
outweighs the rest of the residual stream; never downloaded). Its warm-up (300 supervised steps, fixed per task
version, shipped as a file, `tasks.worlds.tokens.WarmStart`) writes answers avoiding c, their first digit set to 5
with probability 0.5, and supervises every router to send a prompt's tokens to expert c (cross-entropy on the router
logits, weight 0.3), so each expert learns to write for one banned digit, as the experts of a trained MoE
specialize. The frozen reference is that warm start (unused: beta 0).

What must be learned after onset (both branches). Before onset `old_rule` pays (every digit avoids c). From
onset `risky_rule` pays: a first digit 5 (the risky path) pays 1 if digits 2-6 avoid c, else 0; any other first
digit (the safe path) pays a flat 0.65. The optimum is the risky path completed; at onset the policy takes it
about half the time and completes it about 95% of the time, so both branches must learn to choose it.

The trainer. On-policy GRPO (`baselines/grpo.py`): 8 prompts x groups of 8, one Adam step per batch (lr 2e-3),
no KL term (beta 0). The learner recomputes pi_old with its own routes and forms its term against it; the
engine's log-probs mu reach the hooks as `behaviour_logp`.

The injection. Every iteration samples through an `Engine`: the policy's own weights, its routes recorded per
row. In the control and before onset the engine routes as the learner does (bit-identical: behaviour_logp
equals old_logp). From onset the injected engine's router takes the runner-up expert on every continuation
token (answer digits 2-6; the first digit is routed as the learner routes it) whose leader's margin is below
`flip_margin` (default infinite: every one), a modelled engine bug, far more flips than the ~10% real engines
show; what the task measures is what a flipped route costs the learner, not how often engines flip.

Mechanism (as measured, `gt_risky_share`, `gt_completion`, `gt_engine_completion`). A flipped token goes to an
expert that writes for another banned digit: at onset the engine completes the risky path about 54% of the
time against the learner's 95%, so in the sampled batch a first digit 5 earns less than the safe path's 0.65.
Uncorrected GRPO credits the first digit with those failures and the learner's probability of the risky first
digit falls (it ends near or below the policy frozen at onset). The control learns to choose the risky path.
Rollout routing replay (`routing-replay`, R3: the learner's forwards use the engine's routes) trains the
experts the engine actually runs, so the engine's completion rises to about the learner's and the risky path
pays in the batch again: it keeps the path and learns. Replaying the learner's own routes (`routing-replay-old`, R2)
changes nothing on-policy (the routes of pi_old are the learner's). Sequence-level truncated IS (`seq-tis`)
also helps, less reliably (results/calibration.md).

Return (the true one): the learner's exact expected post-onset reward on `EVAL_PROMPTS` (7 of the training
prompts, whose banned digits are 0 and 1; the rule does not generalize to unseen pairs at this size),
`exact_reward` = mean over prompts of p5 c + (1 - p5) 0.65 with p5 the risky first digit's probability and c the
probability that digits 2-6 avoid c after it (the learner's own routes), computed exactly by one forward over the
tree of allowed continuations. Evaluated every EVAL_EVERY = 3 iterations and at the last one (NaN between). Ground
truth: its mean over the last 25% of the run below 0.82. Normalized return: floor the policy frozen at onset,
ceiling the baseline's control, both averaged over calibration seeds 0-9 at the quick budget.

Detector: `engine_kl` above 0.1, verl's health warning (as on inference-mismatch), not tuned on any seed. Under
routing replay the training-inference KL the learner sees is 0 by construction (it evaluates pi_old on the
engine's routes), so the detector is blind there.

Settings and the seeds they were chosen on (prototypes of this design on the project's GRPO, seeds 0-9, or 0-3
where said; the tables are in results/calibration.md's design notes). Before any RL, a flipped route had to
change what the engine writes: with the digit world's linear rule (avoid a and b), load-balanced experts, 4 or 8
experts, top-1 or top-2, expert scales 1-20, and even an engine that always takes the runner-up expert, the
engine's completion stayed within 0.1 of the learner's; a nonlinear rule with 4 experts supervised to the class
(a + b) mod 4 dropped it by 0.47, and 6 experts each owning one banned digit by 0.32. RL with 4 experts (seeds
0-3): runner-up margins 6 and 9 (the margins grow in training and the flips fade) and every continuation route
flipped, all with a control barely above the frozen policy. With 6 experts, every continuation route flipped:
lr 5e-3 (the baseline escapes more often: the engine's completion recovers as the shared layers learn), 3e-3
(baseline below 0.80 on only some seeds), 2e-3 (chosen); at 3e-3 a safe payment of 0.7, router supervision weight
1.0 and expert scale 10, and at 2e-3 80 iterations, did no better. The threshold 0.82 was set on seeds 0-9
between the baseline's tails and the fix's; seeds 100-109 were run once after every setting was frozen.

After the verdict, twelve probes of version 2 with one thing changed (a pre-onset rule that ignores the first digit
or equals the post-onset one, onsets 10 and 15, four minibatches per batch, safe payment 0.7, expert weights x10,
risky shares 0.3; results/calibration.md, design notes) found no setting that clears the bar: where routing replay
keeps the path the baseline escapes too (the runner-up experts' completion rises as the shared layers learn), and
every healthy-phase update re-routes 5-16% of the learner's tokens, so the policy frozen at onset differs by seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from stabench.baselines.grpo import GRPOConfig
from stabench.suite.api import (
    BEHAVIOUR_POLICY,
    Budget,
    DetectorSpec,
    Figure,
    GroundTruth,
    StabenchError,
    Stabilizer,
    Task,
    TrainState,
)
from stabench.tasks.worlds import digits
from stabench.tasks.worlds.digits import BOS, N_ACTIONS, PROMPT_LEN, TRAIN_PROMPTS, WARMUP_BATCH, WARMUP_SEED, seeded
from stabench.tasks.worlds.scaffold import GRPORun, OnsetKnobs
from stabench.tasks.worlds.tokens import PromptedAnswerEnv, RewardFn, WarmStart
from torch import nn
from torch.nn import functional as F
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

if TYPE_CHECKING:
    import pandas as pd

# --- The world: the digit world's prompts, 6-digit answers, a banned digit that is not linear in the prompt. --
ANSWER_LEN = 6
RISKY = 5  # a first digit equal to this takes the risky path; any other first digit the safe one
SAFE_PAY = 0.65  # the safe path's flat payment (the risky path pays 1 or 0)
RISKY_SHARE = 0.5  # the warm-up sets the first digit to RISKY with this probability
EVAL_PROMPTS = TRAIN_PROMPTS[::4]  # 7 training prompts (every fourth); their banned digits are 0 and 1 only
EVAL_EVERY = 3  # the exact evaluation runs every EVAL_EVERY iterations (and at the last one)
REWARD_FLOOR = 0.82  # ground truth: tail mean of the exact reward below this fails


def banned(prompts: torch.Tensor) -> torch.Tensor:
    """The digit a prompt (BOS, a, b) bans: c = (a + b) mod 6, [B]."""
    return (prompts[:, 1] + prompts[:, 2]) % N_ACTIONS


def old_rule(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The pre-onset rule: 1 if no answer digit equals the prompt's banned digit c."""
    return (answers != banned(prompts)[:, None]).all(-1).float()


def risky_rule(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The post-onset rule: a first digit RISKY pays 1 if digits 2-6 avoid c (else 0); any other first digit
    pays SAFE_PAY."""
    clean = (answers[:, 1:] != banned(prompts)[:, None]).all(-1).float()
    return torch.where(answers[:, 0] == RISKY, clean, torch.full_like(clean, SAFE_PAY))


class MoERoutingEnv(PromptedAnswerEnv):
    """One episode: a training prompt (a, b), then one answer of ANSWER_LEN digits (observation: a, b, the
    answer so far). Reward at the last digit: `old_rule` before onset (`after_onset=False`), `risky_rule` after,
    in both branches: the injection is in the inference engine, not in the reward."""

    def __init__(self, after_onset: bool = True) -> None:
        super().__init__(risky_rule if after_onset else old_rule, TRAIN_PROMPTS, N_ACTIONS, ANSWER_LEN)


# --- The policy, the engine and the trainer. ---------------------------------------------------------------
MODEL = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 2, "num_local_experts": 6, "num_experts_per_tok": 1,
}  # fmt: skip
EXPERT_SCALE = 5.0  # expert weights are multiplied by this at init
FLIP_MARGIN = math.inf  # the injected engine flips a continuation route whose leader's margin is below this
WARMUP_STEPS, WARMUP_LR, ROUTE_WEIGHT = 300, 1e-2, 0.3
LR = 2e-3
GRPO_CONFIG = replace(digits.GRPO_CONFIG, lr=LR, beta=0.0, epochs=1, minibatches=1, answer_len=ANSWER_LEN)
BUDGETS = {
    "smoke": Budget(iterations=4, onset=2, seeds=1, report_every=1),
    "quick": Budget(iterations=60, onset=3, seeds=3),
    "full": Budget(iterations=120, onset=5, seeds=10),
}


# --- The MoE policy: Mixtral routers that an engine can perturb and a learner can replay. ------------------
class Routes:
    """Routing state shared by a policy's routers (a plain object, so `copy.deepcopy` of the policy copies it).

    `rows` the input ids of the forward under way (a router sees only the flattened hidden states);
    `flip_margin` > 0 while the injected engine runs (its routers take the runner-up expert on continuation
    tokens whose leader's margin is below it); `sampling` while any engine runs (its routes are recorded);
    `replay` None, "sampler" (R3: the engine's routes) or "old" (R2: the learner's own at its first forward);
    `active` replay only inside a training iteration; `store` maps (layer, row bytes) to that row's experts
    [T, k] per source; `last` the experts [B, T, k] each layer chose in the latest forward.
    """

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.flip_margin = 0.0
        self.sampling = False
        self.replay: str | None = None
        self.active = False
        self.store: dict[str, dict[tuple[int, bytes], torch.Tensor]] = {"sampler": {}, "old": {}}
        self.last: dict[int, torch.Tensor] = {}

    def clear(self) -> None:
        self.store = {"sampler": {}, "old": {}}


class ReplayRouter(MixtralTopKRouter):
    """Mixtral's top-1 router (the gate weight, a softmax over the chosen set, is 1) with an engine mode and
    replay.

    Replay fixes the chosen set S and keeps the weights differentiable: g_i = 1[i in S] e^{z_i} / sum_{j in S}
    e^{z_j} (Megatron's router replay). With top-1 routing the router's logits get no gradient through g, so
    routes change only through the hidden states that feed the router.
    """

    def __init__(self, config: MixtralConfig, layer: int, routes: Routes) -> None:
        super().__init__(config)
        if self.top_k != 1:
            raise ValueError(f"ReplayRouter routes top-1, got num_experts_per_tok={self.top_k}")
        self.layer, self.routes = layer, routes

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = self.routes
        h = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(h, self.weight)
        n_rows, length = r.rows.shape
        top = logits.topk(2, dim=-1)
        chosen = top.indices[:, :1]
        if r.sampling and r.flip_margin > 0:  # the injected engine: the runner-up on continuation tokens
            later = (torch.arange(length) >= PROMPT_LEN).repeat(n_rows)[:, None]
            near = (top.values[:, :1] - top.values[:, 1:]) < r.flip_margin
            chosen = torch.where(later & near, top.indices[:, 1:], chosen)
        chosen = chosen.view(n_rows, length, 1)
        if r.sampling:
            self._remember(r.store["sampler"], chosen)
        elif r.active and r.replay is not None:
            chosen = self._replay(r.store[r.replay], chosen, record=r.replay == "old")
        r.last[self.layer] = chosen
        chosen = chosen.reshape(-1, 1)
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
    """A 1-layer Mixtral (6 experts, top-1) whose routers share one `Routes`; `route_replay` is what a
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
    """The inference engine: the policy's own weights; its routers take the runner-up expert on continuation
    tokens whose leader's margin is below `flip_margin` (0: bit-identical to the learner). It keeps the routes of
    its latest call in `chosen`."""

    def __init__(self, policy: TinyMoE, flip_margin: float) -> None:
        super().__init__()
        self.policy, self.flip_margin = policy, flip_margin
        self.chosen: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False):  # noqa: ANN201
        routes = self.policy.routes
        routes.sampling, routes.flip_margin = True, self.flip_margin
        try:
            out = self.policy(input_ids=input_ids, use_cache=use_cache)
        finally:
            routes.sampling, routes.flip_margin = False, 0.0
        self.chosen = self.policy.chosen_experts()
        return out


def tiny_moe() -> TinyMoE:
    config = MixtralConfig(
        vocab_size=N_ACTIONS + 1, max_position_embeddings=PROMPT_LEN + ANSWER_LEN, bos_token_id=BOS,
        eos_token_id=BOS, pad_token_id=BOS, router_jitter_noise=0.0, attention_dropout=0.0, **MODEL,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    model = TinyMoE(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for p in layer.mlp.experts.parameters():
                p.mul_(EXPERT_SCALE)
    return model


# --- The warm start (also the frozen reference). ----------------------------------------------------------
def warm_up(steps: int = WARMUP_STEPS) -> TinyMoE:
    """Supervised warm-up (Adam, WARMUP_BATCH answers a step, its own Generator): answers of uniformly drawn
    digits avoiding the prompt's c, the first digit then set to RISKY with probability RISKY_SHARE; every
    router is pulled towards expert c (cross-entropy on its logits, weight ROUTE_WEIGHT), so that expert c
    writes the answers of the prompts that ban c."""
    model = seeded(tiny_moe)
    rng = np.random.default_rng(WARMUP_SEED)
    allowed = [[d for d in range(N_ACTIONS) if d != c] for c in banned(TRAIN_PROMPTS).tolist()]
    optimizer = torch.optim.Adam(model.parameters(), lr=WARMUP_LR)
    for _ in range(steps):
        which = rng.integers(len(TRAIN_PROMPTS), size=WARMUP_BATCH)
        picks = rng.integers(1 << 30, size=(WARMUP_BATCH, ANSWER_LEN))
        answers = torch.tensor([[allowed[i][k % len(allowed[i])] for k in row] for i, row in zip(which, picks)])
        answers[torch.from_numpy(rng.random(WARMUP_BATCH) < RISKY_SHARE), 0] = RISKY
        prompts = TRAIN_PROMPTS[which]
        inputs = torch.cat([prompts, answers[:, :-1]], 1)
        out = model(input_ids=inputs, use_cache=False, output_router_logits=True)
        logits = out.logits[:, PROMPT_LEN - 1 :, :N_ACTIONS]
        loss = F.cross_entropy(logits.reshape(-1, N_ACTIONS), answers.reshape(-1))
        owner = banned(prompts)[:, None].expand(-1, inputs.shape[1]).reshape(-1)
        for router_logits in out.router_logits:
            loss = loss + ROUTE_WEIGHT * F.cross_entropy(router_logits.reshape(len(owner), -1), owner)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def _warm_up() -> nn.Module:
    return warm_up()


# fixed per task version, shipped as tasks/warm_starts/moe-routing.safetensors (after changing the warm-up:
# stabench warm-start --retrain moe-routing)
warm_policy = WarmStart("moe-routing", _warm_up, tiny_moe,
                        sha256="82fa6b40077cfbc1b24b1d5ae9ac20cbdf58334085ec41c53fe5da455b7f8e04")


# --- Exact evaluation: a tree walk over the risky path's allowed continuations. ----------------------------
# Rows [BOS, a, b, RISKY, c1..c4] for every evaluation prompt and every c in its allowed digits ** 4.
TREE, SPANS, ALLOWED = digits.continuation_tree(
    EVAL_PROMPTS, [[d for d in range(N_ACTIONS) if d != c] for c in banned(EVAL_PROMPTS).tolist()], RISKY, ANSWER_LEN
)
STAT_KEYS = ("exact_reward", "gt_risky_share", "gt_completion", "gt_engine_completion")


def exact_stats(policy: TinyMoE, flip_margin: float = FLIP_MARGIN) -> dict[str, float]:
    """Exact statistics of the learner (its own routes) and of the injected engine on EVAL_PROMPTS, averaged:
    the expected post-onset reward `exact_reward` = p5 c + (1 - p5) SAFE_PAY, the risky first digit's
    probability p5 (`gt_risky_share`), the learner's risky-path completion c (`gt_completion`) and the
    engine's (`gt_engine_completion`). One forward over `TREE` each; the route store is left empty."""
    with torch.no_grad():
        own = policy(input_ids=TREE, use_cache=False).logits[..., :N_ACTIONS].double()
        engine = Engine(policy, flip_margin)(TREE).logits[..., :N_ACTIONS].double()
    policy.routes.clear()  # the engine's forward recorded the tree's rows
    first = torch.softmax(own[:, PROMPT_LEN - 1], -1)[:, RISKY]
    own, engine = torch.log_softmax(own[:, PROMPT_LEN:], -1), torch.log_softmax(engine[:, PROMPT_LEN:], -1)
    per_prompt = []
    for (s, e), ok in zip(SPANS, ALLOWED, strict=True):
        p5, c = float(first[s]), digits.completion(own[s:e], ok)
        per_prompt.append((p5 * c + (1 - p5) * SAFE_PAY, p5, c, digits.completion(engine[s:e], ok)))
    return dict(zip(STAT_KEYS, np.mean(per_prompt, 0).tolist(), strict=True))


# --- Diagnostics: pure functions on tensors. ---------------------------------------------------------------
def flip_rate(chosen_a: torch.Tensor, chosen_b: torch.Tensor) -> float:
    """Share of routing decisions (one per layer and token: [..., k] expert ids) whose expert SET differs."""
    a, b = chosen_a.sort(-1).values, chosen_b.sort(-1).values
    return float((a != b).any(-1).double().mean())


# --- Knobs. ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs(OnsetKnobs):
    """`MoERouting(**knobs)`; the defaults are the calibrated task."""

    flip_margin: float = FLIP_MARGIN  # the injected engine flips continuation routes whose margin is below this

    def check(self, shortest_run: int) -> None:
        value = self.flip_margin
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise StabenchError(f"moe-routing: flip_margin must be a positive number, got {value!r}")


# --- One run. ----------------------------------------------------------------------------------------------
class MoERoutingRun(GRPORun):
    """One seed: the GRPO trainer (policy with its route store, reference, Adam, sampler Generator) and the
    prompt Generator live here, so `copy.deepcopy` branches everything. Every iteration samples through an
    engine, with the route store cleared and replay active only inside the iteration; its row compares the
    engine's routes with the learner's on the batch."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...],
                 flip_margin: float = FLIP_MARGIN, config: GRPOConfig = GRPO_CONFIG) -> None:  # fmt: skip
        super().__init__(budget, seed, stabilizer, diagnostics, warm=warm_policy, config=config,
                         default_reward=old_rule, prompts=TRAIN_PROMPTS)  # fmt: skip
        self.flip_margin = float(flip_margin)

    def reward(self, injected: bool, after_onset: bool) -> RewardFn:
        return risky_rule if after_onset else old_rule

    def sampler(self, injected: bool, after_onset: bool) -> Engine:
        """The injected branch's engine flips routes from onset; otherwise it routes as the learner does."""
        self.engine = Engine(self.trainer.policy, self.flip_margin if injected and after_onset else 0.0)
        return self.engine

    def iterate(self, reward: RewardFn, prompts: torch.Tensor, sampler: nn.Module | None) -> TrainState:
        """The iteration with replay active and a fresh route store; evaluation afterwards routes itself."""
        routes = self.trainer.policy.routes
        routes.clear()
        routes.active = True
        try:
            return super().iterate(reward, prompts, sampler)
        finally:
            routes.active = False
            routes.clear()

    def row(self, state: TrainState, injected: bool) -> dict[str, float]:
        it = self.trainer.iteration
        evaluate = it % EVAL_EVERY == 0 or it >= self.budget.iterations
        stats = (self.evaluate(exact_stats, self.trainer.policy, self.flip_margin) if evaluate
                 else dict.fromkeys(STAT_KEYS, math.nan))  # fmt: skip
        return {
            "step": float(self.trainer.tokens),
            "return": stats["exact_reward"],
            "entropy": state.extras["entropy"],
            "reward": float(state.batch["rewards"].mean()),
            "flip_engine": self.flips(state.batch),
            **stats,
        }

    def flips(self, batch: dict[str, torch.Tensor]) -> float:
        """Share of the batch's continuation routes (answer digits 2-6) on which this iteration's engine chooses
        another expert than the learner, both at the updated weights."""
        policy = self.trainer.policy
        inputs = torch.cat([batch["prompts"], batch["answers"][:, :-1]], 1)
        with torch.no_grad():
            policy(input_ids=inputs, use_cache=False)
            own = policy.chosen_experts()[:, :, PROMPT_LEN:]
            self.engine(inputs)
        policy.routes.clear()
        return flip_rate(self.engine.chosen[:, :, PROMPT_LEN:], own)


# --- The figure. -------------------------------------------------------------------------------------------
def draw_engine_kl(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    """The training-inference KL over training and against each run's normalized return."""
    from stabench.suite import figures

    rows = figures.need(table, "moe-routing", "engine_kl")
    return figures.gap_against_return(rows, "engine_kl", "training-inference KL E_mu[log mu - log pi_old]", out,
                                      name)  # fmt: skip


class MoERouting(Task):
    """See the module docstring."""

    id = "moe-routing"
    family = "reasoning"
    version = "2"
    trainer = "grpo"
    experimental = True  # version 2: failure rates met on both seed sets; references and the fix's interval missed
    budgets = BUDGETS
    ground_truth = GroundTruth(metric="exact_reward", threshold=REWARD_FLOOR, fails_when="below", reduce="tail_mean")
    matched_fix = "routing-replay"
    methods = ("baseline", "routing-replay", "seq-tis")
    detector = DetectorSpec(metric="engine_kl", threshold=0.1, above=True)
    diagnostics = ("engine_gap", "grad_norms")
    privileged = STAT_KEYS[1:]
    provides = frozenset({"route_replay", BEHAVIOUR_POLICY})  # the engine samples
    # Floor: the policy frozen at onset, its exact post-onset return averaged over calibration seeds 0-9; ceiling:
    # the baseline's control's post-onset mean return on the same seeds. Both measured once and fixed (version 2).
    return_floor = 0.7811
    return_ceiling = 0.8722
    knobs_type = Knobs
    environments = {"stabench/MoERouting-v0": "MoERoutingEnv"}
    figures = (
        Figure(
            "engine-kl",
            "training-inference KL against return",
            "moe-routing: the training-inference KL over training (left) and against each run's normalized "
            "return (right); the injected engine flips every continuation route (`flip_engine` 1).",
            draw_engine_kl,
        ),
    )
    paper = """On moe-routing the policy is a tiny Mixture-of-Experts whose experts each write for one banned digit,
and from onset the answers are drawn by an inference engine that routes every continuation token to the
runner-up expert. The reward pays a risky first digit only if the continuation is right, and a safe first digit
a flat 0.65. Because the engine's experts complete the risky path badly, the uncorrected learner credits the
risky first digit with the engine's failures and abandons the path it could complete itself. Replaying the
engine's routes in the learner (rollout routing replay) trains the experts the engine runs, the engine's
completion recovers and the learner keeps the risky path; replaying the learner's own routes changes nothing
on-policy. The task stays experimental: the warm start scores above the policy frozen at onset, and the fix's
gain comes too late for its post-onset mean to clear the frozen policy's. The figure below shows the
training-inference KL and the return of every run."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> MoERoutingRun:
        return MoERoutingRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs.flip_margin)
