"""Masked importance sampling (`token-mis`, `seq-mis`, `geo-mis`) on constructed batches: each reduces to the
trainer's clipped surrogate where the learner sampled, drops (zero loss, zero gradient) a token or an answer whose
ratio crosses its bound while one just inside keeps its weight, geo-mis keeps a long answer that seq-mis drops for
its length, and the weights are detached."""

from __future__ import annotations

import pytest
import torch
from stabench.baselines.stabilizers.clipping import policy_term, token_weighted_sum, trainer_ratio
from stabench.baselines.stabilizers.importance import GeometricMIS, SequenceMIS, SequenceTIS, TokenMIS, TokenTIS
from stabench.suite import registry
from stabench.suite import tune as tuning

pytestmark = pytest.mark.smoke

MIS = (TokenMIS, SequenceMIS, GeometricMIS)


def make_batch(ratios: list, adv: list, mask: list | None = None, step: float = 1.05) -> dict[str, torch.Tensor]:
    """A GRPO-like batch with pi_old / q = `ratios` per token ([answers, tokens], or [actions] for a step batch),
    the learner moved to pi_theta / pi_old = `step` on every token (inside the 0.2 clip: the term is -A r'),
    token_weight = mask / (number of masked tokens) (a token mean)."""
    ratio = torch.tensor(ratios)
    behaviour = torch.log(torch.full_like(ratio, 0.3))
    old = behaviour + torch.log(ratio)
    mask_t = torch.ones_like(ratio) if mask is None else torch.tensor(mask)
    adv_t = torch.tensor(adv).expand_as(ratio) if ratio.dim() > 1 else torch.tensor(adv)
    return {"logp": (old + torch.log(torch.tensor(step))).requires_grad_(True), "old_logp": old,
            "behaviour_logp": behaviour, "anchor_logp": old, "advantages": adv_t, "mask": mask_t,
            "token_weight": mask_t / mask_t.sum(), "clip_low": torch.tensor(0.2),
            "clip_high": torch.tensor(0.2)}  # fmt: skip


def policy(cls: type, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The method's policy term and its gradient w.r.t. logp."""
    batch["logp"].grad = None
    loss = cls().loss({"policy": torch.tensor(0.0)}, batch)["policy"]
    loss.backward()
    return loss.detach(), batch["logp"].grad.clone()


def baseline(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The trainer's own term: the clipped surrogate against the anchor, aggregated by token_weight."""
    per_action = policy_term(trainer_ratio(batch), batch["advantages"], batch["clip_low"], batch["clip_high"])
    return token_weighted_sum(per_action, batch)


@pytest.mark.parametrize("cls", MIS, ids=[c.name for c in MIS])
def test_where_the_learner_sampled_each_reduces_to_the_trainers_term(cls) -> None:
    for batch in (make_batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [[1.0], [-1.0]], [[1, 1, 1], [1, 1, 0]], 1.5),
                  make_batch([1.0, 1.0, 1.0], [1.0, -2.0, 0.5], step=0.7)):  # fmt: skip
        assert torch.equal(batch["behaviour_logp"], batch["old_logp"])
        assert (cls().weight(batch) == 1).all()  # exactly 1 (seq-mis: one per answer)
        loss, _ = policy(cls, batch)
        assert torch.equal(loss, baseline(batch).detach())  # bit for bit, the clipped side included


def test_token_mis_masks_a_token_past_the_cap_that_token_tis_keeps_at_it() -> None:
    batch = make_batch([2.01, 1.99, 1.0], [1.0, 1.0, 1.0])  # just outside C = 2, just inside, on-policy
    loss, grad = policy(TokenMIS, batch)
    assert float(loss) == pytest.approx((0 * 1.05 - 1.99 * 1.05 - 1.0 * 1.05) / 3, rel=1e-5)
    assert grad[0] == 0 and float(grad[1]) == pytest.approx(-1.99 * 1.05 / 3, rel=1e-5)  # d(-A w e^x / 3)/dx
    assert float(grad[2]) == pytest.approx(-1.05 / 3, rel=1e-5)
    tis, tis_grad = policy(TokenTIS, batch)
    assert float(tis) == pytest.approx((-2.0 - 1.99 - 1.0) * 1.05 / 3, rel=1e-5) and tis_grad[0] != 0


def test_seq_mis_masks_an_answer_whose_product_crosses_the_cap() -> None:
    # products 1.5 x 1.4 = 2.1 (dropped), 1.5 x 1.3 = 1.95 (kept: the padding's ratio 5 not counted), 1 (on-policy)
    batch = make_batch([[1.5, 1.4, 1.0], [1.5, 1.3, 5.0], [1.0, 1.0, 1.0]], [[1.0], [-1.0], [1.0]],
                       [[1, 1, 1], [1, 1, 0], [1, 1, 1]])  # fmt: skip
    loss, grad = policy(SequenceMIS, batch)
    assert float(loss) == pytest.approx((0 + 2 * 1.95 * 1.05 - 3 * 1.05) / 8, rel=1e-5)
    assert torch.equal(grad[0], torch.zeros(3)) and grad[1, 2] == 0  # the dropped answer; the padding
    assert grad[1, :2].tolist() == pytest.approx([1.95 * 1.05 / 8] * 2, rel=1e-5)
    assert grad[2].tolist() == pytest.approx([-1.05 / 8] * 3, rel=1e-5)
    tis, _ = policy(SequenceTIS, batch)  # seq-tis keeps the first answer at C = 2
    assert float(tis) == pytest.approx((-3 * 2.0 * 1.05 + 2 * 1.95 * 1.05 - 3 * 1.05) / 8, rel=1e-5)


def test_seq_mis_on_a_step_batch_is_token_mis() -> None:
    batch = make_batch([2.5, 1.9, 0.5, 1.0], [1.0, -2.0, 0.5, -1.0])
    assert torch.equal(SequenceMIS().weight(batch), TokenMIS().weight(batch))
    assert TokenMIS().weight(batch).tolist() == pytest.approx([0.0, 1.9, 0.5, 1.0], rel=1e-6)


def test_geo_mis_masks_an_answer_whose_geometric_mean_leaves_the_band_and_truncates_the_rest() -> None:
    # geometric means 1.3 (above 1.25: dropped), 1.24 (kept), 0.78 (below 1 / 1.25 = 0.8: dropped), 0.81 (kept),
    # sqrt(2.5 x 0.5) = 1.118 (kept, its tokens at min(2.5, 2) = 2 and 0.5)
    ratios = [[1.3, 1.3], [1.24, 1.24], [0.78, 0.78], [0.81, 0.81], [2.5, 0.5]]
    batch = make_batch(ratios, [[1.0]] * 5)
    want = [[0.0, 0.0], [1.24, 1.24], [0.0, 0.0], [0.81, 0.81], [2.0, 0.5]]
    assert GeometricMIS().weight(batch).tolist() == [pytest.approx(w, rel=1e-5) for w in want]
    loss, grad = policy(GeometricMIS, batch)
    assert float(loss) == pytest.approx(-1.05 * sum(map(sum, want)) / 10, rel=1e-5)
    assert torch.equal(grad[0], torch.zeros(2)) and torch.equal(grad[2], torch.zeros(2))
    assert grad[4].tolist() == pytest.approx([-2.0 * 1.05 / 10, -0.5 * 1.05 / 10], rel=1e-5)
    padded = make_batch([[1.24, 1.24, 3.0]], [[1.0]], [[1, 1, 0]])  # the padding's ratio is not in the mean
    assert GeometricMIS().weight(padded)[0, :2].tolist() == pytest.approx([1.24, 1.24], rel=1e-5)


def test_geo_mis_keeps_a_long_answer_that_seq_mis_drops_for_its_length() -> None:
    batch = make_batch([[1.1] * 10], [[1.0]])  # every token 1.1: product 1.1^10 = 2.59 > 2, geometric mean 1.1
    seq, seq_grad = policy(SequenceMIS, batch)
    assert float(seq) == 0 and torch.equal(seq_grad, torch.zeros(1, 10))
    geo, geo_grad = policy(GeometricMIS, batch)
    assert float(geo) == pytest.approx(-1.1 * 1.05, rel=1e-5)
    assert geo_grad[0].tolist() == pytest.approx([-1.1 * 1.05 / 10] * 10, rel=1e-5)


@pytest.mark.parametrize("cls", MIS, ids=[c.name for c in MIS])
def test_the_weights_are_detached(cls) -> None:
    batch = make_batch([[1.5, 0.9], [1.1, 1.2]], [[1.0], [-1.0]])
    old = batch["old_logp"].clone().requires_grad_(True)
    behaviour = batch["behaviour_logp"].clone().requires_grad_(True)
    batch.update(old_logp=old, behaviour_logp=behaviour)
    loss = cls().loss({"policy": torch.tensor(0.0)}, batch)["policy"]
    loss.backward()
    assert behaviour.grad is None  # q enters only through the weight
    assert torch.equal(old.grad, -batch["logp"].grad)  # pi_old only through r' = pi_theta / pi_old, not the weight
    assert batch["logp"].grad.abs().sum() > 0


def test_registered_with_a_search_space_around_their_defaults() -> None:
    for cls in MIS:
        assert registry.resolve_class("stabilizer", cls.name) is cls
        space = tuning.search_space(cls)
        assert set(space) == ({"max_weight", "geo_bound"} if cls is GeometricMIS else {"max_weight"})
        for key, domain in space.items():
            assert domain.lower < getattr(cls, key) < domain.upper
    assert (TokenMIS.max_weight, SequenceMIS.max_weight, GeometricMIS.geo_bound) == (2.0, 2.0, 1.25)
    assert registry.make_stabilizer("geo-mis@geo_bound=2").geo_bound == 2.0
