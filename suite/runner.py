"""The runner: a sweep of task x method x seed as one Ray Tune experiment, collected into one table.

One Tune trial is one (task, method, seed): it trains the healthy phase once, deep-copies the run at
the onset iteration, and continues the copy twice, injected and control. That halves the healthy-phase
compute, pairs the two variants, and makes a trial a unit of work large beside Ray's per-trial cost.
A trial ships its rows as `rows.parquet` inside a Tune checkpoint, so results reach the experiment's
storage on a cluster as well as locally; the collector joins them into `DIR/metrics.parquet`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pandas as pd

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
if "RAY_AUTH_MODE" not in os.environ and (
    Path("~/.ray/auth_token").expanduser().is_file() or "RAY_AUTH_TOKEN" in os.environ
):
    os.environ["RAY_AUTH_MODE"] = "token"  # Ray reads this at import; a client never switches it on itself
from ray import tune  # noqa: E402  (after the environment Ray reads at import)
from stabench.suite import registry  # noqa: E402
from stabench.suite.api import StabenchError  # noqa: E402
from stabench.suite.fingerprint import describe, differing, machine_fingerprint, machine_id, same_machine  # noqa: E402
from stabench.suite.results import MANIFEST, METRICS, TRIALS  # noqa: E402, F401  (the public names)
from stabench.suite.trial import SUITE_VERSION, TrialSpec, cell_name, digest, run_trial  # noqa: E402, F401  (the public names)

LIBRARIES = ("torch", "gymnasium", "minigrid", "transformers", "ray", "numpy", "pandas", "scipy")
TUNE_DIR = "tune"


def library_versions() -> dict[str, str]:
    out = {}
    for lib in LIBRARIES:
        try:
            out[lib] = version(lib)
        except PackageNotFoundError:
            out[lib] = "missing"
    return out


@dataclass(frozen=True)
class ExperimentSpec:
    """A sweep: every task with every method that applies to it, over `seeds` seeds."""

    tier: str
    tasks: tuple[str, ...]
    methods: tuple[str, ...] | None = None  # None: each task's own default methods and the two references
    seeds: int | None = None  # None: each task's budget at the tier
    seed_start: int = 0  # seeds seed_start .. seed_start + seeds - 1 (fresh seeds nobody tuned on: e.g. 100)
    stabilizers: tuple[str, ...] = ()  # plugin references added to every task they apply to
    detectors: tuple[str, ...] = registry.DEFAULT_DETECTORS
    grid: str | None = None  # a named sweep of task knobs (for example "staleness"), through Tune's grid
    matrix: bool = False  # every registered stabilizer on every task (methods then must be None)

    def config_hash(self) -> str:
        return digest(asdict(self))

    def trials(self) -> list[TrialSpec]:
        """Validate every name and build the grid; raises StabenchError before anything runs."""
        return self.plan()[0]

    def plan(self) -> tuple[list[TrialSpec], list[tuple[str, str, str]]]:
        """The trials, and the identities: (task, cell, method) of every requested method that does not change
        the task's trainer, whose runs there are the baseline's (`collect` records them as copies, `acts` False)."""
        if self.matrix and self.methods is not None:
            raise StabenchError("--matrix runs every registered stabilizer: leave out --methods")
        out: list[TrialSpec] = []
        identity: list[tuple[str, str, str]] = []
        everything = tuple(registry.names("stabilizer")) if self.matrix else None
        gridded = False
        for name in self.tasks:
            task = registry.get_task(name)
            cells: list[dict[str, Any]] = [{}]
            if self.grid:
                try:
                    cells = task.grid(self.grid, self.tier)
                    gridded = True
                except StabenchError:
                    if len(self.tasks) == 1:
                        raise
                for cell in cells:
                    registry.get_task(name, **cell)  # a bad cell fails here, before anything runs
            budget = task.budget(self.tier)
            # a default sweep runs what a row is scored against: the baseline, the matched fix and the references
            own = everything or (self.methods if self.methods is not None else task.default_methods())
            methods = list(dict.fromkeys([*own, *self.stabilizers]))
            usable, idle = [], []
            for method in methods:
                registry.method_name(method)  # a plugin's recorded name must be its own
                stabilizer = registry.make_stabilizer(method)
                if stabilizer.applies_to(task):
                    usable.append(method)
                elif self.methods is not None and method in self.methods and len(self.tasks) == 1:
                    raise StabenchError(
                        f"method {method!r} does not apply to task {name!r} (trainer {task.trainer}; it needs "
                        f"{', '.join(sorted(stabilizer.needs))})"
                    )
                else:
                    idle.append(method)
            if not usable:
                raise StabenchError(f"no requested method applies to task {name!r} (trainer {task.trainer})")
            if idle and "baseline" not in usable:  # a method that does not act there scores as the baseline
                usable.insert(0, "baseline")
            identity += [(name, cell_name(tuple(sorted(cell.items()))), m) for cell in cells for m in idle]
            seeds = self.seeds if self.seeds is not None else budget.seeds
            if seeds < 1:
                raise StabenchError(f"--seeds must be at least 1, got {seeds}")
            if self.seed_start < 0:
                raise StabenchError(f"--seed-start must be at least 0, got {self.seed_start}")
            out += [TrialSpec(name, m, s, self.tier, self.detectors, tuple(sorted(cell.items())))
                    for cell in cells for m in usable for s in range(self.seed_start, self.seed_start + seeds)]
        if self.grid and not gridded:
            raise StabenchError(f"no requested task has a grid named {self.grid!r}")
        for det in self.detectors:
            from stabench.suite.crossfit import is_learned

            if is_learned(registry.resolve_class("detector", det)):  # fitted on other runs: scored, not recorded
                raise StabenchError(f"detector {det!r} is learned (it declares `fit`): a run does not record it; "
                                    "score it cross-fitted on the finished run: `stabench score DIR --detector ...`")
        return out, identity


@contextlib.contextmanager
def without_tune_logfiles() -> Iterator[None]:
    """Tune's own per-trial result.json, progress.csv, params.json and TensorBoard files off for a sweep (unless the
    caller set `TUNE_DISABLE_AUTO_CALLBACK_LOGGERS` itself): the driver rewrote them at every progress report, nothing
    reads them (the rows travel in each trial's checkpoint, `tensorboard/` is stabench's own export, `--resume`
    restores from Tune's experiment state), and on 2 cores the driver's work is taken from the trials
    (bench/RESULTS.md, benchmark 11). Scoped, because `stabench tune` keeps them: its trials' params.json are its
    record of what each configuration ran."""
    key = "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"
    mine = key not in os.environ
    # Tune's result grid then warns, one line per trial, that it found no such files: expected, so not shown
    analysis = logging.getLogger("ray.tune.analysis.experiment_analysis")
    level = analysis.level
    if mine:
        os.environ[key] = "1"
        analysis.setLevel(logging.ERROR)
    try:
        yield
    finally:
        if mine:
            os.environ.pop(key, None)
            analysis.setLevel(level)


# A progress report holds the trial until the driver has taken it (Tune's function API), 5% of a quick trial's
# time at one report per 10 iterations (bench/RESULTS.md, benchmark 11's third round): a trial reports what it
# reached at most this often, and at the end. With `--wandb`, whose curves are the reports, every one is sent.
PROGRESS_SECONDS = 10.0


def _tune_trainable(config: dict) -> None:
    """The Ray Tune function trainable: one trial, progress every few iterations, rows in a checkpoint."""
    trial = config["trial"]
    spec = TrialSpec(**{**trial, "detectors": tuple(trial["detectors"]),
                        "knobs": tuple((k, v) for k, v in trial.get("knobs", ()))})
    started = time.time()
    every = 0.0 if config.get("curves", True) else PROGRESS_SECONDS
    last = [started]

    def progress(iteration: int, variant: str, row: dict) -> None:
        now = time.time()
        if now - last[0] < every:
            return
        last[0] = now
        ret = row.get("return", math.nan)
        # each numeric metric also under its variant's name: what `--wandb` plots (the table holds every row)
        named = {f"{variant}/{k}": float(v) for k, v in row.items()
                 if k != "iteration" and isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)}
        tune.report({**named, "iteration": iteration, "variant": variant, "return": float(ret), "done": False})

    table = run_trial(spec, progress)
    with tempfile.TemporaryDirectory() as tmp:
        table.to_parquet(Path(tmp) / "rows.parquet", index=False)
        status = "diverged" if (table["status"] == "diverged").any() else "ok"
        tune.report(
            {"done": True, "status": status, "seconds": time.time() - started, "rows": len(table),
             "machine": machine_id(machine_fingerprint())},  # the worker's: on a cluster, maybe not the driver's
            checkpoint=tune.Checkpoint.from_directory(tmp),
        )


_tune_trainable.__name__ = "stabench_trial"  # Tune restores by trainable name: keep it fixed


def format_duration(seconds: float) -> str:
    """`1h05m`, `4m10s`, `12s`: a duration short enough for a progress line."""
    if not math.isfinite(seconds):
        return "?"
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def progress_note(done: int, total: int, elapsed: float, done_here: int) -> str:
    """`25%, 1m02s elapsed, 2.9 trials/min, ETA 3m06s`: what a progress line adds after its trial.

    The rate is this session's throughput (`done_here` trials finished in `elapsed` seconds; a resumed run's
    earlier trials do not count), so the ETA of the `total - done` trials left already reflects how many run
    at once; it is rough while few have finished and trials of different tasks differ in length."""
    share = f"{100 * done / total:.0f}%" if total else "100%"
    head = f"{share}, {format_duration(elapsed)} elapsed"
    if done >= total:
        return f"{head}, done"
    if done_here <= 0 or elapsed <= 0:
        return f"{head}, ETA ?"
    rate = done_here / elapsed
    return f"{head}, {60 * rate:.1f} trials/min, ETA {format_duration((total - done) / rate)}"


class ProgressCallback(tune.Callback):
    """Prints one plain line per finished trial with done/total, the trial rate and an ETA (Tune's own tables
    are switched off; no terminal control codes, so a log file reads like the terminal)."""

    def __init__(self, total: int, already: int = 0, clock: Any = time.monotonic) -> None:
        self.total, self.finished, self.already = total, already, already
        self.retries: dict[str, int] = {}
        self.clock, self.started = clock, clock()

    def note(self) -> str:
        """The progress part of the line for the trial that just finished."""
        return progress_note(self.finished, self.total, self.clock() - self.started, self.finished - self.already)

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        t = trial.config["trial"]
        key = f"{t['task']}|{t['method']}|{t['seed']}|{cell_name(t.get('knobs', ()))}"
        self.retries[key] = self.retries.get(key, 0) + 1
        print(f"[retry] {registry.get_task(t['task']).id} {registry.method_name(t['method'])} seed={t['seed']}: "
              f"its worker failed; Tune runs it again (retry {self.retries[key]})", file=sys.stderr, flush=True)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.finished += 1
        r = trial.last_result or {}
        t = trial.config["trial"]
        print(
            f"[{self.finished:>3}/{self.total}] {registry.get_task(t['task']).id} {registry.method_name(t['method'])} "
            f"seed={t['seed']}{' ' + cell_name(t['knobs']) if t.get('knobs') else ''}: "
            f"{r.get('status', '?')} in {r.get('seconds', float('nan')):.1f} s; {self.note()}",
            file=sys.stderr,
            flush=True,
        )

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.finished += 1  # it will not run again: it counts as done for the ETA
        t = trial.config["trial"]
        print(f"[{self.finished:>3}/{self.total}] [error] {t['task']} {t['method']} seed={t['seed']} failed inside "
              f"Ray; {self.note()}", file=sys.stderr, flush=True)


def check_address(address: str) -> None:
    """Fail fast, with one line, when nothing listens at a Ray cluster address."""
    if address in ("auto", "local") or address.startswith("ray://"):
        host_port = address.removeprefix("ray://")
        if address in ("auto", "local"):
            return
    else:
        host_port = address
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise StabenchError(f"--address {address!r} must look like HOST:PORT")
    try:
        with socket.create_connection((host, int(port)), timeout=3):
            pass
    except OSError as exc:
        raise StabenchError(f"no Ray cluster answers at {address}: {exc.strerror or exc}") from exc


def _prune_stale_temp_dirs() -> None:
    """Remove private Ray folders left by stabench drivers that no longer run (killed with SIGKILL)."""
    for path in Path(tempfile.gettempdir()).glob("sbray*_*"):
        pid = path.name[len("sbray"):].split("_", 1)[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        shutil.rmtree(path, ignore_errors=True)


# Ray's notices a user of the private local Ray cannot act on: it turns token authentication on for every new
# local cluster and says so ("Set RAY_AUTH_MODE=disabled to opt out") on each run; the Ray is stabench's own
# and is stopped at the end of the sweep. A cluster given with --address keeps all of its own output.
QUIET_LOGGERS = ("ray._private.authentication.authentication_token_setup",)


@contextlib.contextmanager
def quiet_notices() -> Iterator[None]:
    """Warnings of `QUIET_LOGGERS` are dropped while the private local Ray starts (errors still show)."""
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


class RayCluster:
    """Context manager: a private local Ray by default (never someone else's), or an existing cluster."""

    def __init__(self, address: str | None, num_cpus: int | None) -> None:
        self.address, self.num_cpus, self.temp_dir = address, num_cpus, None

    def __enter__(self) -> RayCluster:
        import ray

        _prune_stale_temp_dirs()
        if self.address:
            try:
                ray.init(address=self.address, log_to_driver=False, configure_logging=False)
            except Exception as exc:  # ConnectionError, AuthenticationError, ...
                first = str(exc).splitlines()[0]
                raise StabenchError(f"cannot join the Ray cluster at {self.address}: {first}") from exc
        else:
            # short (Ray's socket paths have a length cap) and named after this process, so that a later
            # run can remove the folder of a driver that was killed before it could clean up
            self.temp_dir = tempfile.mkdtemp(prefix=f"sbray{os.getpid()}_")
            with quiet_notices():
                ray.init(
                    address="local",
                    num_cpus=self.num_cpus or os.cpu_count(),
                    include_dashboard=False,  # nobody looks at a dashboard of a Ray that lives for one sweep
                    object_store_memory=200 * 1024**2,
                    log_to_driver=False,
                    configure_logging=False,
                    _temp_dir=self.temp_dir,
                )
        return self

    def cpus(self) -> int:
        import ray

        return int(ray.cluster_resources().get("CPU", 1))

    def __exit__(self, *exc: Any) -> None:
        import ray

        ray.shutdown()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


@dataclass
class Experiment:
    """An experiment folder: manifest, Tune storage, per-trial status, and the tidy table."""

    out: Path
    spec: ExperimentSpec
    trials: list[TrialSpec] = field(default_factory=list)
    identities: list[tuple[str, str, str]] = field(default_factory=list)
    kept: tuple[str, ...] = ()  # an extension: the tasks whose rows the folder already holds (and keeps)
    replaced: tuple[str, ...] = ()  # an extension: the tasks the folder holds whose rows are dropped and run again
    present: frozenset[tuple[str, str, str, str]] = frozenset()  # and its trials: (task, method, seed, cell)
    # an extension: (task, cell, method) the folder holds as real runs that the request now plans as identities
    # (the method's `needs` narrowed since): their rows are dropped and the baseline's copied, as a whole run would
    narrowed: tuple[tuple[str, str, str], ...] = ()
    # method name -> how `stabench tune` chose its setting (`M@tuned`): budget, tuning seeds, search; the leaderboard
    # row of the method carries it. Kept out of the spec: the spec names the setting itself.
    tuning: dict[str, dict] = field(default_factory=dict)

    def lacking(self) -> list[TrialSpec]:
        """The planned trials the folder does not hold (every one, unless it is an extension)."""
        return [t for t in self.trials if (t.task, t.method, str(t.seed), cell_name(t.knobs)) not in self.present]

    @property
    def manifest(self) -> dict:
        return {
            "suite_version": SUITE_VERSION,
            "spec": asdict(self.spec),
            "config_hash": self.spec.config_hash(),
            "libraries": library_versions(),
            "trials": len(self.trials),
            "identities": [list(i) for i in self.identities],
            **({"tuning": self.tuning} if self.tuning else {}),
            "fingerprint": machine_fingerprint(),  # the driver's (README, "How a run works": on a cluster)
        }


def prepare(out: Path, spec: ExperimentSpec, resume: bool, extend: bool = False,
            replace: tuple[str, ...] = ()) -> Experiment:
    """Check the output folder against the request; writes nothing.

    `extend`: the folder holds a finished experiment whose request differs from this one only by lacking some
    of its tasks; only the missing tasks' trials are to run (their rows do not depend on the other tasks').
    `replace`: tasks the folder holds whose rows are stale (the task changed); their rows are dropped and their
    trials run again, as if they were missing. A method that no longer acts on a kept task (`narrowed`) has its
    runs there replaced by copies of the baseline's, without running anything."""
    exp = Experiment(out, spec, *spec.plan())
    manifest_path = out / MANIFEST
    if extend:
        held = _extension_base(out, spec, replace)
        exp.kept = tuple(t for t in held if t not in replace)
        exp.replaced = replace
        have = pd.read_csv(out / TRIALS, keep_default_na=False, dtype=str)
        have = have[~have["task"].isin(replace)]
        exp.present = frozenset(zip(have["task"], have["method"], have["seed"], have["knobs"]))
        ran = have[have["status"] != "identity"]
        exp.narrowed = tuple(sorted(set(zip(ran["task"], ran["knobs"], ran["method"])) & set(exp.identities)))
        exp.tuning = json.loads(manifest_path.read_text()).get("tuning", {})  # checked readable above
        planned = {(t.task, t.method) for t in exp.trials} | {(task, m) for task, _, m in exp.identities}
        stale = sorted({f"{t} {m}" for t, m, _, _ in exp.present if (t, m) not in planned})
        if stale:
            raise StabenchError(f"{out} holds trials this request no longer plans ({', '.join(stale[:3])}"
                                f"{', ...' if len(stale) > 3 else ''}): rerun it whole")
        if not exp.lacking() and not replace and not exp.narrowed:  # no new task, method or narrowed method
            raise StabenchError(f"{out} already holds every requested trial: nothing to add")
        return exp
    if resume:
        if not manifest_path.is_file():
            raise StabenchError(f"nothing to resume in {out}: no {MANIFEST}")
        try:
            old = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise StabenchError(f"cannot read {manifest_path}: {exc}") from exc
        if old.get("config_hash") != spec.config_hash():
            raise StabenchError(f"{out} holds a different experiment ({old.get('spec')}); rerun its own command")
        if old.get("suite_version") != SUITE_VERSION:
            raise StabenchError(f"{out} was made by suite version {old.get('suite_version')}, this is {SUITE_VERSION}")
        check_machine(out, old, "resume")
        exp.tuning = old.get("tuning", {})
    elif out.exists() and any(out.iterdir()):
        raise StabenchError(f"{out} already holds files; pass --resume to continue it, or choose another --out")
    return exp


def check_machine(out: Path, old: dict, verb: str) -> None:
    """Refuse to add this machine's rows to a folder made on another (`old`: its manifest): rows are bit-identical
    only on the same fingerprint, so one folder holds one machine's. A folder made before fingerprints were
    recorded cannot show where it was made, and is refused too."""
    here = machine_fingerprint()
    made = old.get("fingerprint")
    if not made:
        raise StabenchError(f"{out} was made before machine fingerprints were recorded (its {MANIFEST} has none), so "
                            f"its rows cannot be shown to come from this machine ({describe(here)}): rerun it whole")
    if not same_machine(made, here):
        raise StabenchError(f"{out} was made on another machine ({describe(made)}) than this one ({describe(here)}; "
                            f"they differ in {', '.join(differing(made, here))}): one folder holds one machine's rows, "
                            f"so rerun it whole here, or {verb} it there")


def _extension_base(out: Path, spec: ExperimentSpec, replace: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The tasks a finished experiment in `out` already holds, after checking that `spec` only adds tasks (or
    replaces some it holds)."""
    manifest_path = out / MANIFEST
    if not all((out / name).is_file() for name in (MANIFEST, METRICS, TRIALS)):
        raise StabenchError(f"nothing to extend in {out}: it needs a finished run ({MANIFEST}, {METRICS}, {TRIALS})")
    try:
        old = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StabenchError(f"cannot read {manifest_path}: {exc}") from exc
    if old.get("suite_version") != SUITE_VERSION:
        raise StabenchError(f"{out} was made by suite version {old.get('suite_version')}, this is {SUITE_VERSION}")
    if old.get("libraries") != library_versions():
        raise StabenchError(f"{out} was made with other library versions ({old.get('libraries')}); rerun it whole")
    check_machine(out, old, "extend")
    old_spec = {k: v for k, v in old.get("spec", {}).items() if k != "tasks"}
    new_spec = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(spec).items() if k != "tasks"}
    differ = sorted(k for k in new_spec if old_spec.get(k) != new_spec[k])
    if differ:
        raise StabenchError(f"{out} holds an experiment that differs in {', '.join(differ)}, not only in its tasks")
    kept = tuple(old["spec"].get("tasks", ()))
    missing = sorted(set(kept) - set(spec.tasks))
    if missing:
        raise StabenchError(f"--extend keeps every task of {out}; name {', '.join(missing)} too")
    foreign = sorted(set(replace) - set(kept))
    if foreign:
        raise StabenchError(f"--replace names {', '.join(foreign)}, which {out} does not hold: add it without it")
    if replace and set(kept) <= set(replace):
        raise StabenchError(f"--replace names every task {out} holds: rerun it whole")
    return kept


def execute(exp: Experiment, address: str | None = None, num_cpus: int | None = None, resume: bool = False,
            callbacks: tuple[Any, ...] = (), tensorboard: bool = True) -> Path:
    """Run the experiment through Ray Tune and write `metrics.parquet` and `trials.csv`, and (`tensorboard`) the
    curves for TensorBoard in `tensorboard/`; `callbacks` are more Tune callbacks (`--wandb`'s).

    An extension (`exp.kept`) runs only the trials of the tasks the folder lacks, in a Tune folder of its own,
    and writes the joined table, trial list and manifest at the end (until then the folder is as it was)."""
    run, identities = exp.trials, exp.identities
    if exp.kept:  # what the request holds and the folder lacks: new tasks, and new methods on kept tasks
        run = exp.lacking()
        copied = {(task, cell, method) for task, method, _, cell in exp.present} - set(exp.narrowed)
        identities = [i for i in exp.identities if i not in copied]
        for task, cell, method in exp.narrowed:
            print(f"stabench: {method} no longer acts on {task}{f' ({cell})' if cell else ''}: its runs there "
                  "become copies of the baseline's", file=sys.stderr)
    started = time.time()
    name = f"{TUNE_DIR}-extend-{exp.spec.config_hash()}" if exp.kept else TUNE_DIR
    if exp.replaced:  # the same request was extended before: a Tune folder of this session's own
        name += f"-replace-{int(started)}"
    tune_path = exp.out.resolve() / name
    if run:
        results, retries = _fit(exp, run, tune_path, address, num_cpus, resume, callbacks)
    else:  # an extension that only turns runs of narrowed methods into copies of the baseline's
        results, retries = [], {}
    kept = pd.read_parquet(exp.out / METRICS) if exp.kept else None
    if kept is not None and exp.replaced:
        kept = kept[~kept["task_ref"].isin(exp.replaced)].reset_index(drop=True)
    if kept is not None and exp.narrowed:
        narrowed = pd.Series(list(zip(kept["task_ref"], kept["cell"].fillna(""), kept["method_ref"]))).isin(
            set(exp.narrowed))
        kept = kept[~narrowed.to_numpy()].reset_index(drop=True)
    table, trials = collect(results, run, retries, identities, kept)
    seconds = round(time.time() - started, 1)
    if exp.kept:
        table, trials, manifest = _join_extension(exp, table, trials, seconds)
    else:
        manifest = json.loads((exp.out / MANIFEST).read_text())
        manifest["wall_seconds"] = seconds  # this session's (a resumed run: the last one's)
    write_atomic(table, exp.out / METRICS)
    trials.to_csv(exp.out / TRIALS, index=False)
    (exp.out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    bad = trials[~trials["status"].isin(["ok", "identity"])]
    print(
        f"stabench: {int((trials['status'] != 'identity').sum())} trials in {time.time() - started:.0f} s "
        f"({int((trials['status'] == 'identity').sum())} identities); {len(bad)} not ok; "
        f"{len(table)} rows -> {exp.out / METRICS}",
        file=sys.stderr,
    )
    if tensorboard:
        _export_curves(table, exp.out)
    return exp.out / METRICS


def _export_curves(table: pd.DataFrame, out: Path) -> None:
    """The whole table's curves for TensorBoard (a resumed or extended run's too); the results are already written,
    so a failure here is a warning, never a lost run."""
    from stabench.suite import curves

    begun = time.time()
    try:
        runs = curves.export(table, out / curves.TENSORBOARD)
    except (StabenchError, OSError) as exc:
        print(f"stabench: warning: no TensorBoard curves ({exc}); `stabench tensorboard {out}` retries",
              file=sys.stderr)
        return
    print(f"stabench: {runs} TensorBoard runs in {time.time() - begun:.1f} s -> tensorboard --logdir "
          f"{out / curves.TENSORBOARD}", file=sys.stderr)


def _fit(exp: Experiment, run: list[TrialSpec], tune_path: Path, address: str | None, num_cpus: int | None,
         resume: bool, callbacks: tuple[Any, ...]) -> tuple[Any, dict[str, int]]:
    """Run `run` through Ray Tune in `tune_path`: the results, and how often Tune restarted each trial."""
    storage, name = str(tune_path.parent), tune_path.name
    with RayCluster(address, num_cpus) as cluster:
        exp.out.mkdir(parents=True, exist_ok=True)  # only now: a failed connection leaves nothing behind
        if not resume and not exp.kept:
            (exp.out / MANIFEST).write_text(json.dumps(exp.manifest, indent=2))
        cpus = cluster.cpus()
        where = f"the Ray cluster at {address}" if address else "a private local Ray"
        adding = f" (adding {', '.join(t for t in exp.spec.tasks if t not in exp.kept)})" if exp.kept else ""
        print(f"stabench: {len(run)} trials on {where} with {cpus} CPUs -> {exp.out}{adding}", file=sys.stderr)
        trainable = tune.with_resources(_tune_trainable, {"cpu": 1})
        # a resumed run's finished trials (a fresh run may reuse the Tune folder of an earlier extension)
        done = len(list(tune_path.glob("*/checkpoint_*/rows.parquet"))) if resume else 0
        progress = ProgressCallback(len(run), already=done)
        if resume and tune.Tuner.can_restore(str(tune_path)):
            print(f"stabench: resuming, {done} of {len(run)} trials already finished", file=sys.stderr)
            tuner = tune.Tuner.restore(str(tune_path), trainable, resume_unfinished=True, resume_errored=True)
            # Tune restores the run config it pickled; give it this session's progress printer.
            tuner._local_tuner.get_run_config().callbacks = [progress, *callbacks]  # noqa: SLF001
        else:
            grid = [asdict(t) for t in run]
            tuner = tune.Tuner(
                trainable,
                param_space={"trial": tune.grid_search(grid), "curves": bool(callbacks)},
                tune_config=tune.TuneConfig(max_concurrent_trials=cpus, reuse_actors=True),
                run_config=tune.RunConfig(
                    name=name,
                    storage_path=storage,
                    verbose=0,
                    failure_config=tune.FailureConfig(max_failures=2),
                    callbacks=[progress, *callbacks],
                ),
            )
        with without_tune_logfiles():
            results = tuner.fit()
    return results, progress.retries


def _join_extension(exp: Experiment, table: pd.DataFrame, trials: pd.DataFrame,
                    seconds: float) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """The folder's rows and the new tasks' rows as one run would have written them (same order and columns);
    the manifest is the whole request's, its wall time the sum of the sessions' (each listed)."""
    old_manifest = json.loads((exp.out / MANIFEST).read_text())
    old_trials = pd.read_csv(exp.out / TRIALS)
    old_trials = old_trials[~old_trials["task"].isin(exp.replaced)]
    old_trials = old_trials.assign(knobs=old_trials["knobs"].fillna(""))
    narrowed = pd.Series(list(zip(old_trials["task"], old_trials["knobs"], old_trials["method"]))).isin(
        set(exp.narrowed)).to_numpy()
    old_trials = old_trials[~(narrowed & (old_trials["status"] != "identity").to_numpy())]
    every = pd.concat([old_trials, trials], ignore_index=True)
    every["knobs"] = every["knobs"].fillna("")
    planned = {(t.task, t.method, t.seed, cell_name(t.knobs)): i for i, t in enumerate(exp.trials)}
    copied = {(task, cell, method): i for i, (task, cell, method) in enumerate(exp.identities)}
    real = every[every["status"] != "identity"]
    real = real.assign(_at=[planned[k] for k in zip(real["task"], real["method"], real["seed"], real["knobs"])])
    copies = every[every["status"] == "identity"]
    copies = copies.assign(_at=[copied[k] for k in zip(copies["task"], copies["knobs"], copies["method"])])
    real, copies = (f.sort_values(["_at", "seed"], kind="stable").drop(columns="_at") for f in (real, copies))
    manifest = exp.manifest
    first = {"tasks": [*exp.kept, *exp.replaced], "wall_seconds": old_manifest.get("wall_seconds"),
             "fingerprint": old_manifest.get("fingerprint", {})}
    history = old_manifest.get("sessions") or [first]
    added = [t for t in exp.spec.tasks if t not in exp.kept]
    turned = {(task, method) for task, _, method in exp.narrowed}
    methods = sorted({m for t, m in zip(trials["task"], trials["method"])  # registered since, on kept tasks
                      if t in exp.kept and (t, m) not in turned})
    session = {"tasks": added, "wall_seconds": seconds, **({"methods": methods} if methods else {}),
               **({"replaced": list(exp.replaced)} if exp.replaced else {}),
               **({"narrowed": [f"{t} {m}" for t, m in sorted(turned)]} if turned else {}),
               "fingerprint": manifest["fingerprint"]}
    manifest["sessions"] = [*history, session]
    manifest["wall_seconds"] = round(sum(h["wall_seconds"] or 0.0 for h in manifest["sessions"]), 1)
    return table, pd.concat([real, copies], ignore_index=True), manifest


def collect(results: Any, expected: list[TrialSpec], retries: dict[str, int] | None = None,
            identities: list[tuple[str, str, str]] | None = None,
            kept: pd.DataFrame | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Join the trials' rows; a trial Ray could not finish is listed with status `error`, never dropped.

    `retries` counts, per trial, how often Tune restarted it after its worker failed (this session).
    `identities` are (task, cell, method) where the method does not change the task's trainer: their rows
    are copies of the baseline's, marked `acts` False (real runs carry `acts` True).
    `kept`: the rows an extended folder already holds; they join the table (and lend their baselines to
    identities), and the trial list covers only this session's trials and identities.
    """
    frames, status = [], {}
    for result in results:
        t = result.config["trial"]
        key = f"{t['task']}|{t['method']}|{t['seed']}|{cell_name(t.get('knobs', ()))}"
        if result.checkpoint is None:
            status[key] = ("error", str(result.error).splitlines()[0] if result.error else "no result", math.nan, "")
            continue
        with result.checkpoint.as_directory() as d:
            frame = pd.read_parquet(Path(d) / "rows.parquet")
        # real runs carry `acts` True; set on each small frame, since inserting a column into the joined table
        # (hundreds of dtype blocks) draws pandas' PerformanceWarning at the end of every sweep
        frames.append(frame.assign(acts=True))
        st = "diverged" if (frame["status"] == "diverged").any() else "ok"
        errors = [e for e in frame["error"].unique() if e]
        status[key] = (st, errors[0] if errors else "", result.metrics.get("seconds", math.nan),
                       result.metrics.get("machine", ""))
    rows = []
    for spec in expected:
        st, err, secs, machine = status.get(spec.key, ("missing", "trial not in the Tune results", math.nan, ""))
        rows.append({**asdict(spec), "detectors": ",".join(spec.detectors), "knobs": cell_name(spec.knobs),
                     "status": st, "error": err,
                     "seconds": secs, "retries": (retries or {}).get(spec.key, 0), "machine": machine})
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if kept is not None:
        table = pd.concat([kept, table], ignore_index=True)
    if not table.empty:
        copies = []
        for task_ref, cell, method_ref in identities or ():
            base = table[(table["task_ref"] == task_ref) & (table["cell"] == cell) & (table["method"] == "baseline")]
            name = registry.method_name(method_ref)
            knobs = next((t.knobs for t in expected if t.task == task_ref and cell_name(t.knobs) == cell), ())
            task = registry.get_task(task_ref, **dict(knobs))
            copies.append(base.assign(method=name, method_ref=method_ref, role=task.role(name), acts=False))
            rows += [{"task": task_ref, "method": method_ref, "seed": int(seed), "tier": base["tier"].iloc[0],
                      "knobs": cell, "status": "identity", "error": "", "seconds": 0.0, "retries": 0, "machine": ""}
                     for seed in sorted(base["seed"].unique())]
        table = tidy(pd.concat([table, *copies], ignore_index=True))
    return table, pd.DataFrame(rows)


def tidy(table: pd.DataFrame) -> pd.DataFrame:
    """A canonical row and column order, whatever order Tune returns trials in (a resumed or extended sweep
    included)."""
    table = table.sort_values(["task", "cell", "method", "seed", "variant", "iteration"], kind="stable")
    first = ["task", "method", "role", "acts", "variant", "seed", "iteration", "step", "phase", "return", "entropy"]
    last = ["status", "error", "diverged_at", "task_ref", "cell", "task_version", "family", "method_ref", "tier",
            "onset_iteration", "iterations", "suite_version", "config_hash"]
    middle = sorted(c for c in table.columns if c not in first and c not in last)
    return table[[c for c in first + middle + last if c in table]].reset_index(drop=True)


def write_atomic(table: pd.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    table.to_parquet(tmp, index=False)
    os.replace(tmp, path)
