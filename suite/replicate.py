"""The re-runs of `stabench verify`: a run folder's own trials again (`--replicate`), or its leaderboard rows' methods
on fresh seeds (`--fresh K`). `verify` without them only recomputes rows from stored results (`suite.leaderboard`).

`--replicate`: the trials (all of them, or only the named tasks and seeds) run again through the runner the folder was
made with (its manifest's request: tier, methods and settings, knobs, detectors) in a temporary folder, removed after.
Then:
- on the same machine (`fingerprint.same_machine` of the folder's manifest `fingerprint` and this machine's) rows are
  bit-identical, so every numeric column of every re-run row must equal the folder's, NaN equal to NaN;
- on another machine (or a folder with no fingerprint) per task and method the mean normalized return after onset of
  the injected runs must stay within `tolerance` of the folder's on the same seeds, and no failure-rate verdict
  (`verdict`) may flip between `fails` and `holds`.
The tolerance rule (README, "Replicating a row"): max(FLOOR, Z * s * sqrt(2 / n)), with s the between-seed standard
deviation of the folder's normalized return on the task pooled within its methods (`pooled_spread`) and n the seeds
compared. Nothing in the folder or the leaderboard is written.

`--fresh K` (`plan_fresh`, `run_fresh`): the method of every stabilizer row made from the folder, and the baseline,
on K seeds drawn at verification time (`FRESH_SEEDS`, clear of every seed the suite scores, checks or tunes on); a
row agrees when its aggregate's interval overlaps the fresh one and no task's failure-rate verdict flips.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from stabench.suite import outcomes, registry, statistics
from stabench.suite.api import StabenchError
from stabench.suite.results import METRICS
from stabench.suite.trial import cell_name
from stabench.suite.tune import seed_text

Z = 3.0  # the difference of two n-seed means in units of its standard deviation: about 0.3% false mismatches
FLOOR = 0.05  # the smallest tolerance, in normalized return: a task whose seeds all agree asks for no bit-identity
ROW_KEYS = ["seed", "variant", "iteration"]  # a row of one (task, cell, method)


@dataclass(frozen=True)
class Check:
    """One (task, method) compared: `ok`, and its line (`TASK METHOD: ok: ...` or `TASK METHOD: mismatch: ...`)."""

    task: str
    method: str
    ok: bool
    line: str


@dataclass
class Replication:
    """A planned replication: what to re-run, and what to compare it with."""

    directory: Path
    spec: Any  # runner.ExperimentSpec: the folder's request, narrowed to the chosen tasks and seeds
    trials: list  # the runner's TrialSpecs to re-run (real runs only)
    identities: list  # (task, cell, method): the copies of the baseline's runs the folder holds
    folder: pd.DataFrame  # the folder's rows of the chosen tasks, every seed and method (for the spread)
    chosen: pd.DataFrame  # the folder's rows that the re-run reproduces
    seeds: tuple[int, ...]
    exact: bool  # the same machine: rows compared exactly
    folder_machine: dict | None
    this_machine: dict
    notes: tuple[str, ...] = ()


def parse_seeds(text: str) -> tuple[int, ...]:
    """`0-2` -> (0, 1, 2); `0,3,7` -> (0, 3, 7); runs and single seeds mix (`0-2,5`). Anything else: an error."""
    bad = StabenchError(f"--seeds {text!r} is not a list of seeds like 0-2 or 0,3,7")
    seeds: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.strip().isdigit() or (dash and not last.strip().isdigit()):
            raise bad
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise bad
        seeds.update(range(low, high + 1))
    return tuple(sorted(seeds))


def tolerance(spread: float, n: int) -> float:
    """The declared rule: max(FLOOR, Z * s * sqrt(2 / n)) for n seeds compared and a between-seed spread s."""
    return max(FLOOR, Z * spread * math.sqrt(2 / n)) if n >= 1 else math.inf


def verdict(rate: float) -> str:
    """A task's failure-rate verdict, the calibration bar's: `fails` (at least 80% of runs), `holds` (at most 20%),
    else `mixed`. Only opposite verdicts contradict each other: a few fresh seeds cannot place a rate finer."""
    return "fails" if rate >= 0.8 else "holds" if rate <= 0.2 else "mixed"


def pooled_spread(runs: pd.DataFrame) -> dict[str, float]:
    """Per task: the between-seed standard deviation of the injected runs' normalized return, pooled within the task's
    methods (s^2 = sum (n_m - 1) s_m^2 / sum (n_m - 1)); copies of the baseline's runs (`acts` False) are not counted
    again, a method with one seed adds nothing, and a task with no method of two seeds gets 0 (the rule's floor)."""
    injected = runs[runs["variant"] == "injected"]
    if "acts" in injected:
        injected = injected[injected["acts"].astype(bool)]
    out: dict[str, float] = {}
    for task, group in injected.groupby("task", sort=True):
        total = weight = 0.0
        for _, own in group.groupby("method"):
            values = own["normalized_return"].to_numpy(dtype=float)
            values = values[np.isfinite(values)]
            if len(values) >= 2:
                total += (len(values) - 1) * float(np.var(values, ddof=1))
                weight += len(values) - 1
        out[str(task)] = math.sqrt(total / weight) if weight else 0.0
    return out


def _label(task: str, cell: str) -> str:
    return f"{task} [{cell}]" if cell else task  # as `outcomes.outcomes` names a grid cell's runs


def _cells(table: pd.DataFrame) -> pd.DataFrame:
    return table.assign(cell=table["cell"].fillna("") if "cell" in table else "")


def _value(value: float) -> str:
    return repr(float(value))


def first_differences(folder: pd.DataFrame, rerun: pd.DataFrame) -> dict[tuple[str, str], str]:
    """Per (task, method) of `folder`, the first difference from `rerun` (rows in the order seed, variant, iteration;
    columns in the folder's order): a row one side lacks, or a numeric column whose values differ (NaN equals NaN)."""
    folder, rerun = _cells(folder), _cells(rerun)
    columns = [c for c in folder.columns
               if c not in ROW_KEYS and pd.api.types.is_numeric_dtype(folder[c])]
    out: dict[tuple[str, str], str] = {}
    for (task, cell, method), mine in folder.groupby(["task", "cell", "method"], sort=True):
        key = (_label(str(task), str(cell)), str(method))
        again = rerun[(rerun["task"] == task) & (rerun["cell"] == cell) & (rerun["method"] == method)]
        mine = mine.set_index(ROW_KEYS).sort_index()
        again = again.set_index(ROW_KEYS).sort_index()
        lacking, extra = mine.index.difference(again.index), again.index.difference(mine.index)
        if len(lacking) or len(extra):
            side = min([(k, "a row of DIR the re-run lacks") for k in lacking]
                       + [(k, "a re-run row DIR lacks") for k in extra])
            seed, variant, iteration = side[0]
            out[key] = f"seed {seed} {variant} iteration {iteration}: {side[1]}"
            continue
        missing = [c for c in columns if c not in again.columns]
        if missing:
            out[key] = f"column {missing[0]} is missing from the re-run rows"
            continue
        first = None
        for column in columns:
            a = mine[column].to_numpy(dtype=float, na_value=np.nan)
            b = again[column].to_numpy(dtype=float, na_value=np.nan)
            differ = ~((a == b) | (np.isnan(a) & np.isnan(b)))
            if differ.any():
                at = int(np.argmax(differ))
                if first is None or at < first[0]:
                    first = (at, column, a[at], b[at], int(differ.sum()))
        if first is not None:
            at, column, a, b, count = first
            seed, variant, iteration = mine.index[at]
            out[key] = (f"seed {seed} {variant} iteration {iteration}: {column} is {_value(a)} in DIR, {_value(b)} "
                        f"re-run ({count} differing value{'s' if count != 1 else ''} in that column)")
    return out


def compare_runs(folder: pd.DataFrame, rerun: pd.DataFrame, spread_runs: pd.DataFrame | None = None,
                 exact: bool = False, differences: dict[tuple[str, str], str] | None = None) -> list[Check]:
    """Compare per-run outcomes (`outcomes.outcomes`: task, method, seed, variant, acts, failed, normalized_return) of
    the folder's runs that were re-run (`folder`) with the re-run's, per (task, method) of real runs (a method's
    copies of the baseline's runs are the baseline's check). `spread_runs`: the runs the spread is estimated from (the
    folder's every seed; default `folder`). `exact`: the verdict is `differences` (`first_differences`), the means
    shown beside it; else the tolerance rule and the failure-rate verdicts."""
    spread = pooled_spread(folder if spread_runs is None else spread_runs)
    mine = folder[folder["variant"] == "injected"]
    again = rerun[rerun["variant"] == "injected"]
    if "acts" in mine:
        mine = mine[mine["acts"].astype(bool)]
    checks = []
    for (task, method), before in mine.groupby(["task", "method"], sort=True):
        after = again[(again["task"] == task) & (again["method"] == method)]
        head = f"{task} {method}: "
        seeds, rerun_seeds = sorted(before["seed"].unique()), sorted(after["seed"].unique())
        if seeds != rerun_seeds:
            checks.append(Check(task, method, False, head + f"mismatch: DIR holds seeds {seed_text(seeds)}, the "
                                f"re-run {seed_text(rerun_seeds) or 'none'} (a trial that did not finish: see above)"))
            continue
        n = len(seeds)
        old, new = (float(np.nanmean(g["normalized_return"].to_numpy(dtype=float)))
                    if np.isfinite(g["normalized_return"].to_numpy(dtype=float)).any() else math.nan
                    for g in (before, after))
        told, found = verdict(float(before["failed"].mean())), verdict(float(after["failed"].mean()))
        verdicts = f"verdict {told} in DIR, {found} re-run"
        if exact:
            problem = (differences or {}).get((task, method))
            if problem:
                checks.append(Check(task, method, False, head + f"mismatch: {problem}; normalized return {old:.4f} "
                                    f"in DIR, {new:.4f} re-run; {verdicts}"))
            else:
                checks.append(Check(task, method, True, head + f"ok: rows identical on seeds {seed_text(seeds)}; "
                                    f"normalized return {old:.4f}; {verdicts}"))
            continue
        tol = tolerance(spread.get(task, 0.0), n)
        both_missing = math.isnan(old) and math.isnan(new)
        moved = 0.0 if both_missing else abs(new - old)  # NaN when one side has no return: a mismatch
        numbers = (f"normalized return {old:.4f} in DIR, {new:.4f} re-run (difference {new - old:+.4f}, tolerance "
                   f"{tol:.4f} = max({FLOOR}, {Z:g} x s {spread.get(task, 0.0):.4f} x sqrt(2/{n}))); {verdicts}")
        reasons = []
        if not moved <= tol:
            reasons.append("the mean moved by more than the tolerance")
        if {told, found} == {"fails", "holds"}:
            reasons.append("the failure-rate verdict flips")
        if reasons:
            checks.append(Check(task, method, False, head + f"mismatch: {' and '.join(reasons)}: {numbers}"))
        else:
            checks.append(Check(task, method, True, head + f"ok: {numbers}"))
    return checks


def compare(rep: Replication, rerun: pd.DataFrame) -> list[Check]:
    """The checks of a replication, given the re-run's table."""
    folder_runs = outcomes.outcomes(rep.chosen)
    spread_runs = outcomes.outcomes(rep.folder)
    differences = first_differences(rep.chosen, rerun) if rep.exact else None
    return compare_runs(folder_runs, outcomes.outcomes(rerun), spread_runs, rep.exact, differences)


def _task_ids(table: pd.DataFrame, names: tuple[str, ...] | None, directory: Path) -> list[str]:
    """The ids of the chosen tasks (every task the folder holds, in its order, by default); an unknown task or one
    the folder does not hold is an error."""
    held = list(dict.fromkeys(table["task"]))
    if not names:
        return held
    refs = dict(zip(table["task_ref"], table["task"])) if "task_ref" in table else {}
    chosen = []
    for name in names:
        task = name if name in held else refs.get(name) or refs.get(registry.canonical(name))
        if task is None:
            try:
                registry.resolve_class("task", registry.canonical(name))
            except StabenchError:
                raise StabenchError(f"unknown task {name!r}; {directory} holds {', '.join(held)}") from None
            raise StabenchError(f"{directory} does not hold task {name!r}; it holds {', '.join(held)}")
        chosen.append(task)
    return list(dict.fromkeys(chosen))


def plan(directory: Path, tasks: tuple[str, ...] | None = None, seeds: str | tuple[int, ...] | None = None,
         methods: tuple[str, ...] | None = None) -> Replication:
    """Check a replication request and plan it; runs and writes nothing. `seeds`: a SPEC (`0-2`, `0,3,7`) or seeds;
    `methods` (a library choice): only these methods' runs (names as in the folder; the baseline is re-run for the
    copies of its runs only when it is chosen)."""
    from stabench.suite import runner  # first: it sets the environment Ray reads when it is imported
    from stabench.suite.fingerprint import machine_fingerprint, same_machine
    from stabench.suite.leaderboard import load_run

    table, manifest, _ = load_run(directory)
    if "baseline" not in set(table["method"]):
        raise StabenchError(f"{directory} has no baseline runs: it is not a run of the suite's grid to replicate")
    request = manifest.get("spec")
    if not isinstance(request, dict) or "tier" not in request or "tasks" not in request:
        raise StabenchError(f"{directory} is not a finished run: its {runner.MANIFEST} holds no request")
    ids = _task_ids(table, tasks, directory)
    table = _cells(table)
    folder = table[table["task"].isin(ids)]
    outcomes.check_versions(folder)  # rows of another task version: today's task would not reproduce them
    wanted = parse_seeds(seeds) if isinstance(seeds, str) else tuple(sorted(set(seeds))) if seeds else None
    for task in ids:
        held = {int(s) for s in folder.loc[folder["task"] == task, "seed"].unique()}
        lacking = sorted(set(wanted or ()) - held)
        if lacking:
            raise StabenchError(f"{directory} does not hold seed{'s' if len(lacking) > 1 else ''} "
                                f"{seed_text(lacking)} of task {task} (it holds {seed_text(held)})")
    chosen = folder if wanted is None else folder[folder["seed"].isin(wanted)]
    if methods:
        unknown = sorted(set(methods) - set(chosen["method"]))
        if unknown:
            raise StabenchError(f"{directory} holds no runs of {', '.join(unknown)} on the chosen tasks")
        chosen = chosen[chosen["method"].isin(methods)]
    seeds_used = tuple(sorted(int(s) for s in chosen["seed"].unique()))
    ref = chosen["method_ref"] if "method_ref" in chosen else chosen["method"]
    acts = chosen["acts"].astype(bool) if "acts" in chosen else pd.Series(True, index=chosen.index)
    runs = set(zip(chosen["task_ref"], chosen["cell"], ref, chosen["seed"].astype(int), acts))
    real = {(t, c, m, s) for t, c, m, s, a in runs if a}
    copies = {(t, c, m) for t, c, m, _, a in runs if not a}

    known = {f.name for f in fields(runner.ExperimentSpec)}
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in request.items() if k in known}
    args.update(tasks=tuple(dict.fromkeys(chosen["task_ref"])), seed_start=seeds_used[0],
                seeds=seeds_used[-1] - seeds_used[0] + 1)
    spec = runner.ExperimentSpec(**args)
    planned, identities = spec.plan()  # every task, method and detector still resolves, before anything runs
    trials = [t for t in planned if (t.task, cell_name(t.knobs), t.method, t.seed) in real]
    found = {(t.task, cell_name(t.knobs), t.method, t.seed) for t in trials}
    gone = sorted(real - found) + sorted(copies - set(identities))
    if gone:
        first = " ".join(str(x) for x in gone[0] if x != "")
        raise StabenchError(f"the runner no longer plans {len(gone)} of the runs {directory} holds (first: {first}): "
                            "the code changed since it was made, so it cannot be replicated")
    here = machine_fingerprint()
    theirs = manifest.get("fingerprint") if isinstance(manifest.get("fingerprint"), dict) else None
    notes = []
    if manifest.get("suite_version") != runner.SUITE_VERSION:
        notes.append(f"{directory} was made by suite version {manifest.get('suite_version')}, this is "
                     f"{runner.SUITE_VERSION}")
    if manifest.get("libraries") and manifest["libraries"] != runner.library_versions():
        differ = sorted(k for k, v in runner.library_versions().items() if manifest["libraries"].get(k) != v)
        notes.append(f"{directory} was made with other versions of {', '.join(differ)}")
    if not trials:
        raise StabenchError(f"nothing to re-run: the chosen runs of {directory} are copies of the baseline's (choose "
                            "the baseline)")
    based = {(t.task, cell_name(t.knobs)) for t in trials if t.method == "baseline"}  # copies need its rows
    return Replication(directory, spec, trials, [i for i in identities if i in copies and i[:2] in based], folder,
                       chosen, seeds_used, same_machine(theirs, here), theirs, here, tuple(notes))


def run(rep: Replication, address: str | None = None, cpus: int | None = None) -> pd.DataFrame:
    """Re-run the planned trials through the runner in a scratch folder (removed after); the re-run's table."""
    from stabench.suite import runner

    scratch = Path(tempfile.mkdtemp(prefix="stabench-replicate-"))
    try:
        exp = runner.prepare(scratch / "run", rep.spec, resume=False)
        exp.trials, exp.identities = list(rep.trials), list(rep.identities)
        runner.execute(exp, address=address, num_cpus=cpus, tensorboard=False)
        return pd.read_parquet(scratch / "run" / METRICS)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def summary(rep: Replication, checks: list[Check]) -> str:
    """The last line: how many checks passed, on which machine, and how they were judged."""
    from stabench.suite.fingerprint import describe, differing

    ok = sum(c.ok for c in checks)
    differ = ", ".join(differing(rep.folder_machine, rep.this_machine))
    where = f"{describe(rep.folder_machine)}, differing in {differ}" if rep.folder_machine else "not recorded"
    how = ("the same machine as DIR's: rows compared exactly" if rep.exact else
           f"another machine than DIR's ({where}): judged by normalized return within max({FLOOR}, {Z:g} s sqrt(2/n)) "
           "and no verdict flip")
    return (f"replicate {rep.directory}: {ok} of {len(checks)} task-method checks ok, {len(rep.trials)} trials re-run "
            f"on seeds {seed_text(rep.seeds)} on {describe(rep.this_machine)}, {how}")


# `verify --fresh K` draws K consecutive seeds from here, clear of every seed the suite scores, checks or tunes on.
FRESH_SEEDS = range(10_000, 1_000_000)


@dataclass(frozen=True)
class FreshCheck:
    """A planned `verify --fresh`: the rows of one run folder, and the sweep that re-runs them on fresh seeds."""

    directory: Path
    rows: tuple[dict, ...]
    seeds: str
    spec: Any  # runner.ExperimentSpec


def plan_fresh(path: Path, directory: Path, k: int, seed_start: int | None = None) -> FreshCheck:
    """Check a `verify --fresh` request and draw its seeds (`seed_start` repeats a draw); runs nothing.

    Re-run: the method of every stabilizer row made from `directory`, and the baseline, on the run's tasks and tier,
    on `k` consecutive seeds clear of every seed the run was made on, the scoring and fresh-check seeds and the
    rows' tuning seeds."""
    from stabench.suite import runner  # first: it sets the environment Ray reads when it is imported
    from stabench.suite.leaderboard import load_run, read, results_digest
    from stabench.suite.tune import RESERVED_SEEDS

    if k < 1:
        raise StabenchError(f"--fresh must be at least 1 seed, got {k}")
    rows = read(path)
    table, manifest, _ = load_run(directory)
    digest = results_digest(table)
    mine = tuple(r for r in rows if r["results_digest"] == digest and r["track"] == "stabilizer")
    if not mine:
        raise StabenchError(f"no stabilizer row of {path} was computed from {directory}: nothing to check afresh")
    avoid = {int(s) for s in table["seed"].unique()} | {s for r in RESERVED_SEEDS.values() for s in r}
    for r in mine:
        avoid |= set(json.loads(r.get("tuning") or "{}").get("tuning_seeds", ()))
    if seed_start is None:
        import random

        draw = random.SystemRandom()
        seed_start = next(s for s in iter(lambda: draw.randrange(FRESH_SEEDS.start, FRESH_SEEDS.stop - k), None)
                          if not avoid & set(range(s, s + k)))
    elif seed_start < 0 or avoid & set(range(seed_start, seed_start + k)):
        raise StabenchError(f"--seed-start {seed_start}: the fresh seeds must be at least 0 and clear of the seeds the "
                            "run was made, scored or tuned on")
    plain = table[table["cell"].fillna("") == ""] if "cell" in table else table
    refs = [str(plain.loc[plain["method"] == r["name"], "method_ref"].iloc[0]) for r in mine]
    spec = runner.ExperimentSpec(tier=manifest["spec"]["tier"], tasks=tuple(dict.fromkeys(plain["task_ref"])),
                                 methods=tuple(dict.fromkeys(["baseline", *refs])), seeds=k, seed_start=seed_start,
                                 detectors=())
    spec.trials()  # every method and task still resolves, before anything runs
    return FreshCheck(directory, mine, seed_text(range(seed_start, seed_start + k)), spec)


def run_fresh(check: FreshCheck, address: str | None = None, cpus: int | None = None) -> tuple[list[str], list[str]]:
    """Run a planned fresh check in a scratch folder (removed after) and compare; returns the lines of the rows that
    agree and of those that do not.

    A row agrees when, on the fresh seeds, the 95% interval of its aggregate overlaps the submitted one and no task's
    failure-rate verdict (`verdict`) flips between `fails` and `holds`. Lenient on purpose: the fresh seeds are few,
    and normalized return is anchored on floors fixed on seeds 0-9. With one seed per task on either side an interval
    has no width, so only the verdicts are judged then. The leaderboard is only read."""
    from stabench.suite import runner
    from stabench.suite.leaderboard import _fmt

    scratch = Path(tempfile.mkdtemp(prefix="stabench-fresh-"))
    try:
        exp = runner.prepare(scratch / "run", check.spec, resume=False)
        names = ", ".join(dict.fromkeys(["baseline", *(r["name"] for r in check.rows)]))
        print(f"stabench: fresh seeds {check.seeds} for {names}", file=sys.stderr, flush=True)
        runner.execute(exp, address=address, num_cpus=cpus, tensorboard=False)
        fresh = pd.read_parquet(scratch / "run" / METRICS)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    per_run = outcomes.outcomes(fresh)
    aggregate = {a["method"]: a for a in statistics.across_tasks(per_run)}
    rates = {(t["task"], t["method"]): t["failure_rate"] for t in statistics.stabilizer_track(fresh, per_run)}
    agree, problems = [], []
    for row in check.rows:
        name, again = row["name"], aggregate[row["name"]]
        low, high = float(row["ci_low"]), float(row["ci_high"])
        told = f"{float(row['aggregate']):.3g} [{low:.3g}, {high:.3g}]"
        found = f"{again['iqm']:.3g} [{again['ci_low']:.3g}, {again['ci_high']:.3g}]"
        reasons = []
        fresh_low, fresh_high = float(_fmt(again["ci_low"])), float(_fmt(again["ci_high"]))  # as a row holds them
        judged = int(row["n_seeds"]) >= 2 and check.spec.seeds >= 2  # one seed per task: an interval of no width
        if judged and not (fresh_low <= high and low <= fresh_high):
            reasons.append(f"aggregate {found} on fresh seeds {check.seeds}, outside the submitted {told}")
        failures = json.loads(row.get("failures") or "{}")
        flipped = []
        for task, (failed, n) in sorted(failures.items()):
            before, now = verdict(failed / n), verdict(rates.get((task, name), math.nan))
            if {before, now} == {"fails", "holds"}:
                flipped.append(f"{task} {before} in the row, {now} afresh")
        if flipped:
            reasons.append("failure-rate verdicts flip: " + ", ".join(flipped))
        checked = (f"{len(failures)} tasks' failure-rate verdicts agree" if failures
                   else "no failure counts in the row (made before they were recorded)")
        if reasons:
            problems.append(f"stabilizer {name}: " + "; ".join(reasons))
        else:
            compared = (f"overlaps the submitted {told}" if judged else
                        f"beside the submitted {told}, not judged (one seed per task on a side: an interval of no "
                        "width)")
            agree.append(f"stabilizer {name}: aggregate {found} on fresh seeds {check.seeds} {compared}; " + checked)
    return agree, problems


def command(args: argparse.Namespace) -> int:
    """`stabench verify DIR --replicate [--tasks a,b] [--seeds SPEC]`: every input checked before anything runs."""
    if not args.replicate:
        raise StabenchError("--tasks and --seeds choose what --replicate re-runs: add --replicate")
    if args.fresh is not None or args.seed_start is not None:
        raise StabenchError("--replicate re-runs the folder's own seeds; --fresh draws new ones: use one of them")
    if args.detector:
        raise StabenchError("--detector recomputes leaderboard rows; --replicate re-runs the folder's trials as made")
    if len(args.dirs) != 1:
        raise StabenchError(f"--replicate re-runs one run folder: name one (stabench verify DIR --replicate), got "
                            f"{len(args.dirs)}")
    if args.cpus is not None and args.cpus < 1:
        raise StabenchError(f"--cpus must be at least 1, got {args.cpus}")
    rep = plan(Path(args.dirs[0]), args.tasks, args.seeds)
    if args.address:
        from stabench.suite import runner

        runner.check_address(args.address)
    for note in rep.notes:
        print(f"note: {note}", file=sys.stderr)
    how = "the same machine: rows compared exactly" if rep.exact else "another machine: within the tolerance"
    print(f"stabench: replicating {len(rep.trials)} trials of {rep.directory} (tasks "
          f"{', '.join(dict.fromkeys(rep.chosen['task']))}; seeds {seed_text(rep.seeds)}) on {how}",
          file=sys.stderr, flush=True)
    checks = compare(rep, run(rep, args.address, args.cpus))
    for check in checks:
        print(check.line)
    print(summary(rep, checks))
    return 0 if checks and all(c.ok for c in checks) else 1

