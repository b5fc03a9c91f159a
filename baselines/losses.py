"""The loss report every trainer returns in `TrainState.losses` (`suite.api.LOSS_SCHEMA`), computed one way.

`ratio_statistics` gives an update's `approx_kl`, `clip_frac`, `ratio_p99` and `ratio_max` from its ratios;
`LossReport` collects every update's values and reports their mean over the iteration's updates (`ratio_max`:
their largest), which is what the schema promises in every trainer.
"""

from __future__ import annotations

import math

import torch


def upper_quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """`torch.quantile(x, q)` (linear interpolation) of a 1-D tensor without NaN, bit for bit, from the
    top order statistics instead of a full sort: an order of magnitude cheaper for the p99 of a minibatch."""
    n = x.numel()
    rank = torch.tensor(q, dtype=x.dtype) * (n - 1)  # as torch.quantile: q in the input's dtype
    below = int(rank)
    top = torch.topk(x, n - below).values  # descending: top[-1] is the order statistic at `below`
    above = top[-2] if rank > below else top[-1]
    return top[-1].lerp(above, rank - below)


@torch.no_grad()
def ratio_statistics(
    ratio: torch.Tensor,
    logratio: torch.Tensor,
    clip_low: float | torch.Tensor,
    clip_high: float | torch.Tensor,
    mask: torch.Tensor | None = None,
) -> dict[str, float]:
    """One update's ratio statistics over its real actions (`mask`; None: every action is real)."""
    if mask is not None:
        real = mask.bool()
        ratio, logratio = ratio[real], logratio[real]
    if ratio.numel() == 0:
        return {"approx_kl": math.nan, "clip_frac": math.nan, "ratio_p99": math.nan, "ratio_max": math.nan}
    outside = (ratio - 1 > clip_high) | (1 - ratio > clip_low)
    return {
        "approx_kl": float(((ratio - 1) - logratio).mean()),  # Schulman's k3 of KL(anchor || pi_theta)
        "clip_frac": float(outside.float().mean()),
        "ratio_p99": float(upper_quantile(ratio.reshape(-1), 0.99)),
        "ratio_max": float(ratio.max()),
    }


class LossReport:
    """Per-update values summed in update order; `means()` is the iteration's `TrainState.losses`."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.updates = 0
        self.ratio_maxima: list[float] = []  # per update (NaN: an update without a real action)

    def add(self, values: dict[str, float]) -> None:
        """One update's values (floats); `ratio_max` is kept as a maximum, every other key summed."""
        self.updates += 1
        for key, value in values.items():
            if key == "ratio_max":
                self.ratio_maxima.append(value)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value

    def means(self, **once: float) -> dict[str, float]:
        """The mean over the updates of every summed key, the largest `ratio_max`, and the per-iteration values
        `once`; NaN where no update ran."""
        out = {key: (value / self.updates if self.updates else math.nan) for key, value in self.sums.items()}
        if self.ratio_maxima:
            out["ratio_max"] = max((r for r in self.ratio_maxima if not math.isnan(r)), default=math.nan)
        return {**out, **once}
