"""A sweep as a library call: what `stabench run` and `stabench.run` both do with their arguments.

The request is checked before Ray is imported, so a bad name or tier fails in a moment with one line.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from stabench.suite.api import CALIBRATED_TIERS, TIERS, StabenchError


def uncalibrated_warning(tier: str) -> str | None:
    """The one line a user meets on a tier whose scores are not calibrated claims (None: smoke or calibrated)."""
    if tier == "smoke" or tier in CALIBRATED_TIERS:
        return None
    return (f"stabench: warning: the {tier} tier is not calibrated for the redesigned tasks (results/calibration.md "
            f"covers {', '.join(CALIBRATED_TIERS)}): its scores are not the suite's claims, and `stabench submit` "
            "refuses them")


def run_sweep(tasks: Sequence[str] | None = None, *, tier: str = "quick", methods: Sequence[str] | None = None,
              family: Sequence[str] | None = None, seeds: int | None = None, seed_start: int = 0,
              stabilizers: Sequence[str] = (), detectors: Sequence[str] = (), out: str | Path | None = None,
              cpus: int | None = None, address: str | None = None, grid: str | None = None, matrix: bool = False,
              resume: bool = False, extend: bool = False, replace: Sequence[str] = (), wandb: str | None = None,
              tensorboard: bool = True) -> Path:
    """Run a sweep to the end and return its folder (the tidy table is `metrics.parquet` in it).

    `tasks` defaults to every non-experimental task (`family` keeps those of the named families); `methods` to
    each task's own methods and the two references; `matrix=True` runs every registered stabilizer instead.
    `stabilizers` and `detectors` are plugins added to the sweep (the default detectors always run). Names may be
    registered names or plugin references (`path/to/file.py:ClassName`). `out` defaults to
    `results/runs/<tier>-<time>`; `resume` continues the experiment in `out`, `extend` adds the named tasks it
    lacks, and `replace` (with `extend`) runs again kept tasks whose rows are stale (a new task version). `wandb`
    names a Weights & Biases project that Ray Tune's callback logs the trials' reports to (needs `wandb` installed
    and logged in); `tensorboard=False` skips the TensorBoard curves (`stabench tensorboard DIR`
    writes them later)."""
    if tier not in TIERS:
        raise StabenchError(f"unknown tier {tier!r}; choose from {', '.join(TIERS)}")
    if cpus is not None and cpus < 1:
        raise StabenchError(f"--cpus must be at least 1, got {cpus}")
    if resume and extend:
        raise StabenchError("--resume and --extend do not go together: finish the run, then extend it")
    if replace and not extend:
        raise StabenchError("--replace goes with --extend: it re-runs tasks of a finished experiment")
    from stabench.suite import registry, runner
    from stabench.suite import tune as tuning

    tuned: dict[str, dict] = {}

    def settle(refs: Sequence[str]) -> tuple[str, ...]:
        """`M@tuned` -> the setting its tuning record chose; the record goes in the manifest."""
        out = []
        for ref in refs:
            ref, record = tuning.resolve_tuned(ref)
            if record is not None:
                tuned[registry.method_name(ref)] = tuning.summary(record)
            out.append(ref)
        return tuple(out)

    methods = settle(methods) if methods else methods
    stabilizers = settle(stabilizers)
    callbacks = ()
    if wandb is not None:  # checked before anything runs; `wandb` is imported only when asked for and installed
        from stabench.suite.curves import wandb_callback

        callbacks = (wandb_callback(wandb),)

    default = (n for n in registry.names("task") if not registry.get_task(n).experimental)
    chosen = tuple(tasks) if tasks else tuple(default)
    if family:
        families = {n: registry.get_task(n).family for n in registry.names("task")}
        known = sorted(set(families.values()))
        unknown = sorted(set(family) - set(known))
        if unknown:
            raise StabenchError(f"unknown family {', '.join(unknown)}; known: {', '.join(known)}")
        chosen = tuple(n for n in chosen if registry.get_task(n).family in family)
        if not chosen:
            raise StabenchError(f"no requested task belongs to the family {', '.join(family)}")
    refs = registry.canonical
    spec = runner.ExperimentSpec(
        tier=tier,
        tasks=tuple(map(refs, chosen)),
        methods=tuple(map(refs, methods)) if methods else None,
        seeds=seeds,
        seed_start=seed_start,
        stabilizers=tuple(map(refs, stabilizers)),
        detectors=(*registry.DEFAULT_DETECTORS, *map(refs, detectors)),
        grid=grid,
        matrix=matrix,
    )
    stamp = f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    folder = Path(out) if out else Path("results/runs") / f"{tier}-{stamp}"
    if address:
        runner.check_address(address)
    exp = runner.prepare(folder, spec, resume, extend=extend, replace=tuple(replace))
    exp.tuning = {**exp.tuning, **tuned}  # a resumed or extended folder keeps the tuning records it holds
    seeds_run = {t.seed for t in exp.trials}
    for name, record in tuned.items():  # a setting is never scored on the seeds it was chosen on
        clash = sorted(seeds_run & set(record.get("tuning_seeds", ())))
        if clash:
            raise StabenchError(f"{name} was tuned on seeds {tuning.seed_text(clash)}, which this run scores on: "
                                "score it on other seeds (the leaderboard's: 0-9)")
    warning = uncalibrated_warning(tier)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    runner.execute(exp, address=address, num_cpus=cpus, resume=resume, callbacks=callbacks, tensorboard=tensorboard)
    return folder
