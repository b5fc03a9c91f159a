"""The `stabench` command. Heavy libraries are imported only by the subcommand that needs them.

Every user error is one line on stderr, `stabench: error: ...`, exit status 2, and nothing written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from stabench.suite.api import CALIBRATED_TIERS, TIERS, StabenchError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("SDL_VIDEODRIVER", "dummy")


TIER_NOTES = {"smoke": "a few iterations", "quick": "the default", "full": "longer runs, more seeds"}


def tier_status(tier: str) -> str:
    """What `stabench list` says of a tier: only the calibrated ones (`CALIBRATED_TIERS`) carry the suite's claims."""
    if tier == "smoke":
        return "checks that everything runs; its scores mean nothing"
    if tier in CALIBRATED_TIERS:
        return "calibrated (results/calibration.md)"
    return "NOT calibrated for the redesigned tasks: `run` warns, `submit` refuses it"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is a single line like every other error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise StabenchError(f"{self.prog}: {message}")


def _csv(value: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def cmd_list(args: argparse.Namespace) -> int:
    from stabench.suite import registry
    from stabench.suite.diagnostics import DIAGNOSTICS

    print("tiers:")
    for tier in TIERS:
        print(f"  {tier:<6} {TIER_NOTES.get(tier, '')}: {tier_status(tier)}")
    from stabench.suite.calibration import margin_notes

    notes = margin_notes()  # the committed calibration's missed and thin verdicts (results/calibration/margins.csv)
    print("tasks:")
    for name in registry.names("task"):
        task = registry.get_task(name)
        flag = "  [experimental]" if task.experimental else ""
        quick = task.budgets["quick"]
        print(
            f"  {name:<24} {task.family:<10} trainer={task.trainer:<9} fix={task.matched_fix:<22} "
            f"quick: {quick.iterations} it, onset {quick.onset}, {quick.seeds} seeds{flag}"
        )
        if name in notes:
            print(f"  {'':<24} calibration: {notes[name]}")
    print("stabilizers (methods), and the tasks where each acts (elsewhere it scores as the baseline):")
    tasks = {n: registry.get_task(n) for n in registry.names("task")}
    from stabench.baselines.stabilizers import verl_losses
    from stabench.suite.tune import describe_space

    verl = [f"{verl_losses.VERL_PREFIX}{n}" for n in verl_losses.registered_names()]  # verl's registered losses
    for name in [*registry.names("stabilizer"), *verl]:
        cls = registry.resolve_class("stabilizer", name)
        stabilizer = cls()
        acts = [n for n, t in tasks.items() if stabilizer.applies_to(t)]
        where = "every task" if len(acts) == len(tasks) else ", ".join(acts) or "no registered task"
        print(f"  {name:<22} {where}")
        if describe_space(cls):  # what `stabench tune` searches
            print(f"  {'':<22} settings: {describe_space(cls)}")
    if not verl:
        print(f"  verl:NAME               verl's policy losses: not installed ({verl_losses.INSTALL_HINT})")
    print("detectors:")
    for name in registry.names("detector"):
        print(f"  {name}")
    print("diagnostics:")
    for name in DIAGNOSTICS:
        print(f"  {name}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    print(run_sweep(args))
    return 0


def run_sweep(args: argparse.Namespace) -> Path:
    """The sweep `stabench run` asked for, run to the end by the library call `stabench.run` makes too."""
    from stabench.suite.sweep import run_sweep as sweep

    return sweep(args.tasks, tier=args.tier, methods=args.methods, family=args.family, seeds=args.seeds,
                 seed_start=args.seed_start, stabilizers=args.stabilizer or (), detectors=args.detector or (),
                 out=args.out, cpus=args.cpus, address=args.address, grid=args.grid, matrix=args.matrix,
                 resume=args.resume, extend=args.extend, replace=args.replace or (), wandb=args.wandb,
                 tensorboard=not args.no_tensorboard)


def cmd_tune(args: argparse.Namespace) -> int:
    """Search a method's settings on tuning seeds (suite/tune.py), print and write what it chose and spent."""
    import pandas as pd
    from stabench.suite import registry, tune

    budget = tune.DEFAULT_BUDGET if args.budget is None else args.budget
    record = tune.tune_method(args.method, tier=args.tier, tasks=args.tasks, budget=budget, seeds=args.seeds,
                              seed_start=args.seed_start, out=args.out, address=args.address, cpus=args.cpus,
                              search_seed=args.search_seed)
    folder = Path(args.out) if args.out else tune.TUNING_ROOT / record["method"]
    history = pd.DataFrame(record["history"])
    print(history[["setting", "iqm", "control_iqm", "failure_rate", "tasks_done", "runs", "cpu_seconds", "status"]]
          .to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    spent, seeds = record["spent"], tune.seed_text(record["tuning_seeds"])
    default = record["default_tuning_iqm"]
    print(f"chosen: {record['method']}@{registry.setting_text(record['setting'])}: IQM {record['tuning_iqm']:.3f} "
          f"(control {record['tuning_control_iqm']:.3f}) on tuning seeds {seeds}; the default "
          f"{registry.setting_text(record['default'])}: " + (f"{default:.3f}" if default is not None else "stopped"))
    early = int((history["status"] == "stopped early").sum())
    print(f"budget: {spent['configurations']} configurations ({early} stopped early by ASHA), {spent['runs']} runs "
          f"({spent['baseline_runs']} of them the baseline's), {spent['cpu_seconds']:.0f} CPU-seconds, "
          f"{spent['wall_seconds']:.0f} s wall")
    print(f"written: {folder / tune.RECORD}, {folder / tune.HISTORY}")
    plain = registry.split_setting(args.method)[0]
    ref = f"{plain}@tuned" if folder == tune.TUNING_ROOT / record["method"] else f"{plain}@tuned={folder}"
    controls = "baseline,no-update,frozen-at-onset"  # submit scores a row only beside its own run's controls
    what = (f"--methods {controls},{plain},{ref}" if not registry.is_reference(plain)  # and its default beside it
            else f"--methods {controls} --stabilizer {plain} --stabilizer {ref}")
    print(f"next, on the scoring seeds: stabench run --tier {record['tier']} --seeds 10 {what}"
          f" --out results/runs/tuned-{record['method']}")
    return 0


def cmd_tensorboard(args: argparse.Namespace) -> int:
    """Export a finished run's curves for TensorBoard (a run writes them itself; this one is for a folder made
    before, or with --no-tensorboard, or to put them elsewhere)."""
    from stabench.suite import curves

    path, runs = curves.export_folder(args.dir, args.out)
    print(f"{runs} TensorBoard runs -> {path}", file=sys.stderr)
    print(f"tensorboard --logdir {path}")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    """Run detectors over a real training run's logs (suite/watch.py): alarms on stdout, notes on stderr."""
    from stabench.suite import watch

    return watch.command(args)


def cmd_score(args: argparse.Namespace) -> int:
    from stabench.suite import formatting, scoring, statistics
    from stabench.suite.results import load_tables

    if args.calibration:  # the stabilizer track alone decides the bar
        from stabench.suite import calibration

        table = load_tables(args.dir)
        verdicts = calibration.verdicts(statistics.stabilizer_track(table))
        print(calibration.format_markdown(verdicts))
        if args.write_margins:
            seeds = {task: calibration.seed_label(group["seed"]) for task, group in table.groupby("task")}
            calibration.write_margins(calibration.margin_records(verdicts, seeds), Path(args.write_margins))
            print(f"stabench: {len(verdicts)} verdicts -> {args.write_margins}", file=sys.stderr)
        return 0
    if args.write_margins:
        raise StabenchError("--write-margins needs --calibration")
    table = load_tables(args.dir)
    if args.anchors:
        from stabench.suite import calibration, outcomes

        print(calibration.format_anchors(calibration.measured_anchors(outcomes.outcomes(table))))
        return 0
    if args.detector:  # replay new detectors over the stored rows: no training
        from stabench.suite import detectors, registry

        table = detectors.replay_table(table, [registry.canonical(d) for d in args.detector])
    result = scoring.score(table)
    if args.json:
        print(json.dumps(result, indent=2, allow_nan=True))
    elif args.markdown:
        print(formatting.format_markdown(result))
    else:
        print(formatting.format_table(result))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from stabench.suite import leaderboard

    rows = leaderboard.submit(Path(args.dir), Path(args.leaderboard), args.method, args.detector)
    for row in rows:
        print(f"added: {row['track']} {row['name']} ({row['tier']}): {row['aggregate']} "
              f"[{row['ci_low']}, {row['ci_high']}]")
    print(f"{len(rows)} rows appended to {args.leaderboard}")
    every = leaderboard.read(Path(args.leaderboard))
    for row in rows:  # like with like: a row is ranked only against rows on its tier and seeds
        builtin = {leaderboard.row_seeds(r) for r in every if r["track"] == row["track"] == "stabilizer"
                   and r["version"] == "builtin" and r["tier"] == row["tier"] and not leaderboard.is_tuned(r)}
        if builtin and leaderboard.row_seeds(row) not in builtin:
            print(f"note: {row['name']} was scored on seeds {leaderboard.row_seeds(row)}, the built-in rows of the "
                  f"{row['tier']} tier on {', '.join(sorted(builtin))}: it is ranked apart from them (rerun on their "
                  "seeds, for example --seeds 10, to be compared)", file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from stabench.suite import leaderboard, replicate

    if args.replicate or args.tasks or args.seeds is not None:  # re-run the folder's own trials here (replicate.py)
        return replicate.command(args)
    checks = []
    if args.fresh is not None:  # every fresh check is planned (its input checked) before anything is printed or run
        if not args.dirs:
            raise StabenchError("--fresh re-runs rows of a run folder: name it (stabench verify DIR --fresh K)")
        checks = [replicate.plan_fresh(Path(args.leaderboard), Path(d), args.fresh, args.seed_start)
                  for d in args.dirs]
        if args.cpus is not None and args.cpus < 1:
            raise StabenchError(f"--cpus must be at least 1, got {args.cpus}")
        if args.address:
            from stabench.suite import runner

            runner.check_address(args.address)
    rows = leaderboard.read(Path(args.leaderboard))
    notes: list[str] = []
    problems = leaderboard.verify(Path(args.leaderboard), [Path(d) for d in args.dirs], args.detector, notes)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    for note in leaderboard.machine_notes(rows):  # a row made on another machine than the built-in rows: no mismatch
        print(f"note: {note}", file=sys.stderr)
    for problem in problems:
        print(f"mismatch: {problem}", file=sys.stderr)
    print(f"{len(rows)} rows intact; {len(args.dirs) - len(notes)} run folders recomputed"
          + (f" ({len(notes)} with no row)" if notes else "") + f"; {len(problems)} mismatches")
    if args.fresh is None:
        return 1 if problems else 0
    wrong = 0
    for check in checks:  # re-run each folder's rows on seeds drawn now
        first = check.spec.seed_start
        print(f"fresh seeds {check.seeds} (repeat this check: stabench verify {check.directory} --fresh {args.fresh} "
              f"--seed-start {first})", flush=True)
        agree, disagree = replicate.run_fresh(check, args.address, args.cpus)
        for line in agree:
            print(f"agrees: {line}")
        for line in disagree:
            print(f"mismatch: {line}", file=sys.stderr)
        wrong += len(disagree)
    print(f"fresh check: {wrong} rows disagree with their re-run")
    return 1 if problems or wrong else 0


def cmd_leaderboard(args: argparse.Namespace) -> int:
    import pandas as pd
    from stabench.suite import leaderboard

    if args.json or args.hf:  # machine-readable exports (suite/export.py)
        from stabench.suite import export

        if args.hf:
            export.check_hf_path(Path(args.hf))  # before anything is read or computed: a bad path writes nothing
        rows = leaderboard.read(Path(args.leaderboard))
        if args.json:
            print(export.to_json(rows, args.leaderboard))
        else:
            n = export.write_hf(rows, Path(args.hf), args.leaderboard)
            print(f"{n} model-index entries -> {args.hf}")
        return 0
    rows = leaderboard.read(Path(args.leaderboard))
    if not rows:
        print(f"{args.leaderboard}: no rows yet")
        return 0
    frame = pd.DataFrame(rows)[["track", "name", "version", "tier", "n_seeds", "aggregate", "ci_low", "ci_high",
                                "per_task", "date"]]
    print(frame.to_string(index=False))
    return 0


def cmd_paper(args: argparse.Namespace) -> int:
    from stabench.suite import paper

    if args.out is None and (args.dirs or args.rerun):  # a user's run never silently replaces the committed paper
        raise StabenchError("paper: give your run's paper a folder of its own with --out OUT "
                            "(--out paper replaces the committed paper)")
    out = Path(args.out) if args.out is not None else paper.PAPER
    if out.exists() and not out.is_dir():
        raise StabenchError(f"paper: --out {out} is a file, not a folder")
    dirs = [Path(d) for d in args.dirs] or [d for d in paper.DEFAULT_RESULTS if d.exists()]
    if args.rerun:
        from stabench.suite import registry, runner

        tasks = tuple(n for n in registry.names("task") if not registry.get_task(n).experimental)
        stamp = f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
        run = Path("results/runs") / f"paper-quick-{stamp}"
        exp = runner.prepare(run, runner.ExperimentSpec(tier="quick", tasks=tasks), resume=False)
        runner.execute(exp)
        dirs = [run]
    paper.build(dirs, out)
    return 0


def cmd_reprint(args: argparse.Namespace) -> int:
    from stabench.suite import reprint

    report = reprint.reprint_file(Path(args.file), check=args.check,
                                  log=lambda line: print(line, file=sys.stderr, flush=True))
    for command, why in report.kept:
        print(f"kept as it stands: {command}: {why}")
    verb = "would change" if args.check else "changed"
    print(f"{args.file}: {len(report.reprinted)} tables reprinted, {len(report.changed)} {verb}, "
          f"{len(report.kept)} kept as they stand")
    return 1 if args.check and report.changed else 0


def cmd_report(args: argparse.Namespace) -> int:
    from stabench.suite import report

    dirs = [Path(d) for d in args.dir]
    out = Path(args.out) if args.out else dirs[0] / "report"
    path = report.build(dirs, out, args.method)
    print(path)
    return 0


def cmd_warm_start(args: argparse.Namespace) -> int:
    """The built-in warm starts and whether each shipped file matches its declared sha256 (exit 1 if one does
    not); with --retrain, train the named ones again and write their files (the maintainer's command)."""
    import importlib

    tokens = importlib.import_module("stabench.tasks.worlds.tokens")  # suite never imports the tasks statically
    starts = tokens.builtin_warm_starts()
    unknown = [n for n in args.names if n not in starts]
    if unknown:
        raise StabenchError(f"unknown warm start {', '.join(unknown)}; known: {', '.join(starts)}")
    if args.retrain and not args.names:
        raise StabenchError("warm-start: name the warm starts to retrain (stabench warm-start --retrain NAME ...)")
    bad = 0
    if not args.retrain:
        print(f"the built-in warm starts, in {tokens.shipped_dir()}:")
    for name in args.names or starts:
        start = starts[name]
        if args.retrain:
            sha = start.retrain()
            same = "; the declaration already says so" if sha == start.sha256 else ""
            print(f"{name} {sha}")
            print(f'  sha256="{sha}",  # declare it in WarmStart("{name}", ...) at {start.where()}{same}', flush=True)
            continue
        found = start.file_sha256()
        status = ("no sha256 declared" if start.sha256 is None else "MISSING" if found is None
                  else "matches" if found == start.sha256 else f"CHANGED (the file's sha256 is {found})")
        bad += status != "matches"
        print(f"  {name:<28} {start.file.name:<40} {start.sha256 or '-':<64} {status}")
    return 1 if bad else 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="stabench", description="Controlled experiments for RL training stability.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("list", help="print the registries")
    p.set_defaults(fn=cmd_list)

    p = sub.add_parser("run", help="run a sweep of task x method x variant x seed through Ray Tune")
    p.add_argument("--tier", default="quick", help="smoke, quick or full (default: quick)")
    p.add_argument("--tasks", type=_csv, help="comma-separated task ids (default: every non-experimental task)")
    p.add_argument("--family", type=_csv, help="only the tasks of these families: reasoning, tools, grids")
    p.add_argument("--methods", type=_csv, help="comma-separated methods (default: each task's own)")
    p.add_argument("--seeds", type=int, help="seeds per task and method (default: the tier's budget)")
    p.add_argument("--seed-start", type=int, default=0,
                   help="first seed (default 0); fresh seeds nobody tuned on, for example --seed-start 100")
    p.add_argument("--stabilizer", action="append", help="a plugin FILE.py:ClassName added to every task it fits")
    p.add_argument("--detector", action="append", help="a plugin detector FILE.py:ClassName")
    p.add_argument("--out", help="output folder (default: results/runs/<tier>-<time>)")
    p.add_argument("--address", help="an existing Ray cluster HOST:PORT (default: a private local Ray)")
    p.add_argument("--cpus", type=int, help="CPUs of the local Ray (default: all)")
    p.add_argument("--resume", action="store_true", help="continue the experiment already in --out")
    p.add_argument("--extend", action="store_true",
                   help="add the named tasks that the finished experiment in --out lacks (same request otherwise); "
                        "its rows are kept, only the new tasks run")
    p.add_argument("--replace", action="append", metavar="TASK",
                   help="with --extend: drop this kept task's rows and run it again (repeatable), for a task whose "
                        "version changed; every other task's rows are kept")
    p.add_argument("--grid", help="a named sweep of task knobs, for example: staleness")
    p.add_argument("--matrix", action="store_true",
                   help="every registered stabilizer on every task (where one does not act, it scores as the baseline)")
    p.add_argument("--wandb", metavar="PROJECT",
                   help="also log the trials' progress reports to this Weights & Biases project (Ray Tune's "
                        "WandbLoggerCallback; needs `pip install wandb` and `wandb login`)")
    p.add_argument("--no-tensorboard", action="store_true",
                   help="skip writing the curves for TensorBoard to OUT/tensorboard (`stabench tensorboard` can later)")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("tune", help="search a method's settings with Ray Tune on tuning seeds, with a stated budget")
    p.add_argument("--method", required=True, help="a registered method or a plugin FILE.py:Class with a search_space")
    p.add_argument("--budget", type=int,
                   help="configurations to try, the default setting first (default 4, the built-ins' budget; give "
                        "every method the same)")
    p.add_argument("--tier", default="quick", help="smoke, quick or full (default: quick)")
    p.add_argument("--tasks", type=_csv, help="comma-separated task ids (default: every non-experimental task)")
    p.add_argument("--seeds", type=int, help="tuning seeds per task (default: 2, as the built-ins were tuned)")
    p.add_argument("--seed-start", type=int, default=1000,
                   help="first tuning seed (default 1000; never the scoring seeds 0-9 or the fresh-check 100-109)")
    p.add_argument("--search-seed", type=int, default=0, help="random state of the search (default 0)")
    p.add_argument("--out", help="output folder (default: results/tuning/<method>, what M@tuned reads)")
    p.add_argument("--address", help="an existing Ray cluster HOST:PORT (default: a private local Ray)")
    p.add_argument("--cpus", type=int, help="CPUs of the local Ray (default: all)")
    p.set_defaults(fn=cmd_tune)

    p = sub.add_parser("tensorboard", help="export a finished run's per-iteration metrics as TensorBoard scalars")
    p.add_argument("dir", help="the --out folder of a finished `stabench run`")
    p.add_argument("--out", help="the folder of TensorBoard runs (default: DIR/tensorboard; replaced whole)")
    p.set_defaults(fn=cmd_tensorboard)

    p = sub.add_parser("watch", help="run detectors over a real training run's logs (TensorBoard, CSV, JSONL)")
    p.add_argument("logdir", metavar="LOGDIR",
                   help="a folder of TensorBoard event files (one run), or a CSV or JSONL history (a W&B export)")
    p.add_argument("--detector", action="append",
                   help="a detector: built-in name, entry point or FILE.py:Class (repeatable; default: the suite's "
                        "default detectors that read a diagnostic)")
    p.add_argument("--format", choices=("tensorboard", "csv", "jsonl"), help="default: from LOGDIR")
    p.add_argument("--names", choices=("verl", "trl", "stabench", "auto"), default="auto",
                   help="whose metric names the log uses (default: auto)")
    p.add_argument("--metric", action="append", metavar="NAME[:above|below]",
                   help="a diagnostic to watch, with the side on which it fails (repeatable; default: every "
                        "diagnostic of the log with a known side)")
    p.add_argument("--threshold", action="append", metavar="NAME=VALUE",
                   help="the fixed threshold the `threshold` detector uses on a watched diagnostic (repeatable)")
    p.add_argument("--warmup", type=int, default=10, help="values of each diagnostic that calibrate healthy "
                                                          "(default 10)")
    p.add_argument("--follow", action="store_true", help="tail a live run until Ctrl-C: read the log again every "
                                                         "--interval seconds, feed only the new steps")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between reads with --follow (default 10)")
    p.add_argument("--max-polls", type=int, metavar="N", help="with --follow: stop after N reads of the log")
    p.set_defaults(fn=cmd_watch)

    p = sub.add_parser("score", help="score a finished run folder (or several, as one table)")
    p.add_argument("dir", nargs="+", help="the --out folder of a `stabench run` (several: their rows joined)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables")
    p.add_argument("--calibration", action="store_true",
                   help="print, per task, whether the run clears the calibration bar (Markdown)")
    p.add_argument("--write-margins", metavar="FILE",
                   help="with --calibration: record each task's verdict and margins in seeds in FILE, replacing "
                        "its rows of the same seeds (results/calibration/margins.csv is read by `stabench list`, "
                        "the leaderboard and the paper)")
    p.add_argument("--anchors", action="store_true",
                   help="print each task's declared return floor and ceiling beside what the run measures for them "
                        "(frozen-at-onset's injected and the baseline's control post-onset return; maintainers)")
    p.add_argument("--detector", action="append",
                   help="replay this detector (FILE.py:Class, entry point or built-in; repeatable) over the stored "
                        "rows and score it beside the recorded alarm columns (the leaderboard's detector rows: "
                        "results/matrix)")
    p.set_defaults(fn=cmd_score)

    p = sub.add_parser("paper", help="rebuild the paper's figures, tables and text from raw results")
    p.add_argument("dirs", nargs="*", help="run folders (default: the committed results under results/)")
    p.add_argument("--rerun", action="store_true", help="run the quick tier first and build from it")
    p.add_argument("--out", help="the folder to write into (default: paper, only when building the committed "
                                 "results; your run's paper needs --out, --out paper replaces the committed one)")
    p.set_defaults(fn=cmd_paper)

    p = sub.add_parser("reprint", help="reprint the tables of a Markdown record (results/calibration.md) from the "
                                       "`stabench score` commands written above them (maintainers)")
    p.add_argument("file", help="the Markdown file, rewritten in place")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table would change")
    p.set_defaults(fn=cmd_reprint)

    p = sub.add_parser("report", help="a short Markdown report of your run: your methods against the baseline, "
                                      "the matched fix and the control, return curves, detectors")
    p.add_argument("dir", nargs="+", help="the --out folder of a `stabench run` (several: their rows joined)")
    p.add_argument("--out", help="the report folder (default: DIR/report)")
    p.add_argument("--method", action="append",
                   help="a method to highlight (repeatable; default: the run's plugin stabilizers)")
    p.set_defaults(fn=cmd_report)

    board = "results/leaderboard.csv"
    p = sub.add_parser("submit", help="validate a finished run and append its rows to the leaderboard")
    p.add_argument("dir", help="the --out folder of a finished `stabench run`")
    p.add_argument("--method", action="append", help="submit this method (repeatable; default: all in the run)")
    p.add_argument("--detector", action="append",
                   help="submit this detector (repeatable): an alarm column of the run, or FILE.py:Class / an entry "
                        "point replayed over the run's stored rows (detector rows: the canonical run results/matrix)")
    p.add_argument("--leaderboard", default=board, help=f"the leaderboard file (default: {board})")
    p.set_defaults(fn=cmd_submit)

    p = sub.add_parser("verify", help="check the leaderboard's rows, recomputing those from the given runs")
    p.add_argument("dirs", nargs="*", help="run folders whose rows to recompute")
    p.add_argument("--detector", action="append",
                   help="a replayed detector's FILE.py:Class or entry point, to recompute its rows (repeatable)")
    p.add_argument("--fresh", type=int, metavar="K",
                   help="also re-run each row's method and the baseline on K seeds drawn now (printed), and say "
                        "whether the failure-rate verdicts and the aggregate's interval agree with the row")
    p.add_argument("--seed-start", type=int, help="with --fresh: the first of the K seeds (repeat a printed check)")
    p.add_argument("--replicate", action="store_true",
                   help="re-run DIR's trials on this machine and compare: identical rows on the same machine (its "
                        "fingerprint), else within the declared tolerance (README: Replicating a row)")
    p.add_argument("--tasks", type=_csv, help="with --replicate: only these tasks (default: every task DIR holds)")
    p.add_argument("--seeds", metavar="SPEC",
                   help="with --replicate: only these seeds, like 0-2 or 0,3,7 (default: every seed DIR holds)")
    p.add_argument("--address", help="with --fresh or --replicate: an existing Ray cluster HOST:PORT (default: a "
                                     "private local Ray)")
    p.add_argument("--cpus", type=int, help="with --fresh or --replicate: CPUs of the local Ray (default: all)")
    p.add_argument("--leaderboard", default=board, help=f"the leaderboard file (default: {board})")
    p.set_defaults(fn=cmd_verify)

    p = sub.add_parser("leaderboard", help="print the leaderboard (or export it: --json, --hf)")
    p.add_argument("--leaderboard", default=board, help=f"the leaderboard file (default: {board})")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true",
                      help="print every row as JSON: per-task values, aggregate and P(improve) with 95%% intervals")
    form.add_argument("--hf", metavar="OUT",
                      help="write the rows in Hugging Face's model-index format (evaluation results) to OUT "
                           "(.yaml, .yml or .json)")
    p.set_defaults(fn=cmd_leaderboard)

    p = sub.add_parser("warm-start", help="check the built-in warm starts' shipped files against their declared "
                                          "sha256; --retrain NAME trains one again (maintainers)")
    p.add_argument("names", nargs="*", metavar="NAME", help="warm starts (default: all of them)")
    p.add_argument("--retrain", action="store_true",
                   help="train NAME again with its own training code (one thread), write its file, print the sha256 "
                        "to declare")
    p.set_defaults(fn=cmd_warm_start)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.fn(args)
    except StabenchError as exc:
        print(f"stabench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stabench: interrupted; rerun with --resume to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
