"""The leaderboard: `results/leaderboard.csv`, one verifiable row per submission.

A row names its track (`stabilizer` or `detector`), the method or detector and its version, the tier,
the suite and library versions, the git commit of the suite, the date, the number of seeds, the per-task
scores, and the aggregate with its 95% interval:
- stabilizer track: per task the mean normalized return after onset; aggregate the interquartile mean
  over all (task, seed) runs with a stratified bootstrap interval, and the probability of improvement over
  the baseline with its interval (`suite.statistics.across_tasks`). Methods are ranked only on the common task set
  (every task the baseline ran on): where a method does not change a task's trainer its runs are the
  baseline's (`acts_on` lists the tasks where it really acts); a method that lacks runs on some of the set
  is shown unranked, since its aggregate would compare tasks rather than methods;
- detector track: per task the detector skill score (`suite.skill`: 100 oracle, about 0 for any
  detector blind to the outcome, unclipped); aggregate the mean over tasks, with a stratified bootstrap
  interval that resamples seeds within each (task, method). Detector rows are computed on the committed
  method matrix (`results/matrix`: every stabilizer on every default task, 10 seeds), so every detector is
  compared on the very same runs, the most the suite has: a detector that run did not record is replayed over
  its stored rows (`stabench submit results/matrix --detector FILE.py:Class`, and `stabench verify
  results/matrix --detector FILE.py:Class` to recompute). Only the rows the track scores are replayed
  (`skill.detector_rows`: not the references' runs, not a method's copies of the baseline's).
`results_digest` is a digest of the raw table the row was computed from, and `row_digest` a digest of
the row's own fields: a row edited by hand no longer matches it. `stabench verify DIR` recomputes every
row whose `results_digest` matches DIR's table and reports any difference; a folder no row was computed from
has nothing to disagree with and is named in a note, not counted as a mismatch. The re-runs that check a row on new
training (`verify --replicate`, `verify --fresh K`) live in `suite.replicate`.

Rows are ordered in rank bands, never by aggregate alone (`row_bands`, `suite.bands`): rows are made on different
machines, and the same code on another CPU moves a method's normalized return by about one seed-spread, so within
a like-with-like group (`band_group`: track, tier, seeds, a tuned row's budget) rows whose 95% intervals overlap,
directly or through a chain, share a band and are not ordered. For the same reason a stabilizer row is accepted
only from a run that holds its own controls (`check_own_controls`: the baseline and both references on every task
and seed of the method), and a tuned row is compared only with its method's default from the same run
(`tuning_table`).

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
from stabench.suite import bands, outcomes, registry, skill, statistics
from stabench.suite.api import CALIBRATED_TIERS, REFERENCE_METHODS, StabenchError
from stabench.suite.fingerprint import describe, machine_key, same_machine
from stabench.suite.results import MANIFEST, METRICS, TRIALS
from stabench.suite.tune import seed_text

# `seeds` (the seeds the row was scored on, `0-9`), `setting` (JSON: the method's setting, its `search_space` keys),
# `tuning` (JSON: how `stabench tune` chose the setting: budget, tuning seeds, search, what it spent; {} untuned) and
# `failures` (JSON: per task [failed runs, runs] of the injected variant) joined later: a file made before them (the
# old header) is read with those fields empty, and an empty field leaves a row's digest as it was.
ADDED_COLUMNS = ["seeds", "setting", "tuning", "failures"]
OLD_COLUMNS = [
    "track", "name", "version", "tier", "suite_version", "libraries", "git_commit", "date", "n_seeds",
    "per_task", "control_per_task", "aggregate", "ci_low", "ci_high", "ranked", "acts_on", "poi", "poi_ci_low",
    "poi_ci_high", "results_digest", "row_digest",
]
# `fingerprint` (JSON: the machine the run was made on, its manifest's `fingerprint`; {} for a run made before
# fingerprints were recorded) joined after them, in the same way: a file with either older header is read with it
# empty, and an empty one leaves a row's digest as it was. It is no score: `verify` notes it, never compares it.
MACHINE_COLUMNS = ["fingerprint"]
OPTIONAL_COLUMNS = [*ADDED_COLUMNS, *MACHINE_COLUMNS]  # left out of a row's digest where empty
PREVIOUS_COLUMNS = [*OLD_COLUMNS[:-2], *ADDED_COLUMNS, *OLD_COLUMNS[-2:]]  # the header before `fingerprint`
COLUMNS = [*OLD_COLUMNS[:-2], *ADDED_COLUMNS, *MACHINE_COLUMNS, *OLD_COLUMNS[-2:]]
SCORE_FIELDS = ("per_task", "control_per_task", "aggregate", "ci_low", "ci_high", "n_seeds", "ranked", "acts_on",
                "poi", "poi_ci_low", "poi_ci_high", *ADDED_COLUMNS)
DEFAULT_PATH = Path("results/leaderboard.csv")


def results_digest(table: pd.DataFrame) -> str:
    """A digest of the table's content (row order and column order fixed), independent of file bytes."""
    ordered = table[sorted(table.columns)].sort_values(["task", "method", "seed", "variant", "iteration"])
    hashed = pd.util.hash_pandas_object(ordered.reset_index(drop=True), index=False).to_numpy()
    header = json.dumps(sorted(table.columns)).encode()
    return hashlib.sha256(header + hashed.tobytes()).hexdigest()


def row_digest(row: dict) -> str:
    """A digest of the row's fields (an added field left empty, in a row made before it, is left out)."""
    fields = [k for k in COLUMNS if k != "row_digest" and not (k in OPTIONAL_COLUMNS and not row.get(k))]
    body = json.dumps({k: str(row[k]) for k in fields}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def row_fingerprint(row: dict) -> dict:
    """The machine a row's run was made on, its `fingerprint` ({} for a row made before fingerprints were recorded)."""
    return json.loads(row.get("fingerprint") or "{}")


def machine_labels(rows: list[dict]) -> dict[tuple, tuple[str, dict]]:
    """The rows' distinct machines in order of appearance: machine key -> (`M1`, `M2`, ..., a fingerprint); a row
    made before fingerprints were recorded has none (`machine_label`: `unknown`)."""
    labels: dict[tuple, tuple[str, dict]] = {}
    for row in rows:
        fingerprint = row_fingerprint(row)
        key = machine_key(fingerprint)
        if key and key not in labels:
            labels[key] = (f"M{len(labels) + 1}", fingerprint)
    return labels


def machine_label(row: dict, labels: dict[tuple, tuple[str, dict]]) -> str:
    return labels.get(machine_key(row_fingerprint(row)), ("unknown", {}))[0]


def machine_legend(rows: list[dict]) -> list[str]:
    """LEADERBOARD.md's key to its `machine` column: one line per machine, and one for rows made before fingerprints."""
    lines = ["Machines (the `machine` column: where the run a row was computed from was made; rows are bit-identical "
             "only on the same machine, elsewhere they replicate within a tolerance):", ""]
    lines += [f"- {label}: {describe(fingerprint)}" for label, fingerprint in machine_labels(rows).values()]
    if any(not row_fingerprint(r) for r in rows):
        lines.append("- unknown: made before run manifests recorded the machine's fingerprint")
    return [*lines, ""]


def machine_notes(rows: list[dict]) -> list[str]:
    """`stabench verify`'s notes on machines: each row made on another machine than the built-in rows (version
    `builtin`), which its numbers may differ from by the machine alone; or, once, that the built-in rows name no
    one machine (they disagree among themselves, or were made before fingerprints were recorded)."""
    builtin = [r for r in rows if r["version"] == "builtin"]
    if not builtin:
        return []
    machines = {machine_key(row_fingerprint(r)): row_fingerprint(r) for r in builtin}
    if set(machines) == {()}:
        return ["the built-in rows record no machine fingerprint (made before fingerprints were recorded): no row's "
                "machine can be compared with theirs"]
    if len(machines) > 1:
        named = "; ".join(map(describe, machines.values()))
        return [f"the built-in rows were made on {len(machines)} machines ({named}): no row's machine is compared "
                "with theirs"]
    reference = next(iter(machines.values()))
    return [f"{r['track']} {r['name']} ({r['version']}, {r['tier']}) was made on {describe(row_fingerprint(r))}, the "
            f"built-in rows on {describe(reference)}: its numbers may differ from theirs by the machine alone"
            for r in rows if r["version"] != "builtin" and not same_machine(row_fingerprint(r), reference)]


def row_seeds(row: dict) -> str:
    """The seeds a row was scored on; a row made before they were recorded was made on `0..n_seeds-1`, every
    run's default (the committed rows: the method matrix, seeds 0-9)."""
    return row.get("seeds") or f"0-{int(row['n_seeds']) - 1}"


def is_tuned(row: dict) -> bool:
    return row.get("tuning") not in (None, "", "{}")


def band_group(row: dict) -> tuple:
    """The like-with-like group a row is ranked in: its track, tier and seeds, and a tuned row's tuning budget (a
    tuned row is ranked only against rows tuned with the same budget, an untuned one only against untuned rows)."""
    budget = int(json.loads(row["tuning"]).get("budget", 0)) if is_tuned(row) else None
    return row["track"], row["tier"], row_seeds(row), is_tuned(row), budget


BAND_NOTE = ("Rows in one band are not ordered: their 95% intervals overlap, directly or through a chain of rows, "
             "so machine noise could swap them (band 1 is the top; within a band rows are listed by aggregate, "
             "which ranks nothing; an unranked row has no band, `-`).")


def tuned_pairs(rows: list[dict]) -> set[int]:
    """Indices of the untuned stabilizer rows computed from the same raw table as a tuned row of their method: they
    were submitted to give that tuned row its same-run default (`tuning_table`), and are shown beside it, never
    ranked again among the untuned rows, where the method's own row (from the method matrix) stands."""
    tuned = {(registry.base_name(r["name"]), r["tier"], row_seeds(r), r["results_digest"]) for r in rows
             if r["track"] == "stabilizer" and is_tuned(r)}
    return {i for i, r in enumerate(rows) if r["track"] == "stabilizer" and not is_tuned(r)
            and (r["name"], r["tier"], row_seeds(r), r["results_digest"]) in tuned}


def row_bands(rows: list[dict]) -> list[int | None]:
    """Per row, its rank band within its group (`band_group`, `suite.bands`): rows whose 95% intervals overlap,
    directly or through a chain, share a band and are not ordered; 1 is the top band; an unranked row has none,
    and neither has a tuned row's same-run default (`tuned_pairs`: its band is the tuning table's)."""
    out: list[int | None] = [None] * len(rows)
    groups: dict[tuple, list[int]] = {}
    pairs = tuned_pairs(rows)
    for i, row in enumerate(rows):
        if i not in pairs:
            groups.setdefault(band_group(row), []).append(i)
    for members in groups.values():
        chosen = [rows[i] for i in members]
        found = bands.rank_bands([float(r["aggregate"]) for r in chosen], [float(r["ci_low"]) for r in chosen],
                                 [float(r["ci_high"]) for r in chosen],
                                 [r.get("ranked", "yes") == "yes" for r in chosen])
        for i, band in zip(members, found):
            out[i] = band
    return out


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


def check_own_controls(table: pd.DataFrame, methods: list[str]) -> None:
    """Refuse a stabilizer row whose run does not hold its own controls: on every task the method ran, the baseline
    and both references (`REFERENCE_METHODS`) must have run in the same run, at the same tier, on at least the
    method's seeds. A row is read against them (P(improve) against the baseline, the floor the references anchor),
    and the same code on another machine moves a method's return by about a seed-spread: controls from another
    folder would compare machines, not methods."""
    columns = ["task", "method", "seed", *(["tier"] if "tier" in table else [])]
    runs = table[columns].drop_duplicates()
    seeds = {key: set(g["seed"]) for key, g in runs.groupby(["task", "method"])}
    tiers = {key: set(g["tier"]) for key, g in runs.groupby(["task", "method"])} if "tier" in runs else {}
    for method in methods:
        for task in sorted(runs.loc[runs["method"] == method, "task"].unique()):
            mine = seeds[(task, method)]
            for control in ("baseline", *REFERENCE_METHODS):
                theirs, tier = seeds.get((task, control), set()), tiers.get((task, control), set())
                if mine <= theirs and tier == tiers.get((task, method), set()):
                    continue
                held = "no runs" if not theirs else f"seeds {seed_text(sorted(theirs))}" + (
                    f" at tier {', '.join(sorted(tier))}" if tier else "")
                raise StabenchError(
                    f"{method} cannot be scored from this run: on {task} it ran on seeds {seed_text(sorted(mine))} "
                    f"and {control} has {held}; a row needs the baseline and both references "
                    f"({', '.join(REFERENCE_METHODS)}) from its own run on the same seeds and tier: run them with it "
                    f"(--methods baseline,{','.join(REFERENCE_METHODS)},...)")


def compute_rows(table: pd.DataFrame, manifest: dict, methods: list[str] | None = None,
                 detectors: list[str] | None = None) -> list[dict]:
    """The leaderboard rows for the chosen methods and detectors of one run (all of them by default)."""
    tier = manifest["spec"]["tier"]
    per_run = outcomes.outcomes(table)
    all_methods = sorted(table["method"].unique())
    recorded = {c.split("/", 1)[1] for c in table.columns if c.startswith("alarm/")}
    all_detectors = sorted(recorded | set(registry.SCORED_DETECTORS))
    if methods is None and detectors is None:
        methods, detectors = all_methods, all_detectors
    tuned = manifest.get("tuning", {})
    methods = [_pick(m, all_methods, tuned) for m in methods or []]
    for m in methods:
        if m not in all_methods:
            raise StabenchError(f"method {m!r} is not in this run (it has {', '.join(all_methods)})")
    names, versions, replays = [], {}, []
    for d in detectors or []:
        name, version = d, "1"
        if d not in all_detectors or d in registry.discover("detector"):
            try:
                cls = registry.resolve_class("detector", registry.canonical(d))
            except StabenchError as exc:
                raise StabenchError(f"detector {d!r} is not in this run (it has {', '.join(all_detectors)}) and "
                                    f"cannot be replayed: {exc}") from exc
            name = cls.name
            version = "builtin" if d in registry.discover("detector") else str(getattr(cls, "version", "1"))
            if name not in recorded and name not in registry.SCORED_DETECTORS:
                replays.append(registry.canonical(d))
        names.append(name)
        versions[name] = version
    common = {
        "tier": tier,
        "suite_version": manifest["suite_version"],
        "libraries": json.dumps(manifest.get("libraries", {}), sort_keys=True, separators=(",", ":")),
        "fingerprint": _json(manifest.get("fingerprint") or {}),
        "git_commit": _git_commit(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "results_digest": results_digest(table),
    }
    aggregate = {a["method"]: a for a in statistics.across_tasks(per_run)}
    rows = []
    for method in methods or []:
        own = per_run[(per_run["method"] == method) & (per_run["variant"] == "injected")]
        per_task = {t: round(float(g["normalized_return"].mean()), 6) for t, g in own.groupby("task")}
        healthy = per_run[(per_run["method"] == method) & (per_run["variant"] == "control")]
        control = {t: round(float(g["normalized_return"].mean()), 6) for t, g in healthy.groupby("task")}
        agg = aggregate[method]
        record = tuned.get(method, {})
        clash = sorted(set(own["seed"]) & set(record.get("tuning_seeds", ())))
        if clash:
            raise StabenchError(f"{method} was tuned on seeds {seed_text(clash)}, which its row would be scored on")
        failures = {t: [int(g["failed"].sum()), int(len(g))] for t, g in own.groupby("task")}
        rows.append({**common, "track": "stabilizer", "name": method, "version": _version(table, method),
                     "seeds": seed_text(own["seed"].unique()), "setting": _json(_setting(table, method)),
                     "tuning": _json(record), "failures": _json(failures),
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

        table = library.replay_table(skill.detector_rows(table), replays)  # only what the track scores
    keep = [c for c in table.columns if not c.startswith("alarm/") or c.split("/", 1)[1] in names]
    runs = skill.detector_runs(table[keep], per_run) if names else pd.DataFrame()  # only the requested ones
    for detector in names:
        own = runs[runs["detector"] == detector]
        per_task = {}
        for t, g in own.groupby("task"):
            value = skill.detector_skill(g, resamples=0)[0]
            per_task[t] = None if math.isnan(value) else round(value, 6)
        value, low, high = skill.detector_skill(own)
        rows.append({**common, "track": "detector", "name": detector, "version": versions[detector],
                     "seeds": seed_text(own["seed"].unique()), "setting": "{}", "tuning": "{}",
                     # a detector's alarms on healthy runs and its warning time (`skill.alarm_summary`)
                     "failures": _json(skill.alarm_summary(own)) if len(own) else "{}",
                     "n_seeds": int(own.groupby("task")["seed"].nunique().min()),
                     "per_task": json.dumps(per_task, sort_keys=True), "control_per_task": "{}",
                     "aggregate": _fmt(value),
                     "ci_low": _fmt(low), "ci_high": _fmt(high), "ranked": "yes", "acts_on": "[]",
                     "poi": "nan", "poi_ci_low": "nan", "poi_ci_high": "nan"})
    for row in rows:
        row["row_digest"] = row_digest(row)
    return rows


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _pick(method: str, in_run: list[str], tuned: dict) -> str:
    """`M@tuned` names the run's one setting of M that `stabench tune` chose; any other name is itself."""
    plain, text = registry.split_setting(method)
    if text != "tuned":
        return method
    found = [m for m in in_run if registry.base_name(m) == plain and m in tuned]
    if len(found) != 1:
        raise StabenchError(f"{method}: the run holds {len(found) or 'no'} tuned settings of {plain} "
                            f"(it has {', '.join(in_run)})")
    return found[0]


def _setting(table: pd.DataFrame, method: str) -> dict:
    """The method's setting as it ran: the value of every key of its `search_space` ({} without one)."""
    ref = table.loc[table["method"] == method, "method_ref"].iloc[0] if "method_ref" in table else method
    cls = registry.resolve_class("stabilizer", ref)
    return {key: getattr(cls, key) for key in sorted(getattr(cls, "search_space", None) or {})}


def _version(table: pd.DataFrame, method: str) -> str:
    """`builtin` for the suite's own methods; a plugin's class attribute `version` (default "1")."""
    if registry.base_name(method) in registry.discover("stabilizer"):
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
        if reader.fieldnames not in (COLUMNS, PREVIOUS_COLUMNS, OLD_COLUMNS):
            raise StabenchError(f"{path} is corrupt: its header is not the leaderboard's")
        rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise StabenchError(f"{path} is corrupt: {exc}") from exc
    for number, row in enumerate(rows, start=2):
        if None in row or any(v is None for v in row.values()):
            raise StabenchError(f"{path} is corrupt: line {number} has the wrong number of fields")
        if row["row_digest"] != row_digest(row):
            raise StabenchError(f"{path} has a tampered row: line {number} ({row['track']} {row['name']})")
        for key in OPTIONAL_COLUMNS:  # a file made before these fields: empty, as the digest reads them
            row.setdefault(key, "")
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
    check_own_controls(table, [r["name"] for r in new if r["track"] == "stabilizer"])
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
                if field in ADDED_COLUMNS and not row.get(field):
                    continue  # a row made before the field was recorded
                if str(again[field]) != str(row[field]):
                    problems.append(
                        f"{row['track']} {row['name']}: {field} is {row[field]} in the leaderboard, "
                        f"{again[field]} from {directory}"
                    )
    return problems


def tuning_table(rows: list[dict]) -> list[dict]:
    """The tuned stabilizer rows beside their defaults, grouped by tier, scoring seeds and tuning budget: a tuned row
    is ranked only against rows tuned with the same budget on the same seeds. `default_*` come from the untuned row of
    the same method, tier and seeds computed from the same raw table (`results_digest`: the same run, so the same
    machine; the latest, if several); a tuned row without one has `has_default` False and no gain, never a default
    from another folder. `band` is the tuned row's rank band in its group (`row_bands`: rows whose intervals overlap
    are not ordered) and `default_band` the band of its default among the group's defaults (a gain that vanishes or
    a band that moves shows here)."""
    defaults: dict[tuple[str, str, str, str], dict] = {}
    for r in sorted((r for r in rows if r["track"] == "stabilizer" and not is_tuned(r)), key=lambda r: r["date"]):
        defaults[(r["name"], r["tier"], row_seeds(r), r["results_digest"])] = r
    out = []
    for r in rows:
        if r["track"] != "stabilizer" or not is_tuned(r):
            continue
        record = json.loads(r["tuning"])
        spent = record.get("spent", {})
        base = registry.base_name(r["name"])
        default = defaults.get((base, r["tier"], row_seeds(r), r["results_digest"]))
        value = float(r["aggregate"])
        before = float(default["aggregate"]) if default else math.nan
        out.append({
            "tier": r["tier"], "seeds": row_seeds(r), "budget": int(record.get("budget", 0)), "method": base,
            "setting": r["name"].partition("@")[2], "default_setting": registry.setting_text(
                json.loads(default["setting"])) if default and default.get("setting") else "",
            "configurations": spent.get("configurations"), "runs": spent.get("runs"),
            "cpu_seconds": spent.get("cpu_seconds"), "tuning_seeds": seed_text(record.get("tuning_seeds", [])),
            "results_digest": r["results_digest"], "has_default": default is not None,
            "default": before, "default_ci_low": float(default["ci_low"]) if default else math.nan,
            "default_ci_high": float(default["ci_high"]) if default else math.nan,
            "default_ranked": default is not None and default.get("ranked", "yes") == "yes",
            "tuned": value, "tuned_ci_low": float(r["ci_low"]), "tuned_ci_high": float(r["ci_high"]),
            "ranked": r.get("ranked", "yes") == "yes",
            "gain": value - before, "poi": float(r["poi"]) if r.get("poi", "nan") != "nan" else math.nan,
        })
    groups: dict[tuple, list[dict]] = {}
    for t in out:
        groups.setdefault((t["tier"], t["seeds"], t["budget"]), []).append(t)
    for group in groups.values():
        for key, ranked, band in (("tuned", "ranked", "band"), ("default", "default_ranked", "default_band")):
            found = bands.rank_bands([t[key] for t in group], [t[f"{key}_ci_low"] for t in group],
                                     [t[f"{key}_ci_high"] for t in group], [t[ranked] for t in group])
            for t, b in zip(group, found):
                t[band] = b
    return sorted(out, key=lambda t: (t["tier"], t["seeds"], t["budget"], t["band"] is None, t["band"] or 0,
                                      -t["tuned"] if not math.isnan(t["tuned"]) else math.inf, t["method"]))


def _ci(value: float, low: float, high: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3g} [{low:.3g}, {high:.3g}]"


def tuning_markdown(rows: list[dict]) -> list[str]:
    """The tuned rows as Markdown: one table per (tier, seeds, budget) group (`tuning_table`)."""
    table = tuning_table(rows)
    if not table:
        return ["No tuned rows yet: `stabench tune --method M --budget N`, then `stabench run --methods "
                "baseline,no-update,frozen-at-onset,M,M@tuned --seeds 10` and `stabench submit DIR --method M "
                "--method M@tuned`.", ""]
    lines: list[str] = []
    for key in dict.fromkeys((t["tier"], t["seeds"], t["budget"]) for t in table):
        group = [t for t in table if (t["tier"], t["seeds"], t["budget"]) == key]
        lines += [f"Tier {key[0]}, scored on seeds {key[1]}, tuned with a budget of {key[2]} configurations "
                  f"(on tuning seeds {', '.join(sorted({t['tuning_seeds'] for t in group}))}):", "",
                  "| band (default's) | method | tuned setting (default) | default [95% CI] | tuned [95% CI] | gain "
                  "| P(improve) | spent: configurations, runs, CPU-s |", "|---" * 8 + "|"]
        for t in group:
            band, default_band = (t[k] if t[k] is not None else "-" for k in ("band", "default_band"))
            gain = ("no default in the same run" if not t["has_default"] else
                    "-" if math.isnan(t["gain"]) else f"{t['gain']:+.3g}")
            poi = "-" if math.isnan(t["poi"]) else f"{t['poi']:.2f}"
            lines.append(f"| {band} ({default_band}) | {t['method']} | {t['setting']} ({t['default_setting'] or '-'}) "
                         f"| {_ci(t['default'], t['default_ci_low'], t['default_ci_high'])} | "
                         f"{_ci(t['tuned'], t['tuned_ci_low'], t['tuned_ci_high'])} | {gain} | {poi} | "
                         f"{t['configurations']}, {t['runs']}, {t['cpu_seconds']} |")
        lines += ["", BAND_NOTE, ""]
    return lines


def render_markdown(rows: list[dict], path: Path) -> None:
    """`results/LEADERBOARD.md`, rendered from the CSV (never edited by hand). Stabilizer rows are ranked only
    against rows of the same tier made on the same seeds (a baseline's aggregate differs between seeds 0-4 and
    0-9), tuned rows only against rows tuned with the same budget, beside their defaults from the same run. Each table
    lists its rows by rank band (`row_bands`: rows whose intervals overlap are not ordered), then by aggregate."""
    lines = ["# Leaderboard", "", "Rendered from `leaderboard.csv` by `stabench submit`; do not edit by hand.", "",
             *machine_legend(rows)]
    machines = machine_labels(rows)  # one key for every table
    for track, title, unit in (("stabilizer", "Stabilizer track", "IQM normalized return"),
                               ("detector", "Detector track", "mean detector skill score (100 = oracle, 0 = chance)")):
        pairs = tuned_pairs(rows)  # a tuned row's same-run default shows in the tuning table only
        untuned = [r for i, r in enumerate(rows) if r["track"] == track and not is_tuned(r) and i not in pairs]
        band = dict(zip(map(id, untuned), row_bands(untuned)))  # by band, then aggregate: no overlap is ordered
        mine = sorted(untuned, key=lambda r: (band[id(r)] is None, band[id(r)] or 0,
                                              -float(r["aggregate"]) if r["aggregate"] != "nan" else math.inf))
        if not mine:
            continue
        lines += [f"## {title}", "", f"Aggregate: {unit}, 95% stratified bootstrap interval.", ""]
        if track == "detector":
            runs = sorted({r["results_digest"][:12] for r in mine})
            lines += [f"Computed on the run(s) {', '.join(runs)} (results digest); the canonical rows come from "
                      "the method matrix `results/matrix` (every stabilizer on every default task, 10 seeds), so "
                      "every detector is scored on the very same runs.", "", *_against_prior(mine)]
        if track == "stabilizer":
            lines += ["Per task: normalized return of the injected runs, and in brackets of the control runs (the "
                      "method's cost on healthy training); `=` marks a task where the method does not change the "
                      "trainer, so its runs there are the baseline's. Ranked only on the common task set, and only "
                      "against rows of the same tier made on the same seeds (one table each); P(improve) is the "
                      "probability that a run with the method beats a baseline run on the same task.", ""]
        groups = dict.fromkeys((r["tier"], row_seeds(r)) for r in mine)  # one table (one set of bands) each
        for group in groups:
            chosen = [r for r in mine if (r["tier"], row_seeds(r)) == group]
            if track == "stabilizer" or len(groups) > 1:
                lines += [f"### Tier {group[0]}, seeds {group[1]}", ""]
            lines += _track_table(track, chosen, machines)
    lines += margin_lines(path.parent / "calibration" / "margins.csv")
    lines += ["## Tuned stabilizers", "",
              "A tuned row's setting was chosen by `stabench tune` on tuning seeds disjoint from the scoring seeds, "
              "with the budget shown; it is ranked only against rows tuned with the same budget and scored on the "
              "same seeds, beside its method's default row computed from the same raw table (the same run, "
              "`results_digest`; same tier and seeds), so the gain is the tuning's and not a difference between "
              "machines (results/calibration.md, on the CPU dependence of the warm starts). A tuned row whose run "
              "holds no default row shows \"no default in the same run\" instead of a gain.", "",
              *tuning_markdown(rows)]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, path)


def margin_lines(margins: Path) -> list[str]:
    """The tasks whose committed calibration missed a check or holds one within one seed of the bar (from
    `results/calibration/margins.csv`, `stabench score --calibration --write-margins`): a row's per-task score on
    such a task rests on a verdict that another machine or other seeds could flip."""
    from stabench.suite.calibration import margin_notes

    notes = margin_notes(margins)
    if not notes:
        return []
    return ["## Tasks with a thin or missed calibration", "",
            "A verdict within one seed of the calibration bar can flip on another machine or other seeds; a missed "
            "check means the task does not show its failure as the bar asks (results/calibration.md):", "",
            *(f"- {task}: {note}" for task, note in sorted(notes.items())), ""]


def _against_prior(rows: list[dict]) -> list[str]:
    """The detector rows read against `method-prior` (it reads no diagnostic: it alarms at onset on an injected run
    when its method's injected runs on the task's other seeds mostly failed): per detector, the tasks it scores
    above method-prior on (from `per_task`, the same run's), and its false-alarm rate and median lead."""
    prior = next((r for r in rows if r["name"] == "method-prior"), None)
    if prior is None:
        return []
    theirs = json.loads(prior["per_task"])
    parts = []
    for r in rows:
        if r["name"] in ("method-prior", "oracle", "injection") or r["results_digest"] != prior["results_digest"]:
            continue
        mine = json.loads(r["per_task"])
        above = sum(1 for t, v in mine.items() if v is not None and theirs.get(t) is not None and v > theirs[t])
        alarms = json.loads(r.get("failures") or "{}")
        far, lead = alarms.get("false_alarm_rate"), alarms.get("median_lead")
        parts.append(f"{r['name']} {above}/{len(theirs)}"
                     + (f" (false alarms {far:.2f}, lead {lead:+.1f})" if far is not None and lead is not None else ""))
    return [f"Read against `method-prior` (aggregate {float(prior['aggregate']):.3g}), which reads no diagnostic "
            "but knows which method ran and how its injected runs fared on the task's other seeds: a detector that "
            "does not beat it "
            "has not shown that it reads the failure rather than the method. Tasks on which each detector scores "
            "above it (with its false-alarm rate on healthy runs and median lead, iterations): "
            + ("; ".join(parts) or "none") + ".", ""]


def _track_table(track: str, mine: list[dict], machines: dict[tuple, tuple[str, dict]] | None = None) -> list[str]:
    machines = machine_labels(mine) if machines is None else machines
    tasks = sorted({t for r in mine for t in json.loads(r["per_task"])})
    lines = []
    band = dict(zip(map(id, mine), row_bands(mine)))
    extra = " P(improve) [95% CI] | ranked |" if track == "stabilizer" else ""
    lines.append("| band | name | version | tier | seeds | aggregate [95% CI] |" + extra + " " + " | ".join(tasks)
                 + " | machine | date |")
    lines.append("|---" * (8 + len(tasks) + (2 if extra else 0)) + "|")
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
        shown = band[id(r)] if band[id(r)] is not None else "-"
        lines.append(f"| {shown} | {r['name']} | {r['version']} | {r['tier']} | {r['n_seeds']} | {agg} | "
                     + " | ".join(cells) + f" | {machine_label(r, machines)} | {r['date'][:10]} |")
    lines += ["", BAND_NOTE, ""]
    return lines
