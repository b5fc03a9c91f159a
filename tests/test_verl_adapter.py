"""verl's policy losses on the suite (`baselines/stabilizers/verl_losses.py`).

Without verl (CI installs only `.[test]`): a function of verl's signature written here, run as a user runs theirs
(`verl:FILE.py:FUNCTION`), shows how the suite's batch becomes verl's arguments (anchor, bool mask, the aggregation
mode matched to the trainer's `token_weight`, the config's clip from the batch, the rollout-correction weights) and
that it replaces exactly the policy term; naming `verl:NAME` without verl is one error line with the install command.
Where verl is installed (`pip install -e ".[verl]"`): every loss verl registers runs a smoke sweep, verl's vanilla PPO
has the suite's policy term's loss and gradient, verl's gspo, cispo and sapo the suite's built-ins', and the
rollout-correction weights are verl's own helper's."""

from __future__ import annotations

import functools
import subprocess
import sys

import pandas as pd
import pytest
import torch
from stabench.baselines.grpo import token_weights
from stabench.baselines.stabilizers import verl_losses as vl
from stabench.baselines.stabilizers.clipping import policy_term, token_weighted_sum, trainer_ratio
from stabench.suite import registry
from stabench.suite.api import BEHAVIOUR_POLICY, StabenchError, provided_keys
from stabench.suite.cli import main

pytestmark = pytest.mark.smoke

# A policy loss of verl's signature as a user writes one: PPO's clipped surrogate (verl's `vanilla` without its dual
# clip), aggregated like verl's `agg_loss` in the three modes the trainers map to; it records what it was handed.
USER_LOSS = '''
import torch

SEEN = []


def aggregate(loss_mat, mask, mode):
    mask = mask.to(loss_mat.dtype)
    rows = (mask.sum(-1) > 0).sum()
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return ((loss_mat * mask).sum(-1) / (mask.sum(-1) + 1e-8)).sum() / rows
    if mode == "seq-mean-token-sum-norm":
        return (loss_mat * mask).sum() / rows / mask.shape[-1]
    raise ValueError(mode)


def my_ppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None):
    SEEN.append({"old": old_log_prob, "mask": response_mask, "mode": loss_agg_mode, "config": config,
                 "weights": rollout_is_weights})
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.get("clip_ratio_high", config.clip_ratio)
    ratio = torch.exp(log_prob - old_log_prob)
    losses = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - low, 1 + high))
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    kl = float((old_log_prob - log_prob).detach().mean())
    return aggregate(losses, response_mask, loss_agg_mode), {"actor/ppo_kl": kl}
'''
MODES = {"token-mean": "token-mean", "seq-mean": "seq-mean-token-mean", "constant": "seq-mean-token-sum-norm"}


@functools.cache
def task_classes() -> tuple:
    """Every registered task's class (where a stabilizer acts is read from the class: its trainer and `provides`)."""
    return tuple(registry.resolve_class("task", n) for n in registry.names("task"))


def pg_tasks() -> tuple:
    """The tasks of a policy-gradient trainer (all but DQN's)."""
    return tuple(t for t in task_classes() if t.trainer != "dqn")


@pytest.fixture
def user_loss(tmp_path):
    """`verl:<file>:my_ppo` and the list of what each call was handed."""
    path = tmp_path / "user_loss.py"
    path.write_text(USER_LOSS)
    seen = registry.load_object(f"{path}:SEEN")
    seen.clear()
    return f"verl:{path}:my_ppo", seen


def batch_of(aggregation: str = "token-mean", spread: float = 0.3, seed: int = 0, step: bool = False):
    """A GRPO-like minibatch in float64 (answers of unequal length; `step`: a PPO step rollout, [B]) whose ratio
    pi_theta / anchor spreads by `spread` in log, logp a leaf with grad, a sampler behind `behaviour_logp`."""
    g = torch.Generator().manual_seed(seed)
    shape = (8,) if step else (6, 5)
    mask = torch.ones(shape, dtype=torch.float64)
    if not step:
        mask[0, 3:], mask[2, 1:], mask[4, 4:] = 0, 0, 0
    anchor = -1.5 + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    logp = (anchor + spread * torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(shape[0], generator=g, dtype=torch.float64)
    adv = adv if step else adv[:, None] * mask
    weight = torch.full(shape, 1 / shape[0], dtype=torch.float64) if step else token_weights(mask, aggregation)
    return {"logp": logp, "anchor_logp": anchor, "old_logp": anchor,
            "behaviour_logp": anchor - 0.3 * torch.rand(shape, generator=g, dtype=torch.float64),
            "advantages": adv, "mask": mask, "token_weight": weight,
            "clip_low": torch.tensor(0.2), "clip_high": torch.tensor(0.28)}


def suite_term(batch):
    """The trainer's own policy term (`clipping.policy_term`, aggregated with `token_weight`)."""
    return token_weighted_sum(policy_term(trainer_ratio(batch), batch["advantages"], 0.2, 0.28), batch)


def loss_and_grad(ref_or_stabilizer, batch):
    stabilizer = (registry.make_stabilizer(ref_or_stabilizer) if isinstance(ref_or_stabilizer, str)
                  else ref_or_stabilizer)
    terms = stabilizer.loss({"policy": torch.tensor(7.0), "kl": torch.tensor(0.5)}, batch)
    assert terms["kl"] == 0.5  # only the policy term is replaced
    return terms["policy"], torch.autograd.grad(terms["policy"], batch["logp"])[0]


@pytest.mark.parametrize("aggregation", list(MODES))
def test_a_function_of_verls_signature_gets_the_batch_and_replaces_the_policy_term(user_loss, aggregation):
    ref, seen = user_loss
    batch = batch_of(aggregation)
    loss, grad = loss_and_grad(ref, batch)
    expected = suite_term(batch)
    assert torch.allclose(loss, expected, rtol=1e-7)  # seq-mean-token-mean divides by |o_i| + 1e-8
    assert torch.allclose(grad, torch.autograd.grad(expected, batch["logp"])[0], rtol=1e-7, atol=1e-15)
    call = seen[-1]
    assert call["mode"] == MODES[aggregation]  # the verl mode whose weights are the trainer's token_weight
    assert call["mask"].dtype == torch.bool and torch.equal(call["mask"], batch["mask"] > 0)
    assert torch.equal(call["old"], batch["anchor_logp"]) and call["weights"] is None
    config = call["config"]
    assert config.clip_ratio == config.clip_ratio_low == pytest.approx(0.2)
    assert config.clip_ratio_high == pytest.approx(0.28) and config.get("clip_ratio_c", None) == 3.0
    assert config.policy_loss.loss_mode == "my_ppo" and config.policy_loss.dro_beta == 0.1
    assert config.global_batch_info == {} and config.loss_agg_mode == MODES[aggregation]


def test_a_step_rollout_is_a_batch_of_one_action_sequences(user_loss):
    ref, seen = user_loss
    batch = batch_of(step=True)
    loss, grad = loss_and_grad(ref, batch)
    expected = suite_term(batch)
    assert torch.allclose(loss, expected) and torch.allclose(grad, torch.autograd.grad(expected, batch["logp"])[0])
    assert seen[-1]["mask"].shape == (8, 1) and seen[-1]["mode"] == "token-mean"


def test_the_aggregation_modes_are_verls_and_a_weighting_none_of_them_is_refused(user_loss):
    mask = batch_of()["mask"]
    for aggregation, mode in MODES.items():
        assert torch.allclose(vl.mode_weights(mask, mode), token_weights(mask, aggregation))
    ref, seen = user_loss
    batch = batch_of()
    batch["token_weight"] = batch["token_weight"] * torch.linspace(0.5, 1.5, 5, dtype=torch.float64)
    with pytest.raises(registry.PluginError, match="token_weight is none of verl's loss_agg_modes"):
        loss_and_grad(ref, batch)
    chosen = type("Chosen", (registry.resolve_class("stabilizer", ref),), {"loss_agg_mode": "seq-mean-token-mean"})
    loss, _ = loss_and_grad(chosen(), batch)  # a mode named by the method aggregates that way whatever the trainer's
    assert seen[-1]["mode"] == "seq-mean-token-mean"
    assert torch.allclose(loss, token_weighted_sum(
        policy_term(trainer_ratio(batch), batch["advantages"], 0.2, 0.28), {"token_weight": token_weights(
            batch["mask"], "seq-mean")}))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_hands_verls_truncated_weights_and_acts_only_with_a_sampler(user_loss, level):
    ref, seen = user_loss
    cls = type("Corrected", (registry.resolve_class("stabilizer", ref),), {"rollout_is": level})
    batch = batch_of()
    loss_and_grad(cls(), batch)
    mask = batch["mask"]
    log_ratio = (batch["old_logp"] - batch["behaviour_logp"]) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)
    assert torch.allclose(seen[-1]["weights"], torch.exp(log_ratio).clamp(max=2.0) * mask)
    assert torch.equal(seen[-1]["old"], batch["old_logp"])  # decoupled: the trust region around the learner's pi_old
    for task in pg_tasks():
        assert cls().applies_to(task) == (BEHAVIOUR_POLICY in provided_keys(task)), task.id


def test_a_verl_loss_acts_on_every_policy_gradient_trainer_and_is_recorded_by_module_and_function(user_loss,
                                                                                                  monkeypatch):
    ref, _ = user_loss
    stabilizer = registry.make_stabilizer(ref)
    assert all(stabilizer.applies_to(task) for task in pg_tasks())
    assert not any(stabilizer.applies_to(task) for task in task_classes() if task.trainer == "dqn")
    assert registry.method_name(ref) == "verl:user_loss.my_ppo"
    folder, name = ref[len("verl:"):].rsplit("/", 1)
    monkeypatch.chdir(folder)
    assert registry.canonical(f"verl:{name}") == ref  # Ray workers get the absolute path


@pytest.fixture
def without_verl(monkeypatch):
    """An environment where `import verl` fails (whether or not it is installed here)."""
    for module in [m for m in sys.modules if m == "verl" or m.startswith("verl.")] + ["verl"]:
        monkeypatch.setitem(sys.modules, module, None)
    vl.method_class.cache_clear()
    yield
    vl.method_class.cache_clear()


def test_without_verl_a_verl_method_is_one_error_line_with_the_install_command(without_verl, tmp_path, capsys):
    out = tmp_path / "run"
    for method in ("verl:gspo", "verl:gspo@tau_pos=2"):
        assert main(["run", "--tier", "smoke", "--tasks", "parallel-staleness", "--methods", f"baseline,{method}",
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("stabench: error: verl is not installed")
        assert 'pip install -e ".[verl]"' in err and not out.exists()
    needs_verl = tmp_path / "needs_verl.py"
    needs_verl.write_text("from verl.trainer.ppo.core_algos import register_policy_loss\n")
    assert main(["run", "--tier", "smoke", "--tasks", "parallel-staleness", "--stabilizer",
                 f"verl:{needs_verl}:my_loss", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'imports verl, which is not installed: pip install -e ".[verl]"' in err
    assert not out.exists()


# ---- where verl is installed (`pip install -e ".[verl]"`; never in CI) ----


@pytest.fixture(scope="module")
def verl_algos():
    return pytest.importorskip("verl.trainer.ppo.core_algos",
                               reason='verl is not installed (pip install -e ".[verl]"); CI installs only .[test]')


def test_every_loss_verl_registers_runs_a_smoke_sweep(verl_algos, tmp_path):
    names = sorted(verl_algos.POLICY_LOSS_REGISTRY)
    assert {"vanilla", "gspo", "cispo", "sapo", "clip_cov", "kl_cov"} <= set(names)
    methods = ["baseline", *(f"verl:{n}" for n in names)]
    tasks = ["inference-mismatch", "parallel-staleness", "rare-tool-states"]  # GRPO with a sampler, PPO, tool-PPO
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "stabench.suite.cli", "run", "--tier", "smoke", "--seeds", "1",
                           "--cpus", "2", "--no-tensorboard", "--tasks", ",".join(tasks), "--methods",
                           ",".join(methods), "--out", str(out)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = pd.read_csv(out / "trials.csv")
    assert len(trials) == len(tasks) * len(methods)
    assert (trials.status == "ok").all(), trials[trials.status != "ok"][["task", "method", "error"]]
    table = pd.read_parquet(out / "metrics.parquet")
    assert (table.groupby("task").method.unique().map(set) == set(methods)).all()


@pytest.mark.parametrize("aggregation", [*MODES, "step"])
def test_verls_vanilla_ppo_is_the_suites_policy_term_and_its_dual_clip(verl_algos, aggregation):
    batch = batch_of("token-mean" if aggregation == "step" else aggregation, step=aggregation == "step")
    loss, grad = loss_and_grad("verl:vanilla", batch)  # ratios within [0.4, 2.5]: the dual clip at 3 never binds
    expected = suite_term(batch)
    assert torch.allclose(loss, expected, rtol=1e-7)  # seq-mean-token-mean divides by |o_i| + 1e-8
    assert torch.allclose(grad, torch.autograd.grad(expected, batch["logp"])[0], rtol=1e-7, atol=1e-15)
    wide = batch_of("token-mean" if aggregation == "step" else aggregation, spread=1.5, step=aggregation == "step")
    wide["advantages"] = -wide["advantages"].abs()  # ratios past 3 on negative advantages: the dual clip binds
    assert (trainer_ratio(wide) > 3).any()
    loss, grad = loss_and_grad("verl:vanilla", wide)
    dual, dual_grad = loss_and_grad("dual-clip", wide)  # the suite's dual clip, c = 3
    assert torch.allclose(loss, dual, rtol=1e-7) and not torch.allclose(loss, suite_term(wide))
    assert torch.allclose(grad, dual_grad, rtol=1e-7, atol=1e-15)


@pytest.mark.parametrize(("builtin", "verl", "settings", "aggregation"), [
    ("gspo", "verl:gspo", {"clip_ratio_low": "eps_low", "clip_ratio_high": "eps_high"}, "token-mean"),
    ("cispo", "verl:cispo", {"clip_ratio_low": "eps_low", "clip_ratio_high": "eps_high"}, "token-mean"),
    ("sapo", "verl:sapo", {"tau_pos": "tau_pos", "tau_neg": "tau_neg"}, "seq-mean"),  # verl's sapo: seq-mean always
])
def test_verls_gspo_cispo_sapo_are_the_suites_builtins(verl_algos, builtin, verl, settings, aggregation):
    if builtin not in registry.discover("stabilizer"):
        pytest.skip(f"the suite has no built-in {builtin!r} yet (registry.discover('stabilizer'))")
    cls = registry.resolve_class("stabilizer", builtin)
    setting = ",".join(f"{ours}={registry.format_value(getattr(cls, theirs))}" for ours, theirs in settings.items())
    batch = batch_of(aggregation, spread=0.05 if builtin == "gspo" else 0.5)
    ours, our_grad = loss_and_grad(builtin, batch)
    theirs, their_grad = loss_and_grad(f"{verl}@{setting}", batch)
    assert torch.allclose(theirs, ours, rtol=1e-7), (float(theirs), float(ours))
    assert torch.allclose(their_grad, our_grad, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_rollout_correction_weights_are_verls_helpers(verl_algos, level):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    batch = batch_of()
    log_ratio, mask = 3 * (batch["old_logp"] - batch["behaviour_logp"]), batch["mask"]
    theirs, _ = compute_rollout_correction_weights(log_ratio, mask, rollout_is=level, rollout_is_threshold=2.0)
    assert torch.allclose(vl.rollout_is_weights(log_ratio, mask, level, 2.0), theirs)


def test_an_unknown_verl_loss_names_those_verl_registers_and_list_shows_them(verl_algos, capsys):
    with pytest.raises(StabenchError, match="unknown verl policy loss 'nope'; verl registers: .*verl:gspo"):
        registry.resolve_class("stabilizer", "verl:nope")
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(f"  verl:{name} " in out for name in verl_algos.POLICY_LOSS_REGISTRY)
