"""`stabench tune`: a Ray Tune search of one method's settings on tuning seeds, with a stated budget.

Benchmark studies of deep RL name two ways comparisons mislead: a method tuned on the seeds it is scored on, and
methods given unequal tuning budgets (Henderson et al. 2018; Eimer, Lindauer and Raileanu 2023). So a search here
runs only on **tuning seeds**, disjoint from the scoring seeds 0-9 and the fresh-check seeds 100-109 (default
1000 onwards), spends a budget counted in configurations (every method gets the same number), and writes what it
spent beside the setting it chose; the leaderboard then ranks tuned rows only against rows tuned with the same
budget, on the scoring seeds.

The search space is the method's own (`Stabilizer.search_space`, Ray Tune domains). One Tune trial is one
configuration: it runs the method at that setting on every requested task where it acts, over the tuning seeds,
one task per Tune iteration, and reports the leaderboard's aggregate so far (IQM of normalized return of the
injected runs, the tasks where the method does not act counted with the baseline's runs, which are run once up
front; the control runs' IQM, the cost on healthy training, beside it). The search algorithm is Tune's
`BasicVariantGenerator` (random search, seeded; the default setting is its first configuration, so the gain over
the default is measured on the same seeds) and the scheduler ASHA, which stops a configuration early when its
aggregate over the first tasks falls behind the others'. Random search plus ASHA needs no package beyond Ray
Tune, and is a strong baseline for low-dimensional spaces like these (Li et al. 2020).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from stabench.suite import registry
from stabench.suite.api import TIERS, StabenchError

# Seeds nobody may tune on: the leaderboard scores seeds 0-9, calibration's fresh check runs 100-109.
RESERVED_SEEDS: dict[str, range] = {"scoring": range(0, 10), "fresh-check": range(100, 110)}
TUNING_SEED_START = 1000
TUNING_ROOT = Path("results/tuning")
RECORD = "tuning.json"
HISTORY = "history.csv"
# The budget the built-in rows were tuned with (results/tuning/*/tuning.json): a method tuned with the defaults
# is compared with them like with like.
DEFAULT_BUDGET = 4
DEFAULT_SEEDS = 2  # tuning seeds per task
REDUCTION_FACTOR = 3


def seed_text(seeds: Sequence[int]) -> str:
    """`0-9`, `0-4,100-104`: a set of seeds written as runs of consecutive numbers."""
    out: list[str] = []
    ordered = sorted({int(s) for s in seeds})
    start = prev = None
    for seed in [*ordered, None]:
        if start is not None and (seed is None or seed != prev + 1):
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if seed is not None and start is None:
            start = seed
        prev = seed
    return ",".join(out)


def check_tuning_seeds(seeds: Sequence[int]) -> None:
    """Refuse tuning seeds that overlap the seeds the leaderboard scores or calibration's fresh check runs."""
    for what, reserved in RESERVED_SEEDS.items():
        clash = sorted(set(seeds) & set(reserved))
        if clash:
            raise StabenchError(f"tuning seeds {seed_text(clash)} overlap the {what} seeds "
                                f"{reserved.start}-{reserved.stop - 1}: tune on seeds nobody scores on "
                                f"(default --seed-start {TUNING_SEED_START})")


def search_space(cls: type) -> dict[str, Any]:
    """The class's declared space, checked: a non-empty mapping of its own attributes to Ray Tune domains."""
    from ray.tune.search.sample import Domain

    name = getattr(cls, "name", cls.__name__)
    space = getattr(cls, "search_space", None)
    if not isinstance(space, Mapping):
        raise StabenchError(f"malformed search space of {name}: `search_space` must be a dict, got "
                            f"{type(space).__name__}")
    if not space:
        raise StabenchError(f"{name} declares no search space: nothing to tune (give its class a `search_space`, "
                            "for example {'coef': tune.loguniform(0.01, 1.0)})")
    for key, domain in space.items():
        default = getattr(cls, key, None) if isinstance(key, str) else None
        if not isinstance(default, (bool, int, float, str)):
            raise StabenchError(f"malformed search space of {name}: {key!r} is not a setting of the class (a class "
                                "attribute holding its default: a number, bool or string)")
        if not isinstance(domain, Domain):
            raise StabenchError(f"malformed search space of {name}: {key!r} must be a Ray Tune domain "
                                f"(tune.loguniform, tune.uniform, tune.choice, tune.randint, ...), got {domain!r}")
    return dict(space)


def describe(domain: Any) -> str:
    """`loguniform(0.01, 3)`: a Tune domain as one would write it."""
    from ray.tune.search import sample

    if isinstance(domain, sample.Categorical):
        return f"choice({list(domain.categories)})"
    sampler = type(domain.get_sampler()).__name__.lstrip("_") if hasattr(domain, "get_sampler") else ""
    kind = {"LogUniform": "loguniform", "Uniform": "uniform"}.get(sampler, sampler.lower() or type(domain).__name__)
    if isinstance(domain, sample.Integer):
        kind = "randint" if kind == "uniform" else f"{kind} integer"
    lower, upper = getattr(domain, "lower", None), getattr(domain, "upper", None)
    return f"{kind}({lower:g}, {upper:g})" if lower is not None and upper is not None else kind


def describe_space(cls: type) -> str:
    """`coef ~ loguniform(0.01, 3) (default 0.3)`, one entry per setting; '' without a space."""
    space = getattr(cls, "search_space", None) or {}
    return "; ".join(f"{key} ~ {describe(domain)} (default {registry.format_value(getattr(cls, key, None))})"
                     for key, domain in space.items())


def read_record(folder: Path) -> dict:
    """A tuning folder's record, or one clear error."""
    path = folder / RECORD if folder.suffix != ".json" else folder
    if not path.is_file():
        raise StabenchError(f"no tuning record {path}: run `stabench tune` first (or name its folder: M@tuned=DIR)")
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StabenchError(f"cannot read the tuning record {path}: {exc}") from exc
    if not isinstance(record, dict) or not isinstance(record.get("setting"), dict):
        raise StabenchError(f"{path} is not a tuning record (no setting)")
    return record


def resolve_tuned(ref: str) -> tuple[str, dict | None]:
    """`M@tuned` (the record in results/tuning/<M>/) or `M@tuned=DIR` -> (`M@<chosen setting>`, the record);
    any other reference is returned as it is, with no record."""
    plain, text = registry.split_setting(ref)
    if text is None or not (text == "tuned" or text.startswith("tuned=")):
        return ref, None
    name = registry.method_name(plain)
    record = read_record(Path(text[len("tuned="):]) if text.startswith("tuned=") else TUNING_ROOT / name)
    if record.get("method") != name:
        raise StabenchError(f"{ref}: the tuning record is of {record.get('method')!r}, not {name!r}")
    check_tuning_seeds(record.get("tuning_seeds", []))
    resolved = f"{plain}@{registry.setting_text(record['setting'])}"
    registry.method_name(resolved)  # the setting still fits the class
    return resolved, record


def summary(record: dict) -> dict:
    """What a leaderboard row keeps of a tuning record: enough to compare budgets and repeat the search."""
    keys = ("budget", "tier", "tasks", "tuning_seeds", "search", "scheduler", "spent", "tuning_iqm",
            "default_tuning_iqm")
    return {k: record[k] for k in keys if k in record}


def _setting_trainable(config: dict) -> None:
    """One configuration: the method at this setting on each task where it acts (one Tune iteration per task),
    over the tuning seeds; reports the aggregate so far, the runs and the CPU-seconds spent."""
    import numpy as np
    from ray import tune
    from stabench.suite import outcomes, statistics
    from stabench.suite.trial import TrialSpec, run_trial

    job = config["job"]
    setting = {key: config[key] for key in job["keys"]}
    method = f"{job['method']}@{registry.setting_text(setting)}"
    injected = [float(v) for values in job["fixed"].values() for v in values]
    control = [float(v) for values in job["fixed_control"].values() for v in values]
    runs, cpu, failed = 0, 0.0, 0
    for done, task in enumerate(job["tasks"], start=1):
        for seed in job["seeds"]:
            started = time.process_time()
            table = run_trial(TrialSpec(task, method, int(seed), job["tier"], detectors=()))
            cpu += time.process_time() - started
            runs += 1
            per_run = outcomes.outcomes(table)
            for variant, pool in (("injected", injected), ("control", control)):
                values = per_run.loc[per_run["variant"] == variant, "normalized_return"].dropna()
                pool.extend(float(v) for v in values)
            failed += int(per_run.loc[per_run["variant"] == "injected", "failed"].sum())
        tune.report({"iqm": float(statistics.iqm(np.array(injected))) if injected else math.nan,
                     "control_iqm": float(statistics.iqm(np.array(control))) if control else math.nan,
                     "tasks_done": done, "runs": runs, "cpu_seconds": round(cpu, 2),
                     "failure_rate": failed / runs, "setting": registry.setting_text(setting)})


_setting_trainable.__name__ = "stabench_setting"


def _progress_callback(total: int, tasks: int) -> Any:
    from ray import tune

    class Progress(tune.Callback):
        """One line per finished configuration (Tune's own tables are off)."""

        def __init__(self) -> None:
            self.finished = 0

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.finished += 1
            r = trial.last_result or {}
            done = r.get("tasks_done", 0)
            stopped = "" if done == tasks else f"; stopped by ASHA after {done} of {tasks} tasks"
            print(f"[{self.finished:>3}/{total}] {r.get('setting', '?')}: IQM {r.get('iqm', math.nan):.3f} "
                  f"(control {r.get('control_iqm', math.nan):.3f}), {r.get('runs', 0)} runs, "
                  f"{r.get('cpu_seconds', 0):.0f} CPU-s{stopped}", file=sys.stderr, flush=True)

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.finished += 1
            print(f"[{self.finished:>3}/{total}] [error] a configuration failed inside Ray", file=sys.stderr,
                  flush=True)

    return Progress()


def tune_method(method: str, *, tier: str = "quick", tasks: Sequence[str] | None = None,
                budget: int = DEFAULT_BUDGET, seeds: int | None = None, seed_start: int = TUNING_SEED_START,
                out: str | Path | None = None, address: str | None = None, cpus: int | None = None,
                search_seed: int = 0) -> dict:
    """Search `method`'s settings with `budget` configurations on tuning seeds; write OUT/tuning.json and
    OUT/history.csv and return the record. Every check runs before anything is written or started."""
    from stabench.suite import runner  # first: it sets the environment Ray reads when it is imported

    if tier not in TIERS:
        raise StabenchError(f"unknown tier {tier!r}; choose from {', '.join(TIERS)}")
    if budget < 1:
        raise StabenchError(f"--budget must be at least 1 configuration, got {budget}")
    if cpus is not None and cpus < 1:
        raise StabenchError(f"--cpus must be at least 1, got {cpus}")
    if seed_start < 0:
        raise StabenchError(f"--seed-start must be at least 0, got {seed_start}")
    plain, text = registry.split_setting(method)
    if text is not None:
        raise StabenchError(f"tune searches a method's settings: name the method ({plain}), not a setting of it")
    cls = registry.resolve_class("stabilizer", method)
    name = registry.method_name(method)
    space = search_space(cls)
    chosen_tasks = tuple(tasks) if tasks else tuple(
        n for n in registry.names("task") if not registry.get_task(n).experimental)
    task_objs = {t: registry.get_task(t) for t in chosen_tasks}
    n_seeds = seeds if seeds is not None else DEFAULT_SEEDS
    if n_seeds < 1:
        raise StabenchError(f"--seeds must be at least 1, got {n_seeds}")
    tuning_seeds = list(range(seed_start, seed_start + n_seeds))
    check_tuning_seeds(tuning_seeds)
    stabilizer = cls()
    acting = [t for t, task in task_objs.items() if stabilizer.applies_to(task)]
    idle = [t for t in chosen_tasks if t not in acting]
    if not acting:
        raise StabenchError(f"{name} acts on none of the requested tasks: nothing to tune")
    folder = Path(out) if out else TUNING_ROOT / name
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise StabenchError(f"{folder} already holds files; choose another --out")
    if address:
        runner.check_address(address)
    refs = [registry.canonical(t) for t in chosen_tasks]
    canonical = {t: registry.canonical(t) for t in chosen_tasks}
    started = time.time()
    fixed: dict[str, list[float]] = {}
    fixed_control: dict[str, list[float]] = {}
    baseline_runs, baseline_cpu = 0, 0.0
    if idle:  # the tasks where the method does not act score its runs as the baseline's: run those once
        import pandas as pd
        from stabench.suite import outcomes

        spec = runner.ExperimentSpec(tier=tier, tasks=tuple(canonical[t] for t in idle), methods=("baseline",),
                                     seeds=n_seeds, seed_start=seed_start, detectors=())
        exp = runner.prepare(folder / "baseline", spec, resume=False)
        print(f"stabench: the baseline on the {len(idle)} tasks where {name} does not act", file=sys.stderr)
        runner.execute(exp, address=address, num_cpus=cpus, tensorboard=False)
        per_run = outcomes.outcomes(pd.read_parquet(folder / "baseline" / runner.METRICS))
        for variant, pool in (("injected", fixed), ("control", fixed_control)):
            for task, g in per_run[per_run["variant"] == variant].groupby("task"):
                pool[task] = [float(v) for v in g["normalized_return"].dropna()]
        trials = pd.read_csv(folder / "baseline" / runner.TRIALS)
        baseline_runs, baseline_cpu = len(trials), float(trials["seconds"].fillna(0).sum())
    keys = sorted(space)
    default = {key: getattr(cls, key) for key in keys}
    job = {"method": registry.canonical(method), "keys": keys, "tier": tier, "seeds": tuning_seeds,
           "tasks": [canonical[t] for t in acting], "fixed": fixed, "fixed_control": fixed_control}
    grace = 1 if len(acting) < 3 else 2
    results = _search(space, default, job, budget, grace, folder, address, cpus, search_seed)
    history = []
    for result in results:
        metrics = result.metrics or {}
        setting = {key: result.config[key] for key in keys}
        setting = registry.setting_class(plain, registry.setting_text(setting))[1]  # as it ran (rounded)
        history.append({"setting": registry.setting_text(setting), **{f"config/{k}": v for k, v in setting.items()},
                        "iqm": metrics.get("iqm", math.nan), "control_iqm": metrics.get("control_iqm", math.nan),
                        "failure_rate": metrics.get("failure_rate", math.nan),
                        "tasks_done": int(metrics.get("tasks_done", 0)), "runs": int(metrics.get("runs", 0)),
                        "cpu_seconds": float(metrics.get("cpu_seconds", 0.0)),
                        "status": "error" if result.error else ("complete" if metrics.get("tasks_done") == len(acting)
                                                                else "stopped early")})
    complete = [h for h in history if h["status"] == "complete" and not math.isnan(h["iqm"])]
    if not complete:
        raise StabenchError(f"no configuration of {name} finished every task; see {folder / 'tune'}")
    best = max(complete, key=lambda h: h["iqm"])  # the first of equals: the default when nothing beats it
    default_text = registry.setting_text(registry.setting_class(plain, registry.setting_text(default))[1])
    default_row = next((h for h in history if h["setting"] == default_text and h["status"] == "complete"), None)
    from stabench.suite.runner import SUITE_VERSION, library_versions

    record = {
        "method": name, "method_ref": registry.canonical(method),
        "setting": registry.setting_class(plain, best["setting"])[1],
        "setting_ref": f"{registry.canonical(plain)}@{best['setting']}",
        "default": default, "space": {k: describe(v) for k, v in space.items()},
        "budget": budget, "tier": tier, "tasks": refs, "acts_on": [canonical[t] for t in acting],
        "tuning_seeds": tuning_seeds,
        "search": f"random search (ray.tune BasicVariantGenerator, random_state {search_seed}), the default first",
        "scheduler": f"ASHA (one rung per task, grace {grace} tasks, reduction factor {REDUCTION_FACTOR})",
        "objective": "IQM of normalized return of the injected runs over the tasks (the baseline's runs where the "
                     "method does not act); control IQM beside it",
        "tuning_iqm": best["iqm"], "tuning_control_iqm": best["control_iqm"],
        "default_tuning_iqm": default_row["iqm"] if default_row else None,
        "spent": {"configurations": len(history), "runs": sum(h["runs"] for h in history) + baseline_runs,
                  "cpu_seconds": round(sum(h["cpu_seconds"] for h in history) + baseline_cpu, 1),
                  "baseline_runs": baseline_runs, "wall_seconds": round(time.time() - started, 1)},
        "history": history,
        "suite_version": SUITE_VERSION, "libraries": library_versions(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(history).to_csv(folder / HISTORY, index=False)
    (folder / RECORD).write_text(json.dumps(record, indent=2))
    return record


def _search(space: dict, default: dict, job: dict, budget: int, grace: int, folder: Path, address: str | None,
            cpus: int | None, search_seed: int) -> Any:
    """The Ray Tune experiment: random search (the default first) under ASHA, one CPU per configuration."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator
    from stabench.suite.runner import RayCluster

    with RayCluster(address, cpus) as cluster:
        folder.mkdir(parents=True, exist_ok=True)
        n = cluster.cpus()
        print(f"stabench: tuning {job['method']} ({budget} configurations, {len(job['tasks'])} tasks x "
              f"{len(job['seeds'])} tuning seeds each) on {n} CPUs -> {folder}", file=sys.stderr, flush=True)
        tuner = tune.Tuner(
            tune.with_resources(_setting_trainable, {"cpu": 1}),
            param_space={**space, "job": job},
            tune_config=tune.TuneConfig(
                num_samples=budget,
                search_alg=BasicVariantGenerator(points_to_evaluate=[dict(default)], random_state=search_seed,
                                                  max_concurrent=n),
                scheduler=ASHAScheduler(metric="iqm", mode="max", max_t=len(job["tasks"]), grace_period=grace,
                                        reduction_factor=REDUCTION_FACTOR),
                reuse_actors=True),
            run_config=tune.RunConfig(name="tune", storage_path=str(folder.resolve()), verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=1),
                                      callbacks=[_progress_callback(budget, len(job["tasks"]))]),
        )
        return tuner.fit()
