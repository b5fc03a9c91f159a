"""One trial, in this process: the healthy phase of one (task, method, seed) once, then both branches.

Kept apart from the runner so that a trial runs without Ray (a benchmark on another machine, a debugger);
the runner ships this function to Ray Tune's workers.
"""

from __future__ import annotations

import copy
import ctypes
import hashlib
import json
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd
from stabench.suite import __version__, detectors, registry
from stabench.suite.api import VARIANTS, Diverged

SUITE_VERSION = __version__


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TrialSpec:
    """One unit of work: the healthy phase of one seed and both of its branches."""

    task: str  # registered name or plugin reference
    method: str  # registered name or plugin reference
    seed: int
    tier: str
    detectors: tuple[str, ...] = registry.DEFAULT_DETECTORS
    knobs: tuple[tuple[str, Any], ...] = ()  # task constructor arguments (a cell of a grid)

    @property
    def key(self) -> str:
        return f"{self.task}|{self.method}|{self.seed}|{cell_name(self.knobs)}"


def cell_name(knobs: Any) -> str:
    """`epochs=4,lag=16,...`: the knobs of a grid cell as one sortable label ('' for the task's defaults)."""
    return ",".join(f"{k}={v}" for k, v in sorted(dict(knobs).items()))


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


BRANCH_SEED_OFFSET = 1_000_003  # both branches of a seed restart from the same RNG state (paired)

_ALLOCATOR_TUNED = False
KEEP_FREED_BYTES = 256 << 20  # glibc's mmap and trim thresholds while trials run


def keep_freed_memory() -> None:
    """Let glibc keep freed memory in the process instead of returning it to the system at once.

    By default glibc serves every allocation above 128 KiB (a held-out enumeration's activations, say) with a
    fresh `mmap` and unmaps it when freed, so every such tensor costs page faults on first touch: in the token
    tasks' exact evaluations that was about half the time of the elementwise operations. Raising the mmap and
    trim thresholds to `KEEP_FREED_BYTES` makes the heap reuse those blocks. Only where memory comes from: every
    number is the same. Once per process; a no-op off glibc."""
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED or not sys.platform.startswith("linux"):
        return
    _ALLOCATOR_TUNED = True
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters
        libc.mallopt(m_mmap_threshold, KEEP_FREED_BYTES)
        libc.mallopt(m_trim_threshold, KEEP_FREED_BYTES)
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        pass


def branch_at_onset(run: Any, stabilizer: Any) -> Any:
    """A complete copy of `run` at the onset iteration; the `frozen-at-onset` reference stops learning there.

    Only the built-in reference class is switched (stabilizers are never told the onset): it is found in
    the copy through the deep copy's memo, so the healthy run itself is never touched.
    """
    from stabench.suite.references import FrozenAtOnset

    memo: dict[int, Any] = {}
    branch = copy.deepcopy(run, memo)
    inner = getattr(stabilizer, "inner", stabilizer)
    if type(inner) is FrozenAtOnset:
        copied = memo.get(id(inner))
        if copied is None:
            raise RuntimeError("frozen-at-onset: the run does not hold its stabilizer, so it cannot be frozen")
        copied.frozen = True
    return branch


def run_trial(spec: TrialSpec, on_progress: Callable[[int, str, dict], None] | None = None) -> pd.DataFrame:
    """Run one trial in this process and return its tidy rows (both variants, shared rows repeated).

    A run that diverges (a trainer raises `Diverged`, or any hook or plugin raises) keeps its rows up to
    that point with status `diverged` and the error text; it never raises to the sweep.
    """
    import torch

    torch.set_num_threads(1)
    keep_freed_memory()
    task = registry.get_task(spec.task, **dict(spec.knobs))
    budget = task.budget(spec.tier)
    method = registry.method_name(spec.method)
    meta = {
        "task": task.id,
        "task_ref": spec.task,
        "task_version": task.version,
        "family": task.family,
        "method": method,
        "method_ref": spec.method,
        "role": task.role(method),
        "seed": spec.seed,
        "tier": spec.tier,
        "onset_iteration": budget.onset,
        "iterations": budget.iterations,
        "suite_version": SUITE_VERSION,
        "config_hash": digest([asdict(spec), task.version, SUITE_VERSION]),
        "cell": cell_name(spec.knobs),
        **{f"knob_{k}": v for k, v in spec.knobs},
    }

    def advance(run: Any, first: int, injected: bool, variant: str, rows: list[dict]) -> tuple[str, str]:
        last = budget.iterations if first >= budget.onset else budget.onset
        for it in range(first, last):
            try:
                row = run.step(injected)
            except Exception as exc:  # Diverged, or a hook or plugin that raised: a result, not a crash
                what = str(exc) if isinstance(exc, (Diverged, registry.PluginError)) else f"{type(exc).__name__}: {exc}"
                rows.append({"iteration": it, "diverged_at": it})  # marks where it stopped
                return "diverged", f"{stabilizer.name} at iteration {it}: {what}"
            row["iteration"] = it
            rows.append(row)
            if on_progress and (it + 1) % budget.report_every == 0:
                on_progress(it, variant, row)
        return "ok", ""

    seed_everything(spec.seed)
    stabilizer = registry.make_stabilizer(spec.method)
    shared: list[dict] = []
    try:
        run = task.build(spec.tier, spec.seed, stabilizer)
    except Exception as exc:
        shared.append({"iteration": 0, "diverged_at": 0})
        run, status, error = None, "diverged", f"{stabilizer.name} while building: {type(exc).__name__}: {exc}"
    else:
        status, error = advance(run, 0, False, "healthy", shared)

    frames = []
    for variant in VARIANTS:
        rows = [dict(r) for r in shared]
        v_status, v_error = status, error
        if status == "ok":
            branch = branch_at_onset(run, stabilizer)
            seed_everything(spec.seed + BRANCH_SEED_OFFSET)
            v_status, v_error = advance(branch, budget.onset, variant == "injected", variant, rows)
        frame = pd.DataFrame(rows)
        if "diverged_at" not in frame:
            frame["diverged_at"] = np.nan
        frame["diverged_at"] = frame["diverged_at"].max()
        key = detectors.run_key(task, cell_name(spec.knobs), spec.seed)
        for det_ref in spec.detectors:  # the same replay as `stabench score --detector` on stored rows
            name = registry.resolve_class("detector", det_ref).name
            frame[f"alarm/{name}"] = detectors.replay(det_ref, task, budget, frame, key)
        frame["variant"] = variant
        frame["status"] = v_status
        frame["error"] = v_error
        frames.append(frame)
    table = pd.concat(frames, ignore_index=True)
    table["phase"] = np.where(table["iteration"] < budget.onset, "healthy", "post-onset")
    for key, value in meta.items():
        table[key] = value
    return table
