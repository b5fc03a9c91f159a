"""The leaderboard: `results/leaderboard.csv`, one verifiable row per submission.

A row names its track (`stabilizer` or `detector`), the method or detector and its version, the tier,
the suite and library versions, the git commit of the suite, the date, the number of seeds, the per-task
scores, and the aggregate with its 95% interval:
- stabilizer track: per task the mean normalized return after onset; aggregate the interquartile mean
  over all (task, seed) runs with a stratified bootstrap interval, and the probability of improvement over
  the baseline with its interval (`suite.scoring.across_tasks`). Methods are ranked only on the common task set
  (every task the baseline ran on): where a method does not change a task's trainer its runs are the
  baseline's (`acts_on` lists the tasks where it really acts); a method that lacks runs on some of the set
  is shown unranked, since its aggregate would compare tasks rather than methods;
- detector track: per task the detector skill score (`suite.scoring`: 100 oracle, about 0 for any
  detector blind to the outcome, unclipped); aggregate the mean over tasks, with a stratified bootstrap
  interval that resamples seeds within each (task, method). Detector rows are computed on the committed
  method matrix (`results/matrix`: every stabilizer on every default task, 10 seeds), so every detector is
  compared on the very same runs, the most the suite has: a detector that run did not record is replayed over
  its stored rows (`stabench submit results/matrix --detector FILE.py:Class`, and `stabench verify
  results/matrix --detector FILE.py:Class` to recompute). Only the rows the track scores are replayed
  (`scoring.detector_rows`: not the references' runs, not a method's copies of the baseline's).
`results_digest` is a digest of the raw table the row was computed from, and `row_digest` a digest of
the row's own fields: a row edited by hand no longer matches it. `stabench verify DIR` recomputes every
row whose `results_digest` matches DIR's table and reports any difference; a folder no row was computed from
has nothing to disagree with and is named in a note, not counted as a mismatch.

Every check runs before anything is written; the append happens under a file lock and replaces the file
atomically, so a refused submission leaves `leaderboard.csv` byte-identical and concurrent submissions
all land.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
from filelock import FileLock
from stabench.suite import registry, scoring
from stabench.suite.api import CALIBRATED_TIERS, StabenchError
from stabench.suite.results import MANIFEST, METRICS, TRIALS

COLUMNS = [
    "track", "name", "version", "tier", "suite_version", "libraries", "git_commit", "date", "n_seeds",
    "per_task", "control_per_task", "aggregate", "ci_low", "ci_high", "ranked", "acts_on", "poi", "poi_ci_low",
    "poi_ci_high", "results_digest", "row_digest",
]
SCORE_FIELDS = ("per_task", "control_per_task", "aggregate", "ci_low", "ci_high", "n_seeds", "ranked", "acts_on",
                "poi", "poi_ci_low", "poi_ci_high")
DEFAULT_PATH = Path("results/leaderboard.csv")


def results_digest(table: pd.DataFrame) -> str:
    """A digest of the table's content (row order and column order fixed), independent of file bytes."""
    ordered = table[sorted(table.columns)].sort_values(["task", "method", "seed", "variant", "iteration"])
    hashed = pd.util.hash_pandas_object(ordered.reset_index(drop=True), index=False).to_numpy()
    header = json.dumps(sorted(table.columns)).encode()
    return hashlib.sha256(header + hashed.tobytes()).hexdigest()


def row_digest(row: dict) -> str:
    body = json.dumps({k: str(row[k]) for k in COLUMNS if k != "row_digest"}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def _fmt(value: float) -> str:
    return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.6f}"


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def load_run(directory: Path) -> tuple[pd.DataFrame, dict, pd.DataFrame]:
    """The table, manifest and trial list of a finished run folder, or one clear error."""
    paths = [directory / METRICS, directory / MANIFEST, directory / TRIALS]
    for path in paths:
        if not path.is_file():
            raise StabenchError(f"{directory} is not a finished run: {path.name} is missing")
    try:
        return pd.read_parquet(paths[0]), json.loads(paths[1].read_text()), pd.read_csv(paths[2])
    except Exception as exc:
        raise StabenchError(f"cannot read the run in {directory}: {exc}") from exc


def validate_run(table: pd.DataFrame, manifest: dict, trials: pd.DataFrame) -> None:
    """Refuse a run that is not a complete, current, honestly recorded grid of a calibrated tier (or of smoke, the
    tier that checks the walk-through: its rows say `smoke`)."""
    from stabench.suite.runner import SUITE_VERSION

    tier = manifest.get("spec", {}).get("tier")
    if tier != "smoke" and tier not in CALIBRATED_TIERS:
        raise StabenchError(
            f"the {tier} tier is not calibrated for the redesigned tasks (calibrated: {', '.join(CALIBRATED_TIERS)}): "
            "its scores cannot join the leaderboard"
        )
    if manifest.get("suite_version") != SUITE_VERSION or set(table["suite_version"]) != {SUITE_VERSION}:
        raise StabenchError(
            f"the run was made by suite version {manifest.get('suite_version')}, this is {SUITE_VERSION}: rerun it"
        )
    bad = trials[~trials["status"].isin(["ok", "diverged", "identity"])]  # identity: the baseline's runs
    if len(bad):
        first = bad.iloc[0]
        raise StabenchError(
            f"incomplete run: {len(bad)} trials did not finish (first: {first['task']} {first['method']} "
            f"seed {first['seed']}: {first['status']})"
        )
    expected_tasks = {registry.get_task(n).id for n in registry.names("task") if not registry.get_task(n).experimental}
    missing = expected_tasks - set(table["task"])
    if missing:
        raise StabenchError(f"incomplete grid for tier {tier}: tasks {', '.join(sorted(missing))} are missing")
    for (task_id, method), g in table.groupby(["task", "method"]):
        task = registry.get_task(g["task_ref"].iloc[0])
        budget = task.budget(tier)
        seeds = g["seed"].nunique()
        if seeds < budget.seeds:
            raise StabenchError(
                f"{task_id} {method}: {seeds} seeds, the {tier} tier needs at least {budget.seeds}"
            )
        for (seed, variant), run in g.groupby(["seed", "variant"]):
            diverged = (run["status"] == "diverged").any()
            if not diverged and sorted(run["iteration"]) != list(range(budget.iterations)):
                raise StabenchError(f"{task_id} {method} seed {seed} {variant}: iterations are missing")
        if set(g["variant"]) != {"injected", "control"}:
            raise StabenchError(f"{task_id} {method}: both the injected and the control variant are needed")
    if trials.duplicated(["task", "method", "seed"]).any():
        raise StabenchError("the run's trial list has duplicates")
    recorded = {(r.task_ref, r.seed) for r in table[["task_ref", "seed"]].drop_duplicates().itertuples()}
    listed = {(t.task, t.seed) for t in trials.itertuples()}
    if listed - recorded:
        raise StabenchError(f"trials missing from the table (a run was dropped): {sorted(listed - recorded)[:3]}")


def compute_rows(table: pd.DataFrame, manifest: dict, methods: list[str] | None = None,
                 detectors: list[str] | None = None) -> list[dict]:
    """The leaderboard rows for the chosen methods and detectors of one run (all of them by default)."""
    tier = manifest["spec"]["tier"]
    per_run = scoring.outcomes(table)
    all_methods = sorted(table["method"].unique())
    recorded = {c.split("/", 1)[1] for c in table.columns if c.startswith("alarm/")}
    all_detectors = sorted(recorded | set(registry.SCORED_DETECTORS))
    if methods is None and detectors is None:
        methods, detectors = all_methods, all_detectors
    for m in methods or []:
        if m not in all_methods:
            raise StabenchError(f"method {m!r} is not in this run (it has {', '.join(all_methods)})")
    names, versions, replays = [], {}, []
    for d in detectors or []:
        name, version = d, "1"
        if d not in all_detectors or d in registry.BUILTIN_DETECTORS:
            try:
                cls = registry.resolve_class("detector", registry.canonical(d))
            except StabenchError as exc:
                raise StabenchError(f"detector {d!r} is not in this run (it has {', '.join(all_detectors)}) and "
                                    f"cannot be replayed: {exc}") from exc
            name = cls.name
            version = "builtin" if d in registry.BUILTIN_DETECTORS else str(getattr(cls, "version", "1"))
            if name not in recorded and name not in registry.SCORED_DETECTORS:
                replays.append(registry.canonical(d))
        names.append(name)
        versions[name] = version
    common = {
        "tier": tier,
        "suite_version": manifest["suite_version"],
        "libraries": json.dumps(manifest.get("libraries", {}), sort_keys=True, separators=(",", ":")),
        "git_commit": _git_commit(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "results_digest": results_digest(table),
    }
    aggregate = {a["method"]: a for a in scoring.across_tasks(per_run)}
    rows = []
    for method in methods or []:
        own = per_run[(per_run["method"] == method) & (per_run["variant"] == "injected")]
        per_task = {t: round(float(g["normalized_return"].mean()), 6) for t, g in own.groupby("task")}
        healthy = per_run[(per_run["method"] == method) & (per_run["variant"] == "control")]
        control = {t: round(float(g["normalized_return"].mean()), 6) for t, g in healthy.groupby("task")}
        agg = aggregate[method]
        rows.append({**common, "track": "stabilizer", "name": method, "version": _version(table, method),
                     "n_seeds": int(own.groupby("task")["seed"].nunique().min()),
                     "per_task": json.dumps(per_task, sort_keys=True),
                     "control_per_task": json.dumps(control, sort_keys=True), "aggregate": _fmt(agg["iqm"]),
                     "ci_low": _fmt(agg["ci_low"]), "ci_high": _fmt(agg["ci_high"]),
                     "ranked": "yes" if agg["ranked"] else "no", "acts_on": json.dumps(agg["acts_on"]),
                     "poi": _fmt(agg.get("probability_of_improvement", math.nan)),
                     "poi_ci_low": _fmt(agg.get("poi_ci_low", math.nan)),
                     "poi_ci_high": _fmt(agg.get("poi_ci_high", math.nan))})
    if replays:  # detectors the run did not record: replayed over its stored rows (the digest stays the run's)
        from stabench.suite import detectors as library

        table = library.replay_table(scoring.detector_rows(table), replays)  # only what the track scores
    keep = [c for c in table.columns if not c.startswith("alarm/") or c.split("/", 1)[1] in names]
    runs = scoring.detector_runs(table[keep], per_run) if names else pd.DataFrame()  # only the requested ones
    for detector in names:
        own = runs[runs["detector"] == detector]
        per_task = {}
        for t, g in own.groupby("task"):
            value = scoring.detector_skill(g, resamples=0)[0]
            per_task[t] = None if math.isnan(value) else round(value, 6)
        value, low, high = scoring.detector_skill(own)
        rows.append({**common, "track": "detector", "name": detector, "version": versions[detector],
                     "n_seeds": int(own.groupby("task")["seed"].nunique().min()),
                     "per_task": json.dumps(per_task, sort_keys=True), "control_per_task": "{}",
                     "aggregate": _fmt(value),
                     "ci_low": _fmt(low), "ci_high": _fmt(high), "ranked": "yes", "acts_on": "[]",
                     "poi": "nan", "poi_ci_low": "nan", "poi_ci_high": "nan"})
    for row in rows:
        row["row_digest"] = row_digest(row)
    return rows


def _version(table: pd.DataFrame, method: str) -> str:
    """`builtin` for the suite's own methods; a plugin's class attribute `version` (default "1")."""
    if method in registry.BUILTIN_STABILIZERS:
        return "builtin"
    ref = table.loc[table["method"] == method, "method_ref"].iloc[0]
    return str(getattr(registry.resolve_class("stabilizer", ref), "version", "1"))


def read(path: Path) -> list[dict]:
    """The leaderboard's rows, after checking its header and every row's digest."""
    if not path.exists():
        return []
    try:
        text = path.read_text()
        reader = csv.DictReader(io.StringIO(text))
        if reader.fieldnames != COLUMNS:
            raise StabenchError(f"{path} is corrupt: its header is not the leaderboard's")
        rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise StabenchError(f"{path} is corrupt: {exc}") from exc
    for number, row in enumerate(rows, start=2):
        if None in row or any(v is None for v in row.values()):
            raise StabenchError(f"{path} is corrupt: line {number} has the wrong number of fields")
        if row["row_digest"] != row_digest(row):
            raise StabenchError(f"{path} has a tampered row: line {number} ({row['track']} {row['name']})")
    return rows


def _write(path: Path, rows: list[dict]) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(buffer.getvalue())
    os.replace(tmp, path)


def submit(directory: Path, path: Path = DEFAULT_PATH, methods: list[str] | None = None,
           detectors: list[str] | None = None) -> list[dict]:
    """Validate a run and append its rows atomically; refuse duplicates, corrupt or tampered files."""
    table, manifest, trials = load_run(directory)
    validate_run(table, manifest, trials)
    new = compute_rows(table, manifest, methods, detectors)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=60):
        rows = read(path)
        seen = {(r["track"], r["name"], r["version"], r["tier"], r["results_digest"]) for r in rows}
        for row in new:
            if (row["track"], row["name"], row["version"], row["tier"], row["results_digest"]) in seen:
                raise StabenchError(
                    f"duplicate: {row['track']} {row['name']} at tier {row['tier']} "
                    "from these results is already listed"
                )
        _write(path, rows + new)
        render_markdown(rows + new, path.with_name("LEADERBOARD.md"))
    return new


def verify(path: Path, directories: list[Path], detectors: list[str] | None = None,
           notes: list[str] | None = None) -> list[str]:
    """Problems found: rows whose scores differ when recomputed from the given run folders. `detectors`:
    references of replayed detectors (a row names a detector by its class's `name`). A folder no row was
    computed from has nothing to disagree with: it is named in `notes` (when given), not in the problems."""
    by_name = {registry.resolve_class("detector", registry.canonical(d)).name: d for d in detectors or []}
    rows = read(path)
    problems = []
    for directory in directories:
        table, manifest, _ = load_run(directory)
        digest = results_digest(table)
        mine = [r for r in rows if r["results_digest"] == digest]
        if not mine:
            if notes is not None:
                notes.append(f"{directory}: no leaderboard row was computed from these results, nothing to recompute")
            continue
        fresh = {(r["track"], r["name"]): r for r in compute_rows(
            table, manifest,
            [r["name"] for r in mine if r["track"] == "stabilizer"],
            [by_name.get(r["name"], r["name"]) for r in mine if r["track"] == "detector"],
        )}
        for row in mine:
            again = fresh[(row["track"], row["name"])]
            for field in SCORE_FIELDS:
                if str(again[field]) != str(row[field]):
                    problems.append(
                        f"{row['track']} {row['name']}: {field} is {row[field]} in the leaderboard, "
                        f"{again[field]} from {directory}"
                    )
    return problems


def render_markdown(rows: list[dict], path: Path) -> None:
    """`results/LEADERBOARD.md`, rendered from the CSV (never edited by hand)."""
    lines = ["# Leaderboard", "", "Rendered from `leaderboard.csv` by `stabench submit`; do not edit by hand.", ""]
    for track, title, unit in (("stabilizer", "Stabilizer track", "IQM normalized return"),
                               ("detector", "Detector track", "mean detector skill score (100 = oracle, 0 = chance)")):
        mine = sorted((r for r in rows if r["track"] == track),
                      key=lambda r: (r.get("ranked", "yes") != "yes",
                                     -float(r["aggregate"]) if r["aggregate"] != "nan" else math.inf))
        if not mine:
            continue
        tasks = sorted({t for r in mine for t in json.loads(r["per_task"])})
        lines += [f"## {title}", "", f"Aggregate: {unit}, 95% stratified bootstrap interval.", ""]
        if track == "detector":
            runs = sorted({r["results_digest"][:12] for r in mine})
            lines += [f"Computed on the run(s) {', '.join(runs)} (results digest); the canonical rows come from "
                      "the method matrix `results/matrix` (every stabilizer on every default task, 10 seeds), so "
                      "every detector is scored on the very same runs.", ""]
        if track == "stabilizer":
            lines += ["Per task: normalized return of the injected runs, and in brackets of the control runs (the "
                      "method's cost on healthy training); `=` marks a task where the method does not change the "
                      "trainer, so its runs there are the baseline's. Ranked only on the common task set; P(improve) "
                      "is the probability that a run with the method beats a baseline run on the same task.", ""]
        extra = " P(improve) [95% CI] | ranked |" if track == "stabilizer" else ""
        lines.append("| name | version | tier | seeds | aggregate [95% CI] |" + extra + " " + " | ".join(tasks)
                     + " | date |")
        lines.append("|---" * (6 + len(tasks) + (2 if extra else 0)) + "|")
        for r in mine:
            per, healthy = json.loads(r["per_task"]), json.loads(r.get("control_per_task") or "{}")
            acts = json.loads(r.get("acts_on") or "[]")
            cells = [("-" if per.get(t) is None else f"{per[t]:.3g}")
                     + (f" ({healthy[t]:.3g})" if healthy.get(t) is not None else "")
                     + (" =" if track == "stabilizer" and t in per and t not in acts and r["name"] != "baseline"
                        else "")
                     for t in tasks]
            agg = f"{float(r['aggregate']):.3g} [{float(r['ci_low']):.3g}, {float(r['ci_high']):.3g}]"
            if extra:
                poi = (f"{float(r['poi']):.2f} [{float(r['poi_ci_low']):.2f}, {float(r['poi_ci_high']):.2f}]"
                       if r.get("poi", "nan") != "nan" else "-")
                agg += f" | {poi} | {r.get('ranked', 'yes')}"
            lines.append(f"| {r['name']} | {r['version']} | {r['tier']} | {r['n_seeds']} | {agg} | "
                         + " | ".join(cells) + f" | {r['date'][:10]} |")
        lines.append("")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, path)
