"""`stabench watch LOGDIR`: the suite's detectors over a real training run's logs.

A real run logs its scalars under its framework's names: verl's `actor/entropy`, TRL's `clip_ratio/region_mean`.
This module reads such a log (a TensorBoard folder of event files, or a CSV or JSONL history such as a W&B export),
maps the names it knows onto the suite's diagnostic names through the declared maps below (`VERL_NAMES`,
`TRL_NAMES`; a log the suite wrote itself keeps its names), and feeds the detectors one step at a time, in step
order, as a trial feeds them (`suite.detectors.replay`): each is built by its own `for_task`, from a stand-in task
whose `DetectorSpec` names the watched diagnostic, its failure side (`WATCH_SIDES`) and, for `threshold`, the value
given with `--threshold`, and from a stand-in budget whose onset is twice `--warmup` (the built-ins learn "healthy"
from the first `max(3, onset // 2)` finite values). The row a detector sees holds `iteration` (the log's step) and
every name of the log, mapped or not, with NaN where the log has no value at that step: a missing value is never
a zero. Never in it, as in the suite: `return`, `gt_*`, `alarm/*`, `knob_*` and the harness's bookkeeping columns.
A learned detector (one that declares a fit step, `suite.crossfit`) is refused: it is only ever fitted on other runs
than the one it watches, and a single log offers none.

Output: one line per alarm raised on stdout, `step, detector, diagnostic, value` (a detector that stays in alarm is
printed again only after it clears); the notes on stderr: what was read and watched, one line per detector that
cannot run (the diagnostic it needs and the log's nearest names), and a summary. `--follow` reads the log again
every `--interval` seconds and feeds only the steps it has not fed; the newest step is held back until a later one
appears (a step whose tags are still being written is not fed half), and fed when the watch ends (Ctrl-C, or
`--max-polls` reads in all). While following, a CSV or JSONL line without its newline is not read yet.
"""

from __future__ import annotations

import difflib
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from stabench.suite.api import LOSS_SCHEMA, Budget, DetectorSpec, GroundTruth, StabenchError, Task

FORMATS: tuple[str, ...] = ("tensorboard", "csv", "jsonl")
NAME_SETS: tuple[str, ...] = ("verl", "trl", "stabench", "auto")

# --- The name maps: a framework's metric name -> the suite's diagnostic name. ---------------------------------
# Where several names of one framework map to one suite name, the first the log has (in the map's order) is used
# and the others stay under their own names. A name no map knows is still fed under its own name (a plugin
# detector may read it), but no built-in watches it unless named with --metric.
#
# verl (volcengine/verl). Sources: verl/trainer/ppo/ray_trainer.py (fit: `actor/entropy` from the old-log-prob
# pass, `training/rollout_probs_diff_*`), verl/workers/actor/dp_actor.py (update_policy: `actor/pg_clipfrac`,
# `actor/ppo_kl`, `actor/pg_loss`, `actor/kl_loss`, `actor/grad_norm`), verl/trainer/ppo/core_algos.py
# (compute_policy_loss), verl/trainer/ppo/metric_utils.py (compute_data_metrics: `critic/*`, `response_length/*`)
# and verl/trainer/ppo/rollout_corr_helper.py (compute_offpolicy_metrics, logged under `rollout_corr/`).
VERL_NAMES: dict[str, str] = {
    # entropy of the policy that generated the batch (the old-log-prob pass), aggregated by loss_agg_mode
    # (token-mean by default); older verl logged the updated policy's entropy under the same name. Assumed to be
    # the suite's `entropy` (the policy that collected the rollout).
    "actor/entropy": "entropy",
    # share of tokens where the clipped term is the larger one (the clip binds: the ratio is outside the band on
    # the side the advantage pushes). ASSUMED comparable: the suite's clip_frac counts every ratio outside the
    # band whatever the advantage's sign, so verl's is at most the suite's.
    "actor/pg_clipfrac": "clip_frac",
    # masked_mean(old_log_prob - log_prob): the k1 estimate of KL(pi_old || pi_theta). ASSUMED comparable: the
    # suite's approx_kl is the k3 estimate of the same KL (k1 can dip below 0).
    "actor/ppo_kl": "approx_kl",
    # the total gradient norm before clipping (clip_grad_norm_), averaged over the step's mini-batches. ASSUMED
    # comparable: the suite's grad_norm_total is the raw gradient's norm on the iteration's last minibatch.
    "actor/grad_norm": "grad_norm_total",
    # the policy term and the reference-KL term (kl_loss_type, before its coefficient): the suite's LOSS_SCHEMA
    "actor/pg_loss": "policy_loss",
    "actor/kl_loss": "kl_loss",
    # mean sequence score of the reward function (token_level_scores summed): the suite's `reward`, the mean
    # reward the learner is paid (never the true return, which a real run does not know)
    "critic/score/mean": "reward",
    # the same after the in-reward KL penalty (equal to the score without use_kl_in_reward): `reward` only where
    # the log has no critic/score/mean
    "critic/rewards/mean": "reward",
    # 1 - Var(returns - values) / (Var(returns) + 1e-5): the suite's value_explained_variance
    "critic/vf_explained_var": "value_explained_variance",
    # mean response length in tokens, and the share of responses at the maximum length: length_mean and
    # length_cap_share (the suite counts answer tokens up to and including EOS, and the share at the cap)
    "response_length/mean": "length_mean",
    "response_length/clip_ratio": "length_cap_share",
    # the training-inference gap on the tokens the rollout engine mu drew, d = log pi_old - log mu, as
    # `suite.diagnostics.engine_gap` computes it: mean(log mu - log pi_old) is engine_kl, mean(exp(d) - d - 1)
    # engine_k3 (verl clamps d at +-20), mean(exp(2 d)) - 1 engine_chi2. Not mapped, no suite equivalent:
    # rollout_corr/{training,rollout}_ppl, log_ppl_*, ppl_ratio, chi2_seq, rollout_is_* and rollout_rs_*.
    "rollout_corr/kl": "engine_kl",
    "rollout_corr/k3_kl": "engine_k3",
    "rollout_corr/chi2_token": "engine_chi2",
    # max |exp(rollout_log_probs) - exp(old_log_probs)| over response tokens: engine_prob_diff_max exactly. Not
    # mapped, no suite equivalent: training/rollout_probs_diff_mean, _std, rollout_actor_probs_pearson_corr.
    "training/rollout_probs_diff_max": "engine_prob_diff_max",
}

# TRL (huggingface/trl). Sources: trl/trainer/grpo_trainer.py (GRPOTrainer._compute_loss: `entropy`, `kl`,
# `clip_ratio/*`; _generate_and_score_completions: `reward`, `frac_reward_zero_std`, `completions/*`,
# `sampling/*`) and transformers' Trainer (`grad_norm`). W&B runs carry them as `train/<name>` (STRIP_PREFIXES).
TRL_NAMES: dict[str, str] = {
    # mean token entropy of the policy being updated (the loss's forward pass). ASSUMED comparable: the suite's
    # `entropy` is that of the policy that sampled the rollout, the same policy on a step's first update.
    "entropy": "entropy",
    # share of completion tokens clipped where the clip binds (low: ratio < 1 - eps_low with A < 0; high: ratio >
    # 1 + eps_high with A > 0; region: either). ASSUMED comparable, as verl's pg_clipfrac: at most the suite's
    # clip_frac. Older TRL logged one `clip_ratio`, used only where the log has no clip_ratio/region_mean.
    "clip_ratio/region_mean": "clip_frac",
    "clip_ratio": "clip_frac",
    # share of completions whose group's rewards have std 0; groups are equal-sized, so it is the share of groups
    # with nothing to compare: the suite's zero_variance_share
    "frac_reward_zero_std": "zero_variance_share",
    # mean per-token k3 estimate of KL(pi_theta || pi_ref), exp(ref - logp) - (ref - logp) - 1 (logged when beta
    # is not 0): the suite's kl_k3 exactly
    "kl": "kl_k3",
    # mean reward of the batch (the weighted sum of the reward functions): the suite's `reward`
    "reward": "reward",
    # mean completion length in tokens, and the share of completions cut at max_completion_length (no EOS):
    # length_mean and length_cap_share
    "completions/mean_length": "length_mean",
    "completions/clipped_ratio": "length_cap_share",
    # the total gradient norm before clipping: grad_norm_total (ASSUMED comparable, as verl's actor/grad_norm)
    "grad_norm": "grad_norm_total",
    # Not mapped, no suite equivalent: sampling/importance_sampling_ratio/{min,mean,max} (exp(old_logp -
    # sampling_logp) capped at vllm_importance_sampling_cap; the suite logs no such ratio, its ratio_* are the
    # update's pi_theta / anchor ratios) and sampling/sampling_logp_difference/{mean,max} (mean |d|, not a KL).
}

NAME_MAPS: dict[str, dict[str, str]] = {"verl": VERL_NAMES, "trl": TRL_NAMES, "stabench": {}}
# Prefixes a logger adds before the framework's own names: transformers' WandbCallback logs `train/<name>`.
STRIP_PREFIXES: tuple[str, ...] = ("train/",)

# The side on which each diagnostic fails, read into the stand-in task's DetectorSpec (`above`): what a run's
# detectors watch when no --metric is given (those of them the log has).
WATCH_SIDES: dict[str, str] = {
    "entropy": "below",  # entropy collapse (TRL #3571: entropy as an early warning)
    "clip_frac": "above",
    "approx_kl": "above",
    "kl_k3": "above",
    "kl_loss": "above",
    "grad_norm_total": "above",
    "engine_kl": "above",
    "engine_k3": "above",
    "engine_chi2": "above",
    "engine_prob_diff_max": "above",
    "length_mean": "above",  # length explosion
    "length_cap_share": "above",
    "zero_variance_share": "above",
    "value_explained_variance": "below",
    "reward": "below",
}
# The suite's own column names (a log the suite wrote, or any log that uses them): what `--names auto` counts to
# recognize a stabench log, beside the map targets.
SUITE_COLUMNS: frozenset[str] = frozenset(WATCH_SIDES) | frozenset(LOSS_SCHEMA) | frozenset({
    "kl_k1", "kl_k2", "kl_full_vocab", "kl_k2_over_k3", "dormant_share", "length_p90", "effective_batch",
    "value_error", "rm_disagreement", "grad_var", "grad_var_rel", "policy_churn", "value_churn", "effective_rank",
    "behaviour_kl", "engine_low_ratio", "ratio_ess", "entropy_trend",
})
# Step columns of a CSV or JSONL history, in order of preference (W&B's `_step` first); a table with none of them
# is read in row order (0, 1, ...). Columns starting with `_` are W&B's bookkeeping, never metrics.
STEP_COLUMNS: tuple[str, ...] = ("_step", "step", "global_step", "train/global_step", "training/global_step",
                                 "iteration")
DEFAULT_WARMUP = 10
DEFAULT_INTERVAL = 10.0


def strip_prefix(name: str) -> str:
    for prefix in STRIP_PREFIXES:
        if name.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix):]
    return name


def hidden(name: str) -> bool:
    """A name no detector sees, as in the suite (`suite.detectors.hidden`, without a task's own privileged
    columns, which a log does not declare): the true return, ground truth, alarms, knobs, bookkeeping."""
    from stabench.suite.detectors import BOOKKEEPING

    return (name in ("return", "iteration") or name.startswith(("gt_", "alarm/", "knob_"))
            or name in BOOKKEEPING)


# --- Reading a log: raw name -> {step: value}. -----------------------------------------------------------------
Series = dict[str, dict[float, float]]


def infer_format(path: Path) -> str:
    if path.is_dir():
        if _event_folders(path):
            return "tensorboard"
        raise StabenchError(f"{path} holds no TensorBoard event files (events.out.tfevents.*); for a CSV or "
                            "JSONL history give the file itself")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "csv"
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if path.name.startswith("events.out.tfevents."):
        return "tensorboard"
    raise StabenchError(f"cannot tell the format of {path} (a folder of event files, .csv, .jsonl or .json lines); "
                        "give --format tensorboard|csv|jsonl")


def _event_folders(path: Path) -> list[Path]:
    return sorted({f.parent for f in path.rglob("events.out.tfevents.*") if f.is_file()})


def tensorboard_folder(path: Path) -> Path:
    """The one folder of event files to read: `path` itself, or the single run below it."""
    if path.is_file():
        return path.parent
    folders = _event_folders(path)
    if not folders:
        raise StabenchError(f"{path} holds no TensorBoard event files (events.out.tfevents.*)")
    if len(folders) > 1:
        shown = ", ".join(str(f.relative_to(path)) or "." for f in folders[:4])
        more = f" and {len(folders) - 4} more" if len(folders) > 4 else ""
        raise StabenchError(f"{path} holds {len(folders)} TensorBoard runs ({shown}{more}); name one of them")
    return folders[0]


def read_tensorboard(path: Path) -> Series:
    """Every scalar of one TensorBoard run, read with TensorBoard's EventAccumulator (nothing sampled away;
    a step logged twice keeps its last value). 0-d tensor summaries (tf.summary.scalar in TF2) count too."""
    import numpy as np
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    folder = tensorboard_folder(path)
    try:
        acc = ea.EventAccumulator(str(folder), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
        acc.Reload()
    except Exception as exc:  # a corrupt file the reader cannot skip
        raise StabenchError(f"{folder}: unreadable TensorBoard events: {type(exc).__name__}: {exc}") from exc
    tags = acc.Tags()
    series: Series = {}
    for tag in tags.get("scalars", []):
        series[tag] = {float(e.step): float(e.value) for e in acc.Scalars(tag)}
    for tag in tags.get("tensors", []):
        if tag in series:
            continue
        values = {}
        for e in acc.Tensors(tag):
            array = tensor_util.make_ndarray(e.tensor_proto)
            if array.size == 1 and np.issubdtype(array.dtype, np.number):
                values[float(e.step)] = float(array.reshape(()))
        if values:
            series[tag] = values
    return series


def _text(path: Path, complete_lines: bool) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise StabenchError(f"cannot read {path}: {exc}") from exc
    if complete_lines and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]  # a line still being written waits for the next read
    return text


def _number(value: Any) -> float:
    """A cell as a float; NaN for an empty cell or anything that is not a number (never 0)."""
    if isinstance(value, bool) or value is None:
        return math.nan
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(str(value).strip())
    except ValueError:
        return math.nan


def _table_series(records: list[dict[str, Any]], where: str) -> Series:
    """Records (one per logged row) -> raw name -> {step: value}; rows of one step are merged, later values win."""
    names = list(dict.fromkeys(k for r in records for k in r))
    step_column = next((c for c in STEP_COLUMNS if c in names), None)
    series: Series = {}
    for index, record in enumerate(records):
        if step_column is None:
            step = float(index)
        else:
            step = _number(record.get(step_column))
            if not math.isfinite(step):
                continue  # a row without a step cannot be placed
        for name, raw in record.items():
            if name == step_column or name.startswith("_"):
                continue
            value = _number(raw)
            if math.isnan(value):
                continue
            series.setdefault(name, {})[step] = value
    if not records:
        raise StabenchError(f"{where} holds no rows")
    return series


def read_csv(path: Path, complete_lines: bool = False) -> Series:
    import csv
    import io

    text = _text(path, complete_lines)
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or not any(rows[0]):
        raise StabenchError(f"{path}: empty CSV (no header row)")
    header = rows[0]
    if len(set(header)) != len(header):
        raise StabenchError(f"{path}: malformed CSV: a column name appears twice in the header")
    records = []
    for number, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) != len(header):
            raise StabenchError(f"{path}: malformed CSV: line {number} has {len(row)} fields, the header "
                                f"{len(header)}")
        records.append(dict(zip(header, row)))
    return _table_series(records, str(path))


def read_jsonl(path: Path, complete_lines: bool = False) -> Series:
    text = _text(path, complete_lines)
    stripped = text.strip()
    if stripped.startswith("["):  # a JSON array of rows (W&B's run.history() saved with to_json(orient="records"))
        try:
            records = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise StabenchError(f"{path}: malformed JSON: {exc}") from exc
        if not all(isinstance(r, dict) for r in records):
            raise StabenchError(f"{path}: malformed JSON: expected an array of objects")
        return _table_series(records, str(path))
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise StabenchError(f"{path}: malformed JSON on line {number}: {exc.msg}") from exc
        if not isinstance(record, dict):
            raise StabenchError(f"{path}: line {number} is not a JSON object")
        records.append(record)
    return _table_series(records, str(path))


def read_log(path: Path, fmt: str, complete_lines: bool = False) -> Series:
    if fmt == "tensorboard":
        return read_tensorboard(path)
    if path.is_dir():
        raise StabenchError(f"--format {fmt} reads a file; {path} is a folder")
    return read_csv(path, complete_lines) if fmt == "csv" else read_jsonl(path, complete_lines)


# --- Names: which framework, and the names a detector sees. ----------------------------------------------------
def _known(names_set: str) -> frozenset[str]:
    return frozenset(NAME_MAPS[names_set]) | SUITE_COLUMNS


def choose_names(raw_names: Iterable[str], names_set: str) -> str:
    """`auto`: the name set under which the log has the most names the set knows (ties: verl, trl, stabench)."""
    if names_set != "auto":
        return names_set
    stripped = [strip_prefix(n) for n in raw_names]
    counts = {s: sum(n in (NAME_MAPS[s] if s != "stabench" else SUITE_COLUMNS) for n in stripped)
              for s in ("verl", "trl", "stabench")}
    best = max(counts, key=lambda s: counts[s])  # the first of the ties, in the order above
    return best if counts[best] else "stabench"


def map_names(raw_names: Iterable[str], names_set: str, keep: Mapping[str, str] | None = None) -> dict[str, str]:
    """Raw name -> the name a detector sees: the map's target for a name it knows (the first the log has, per
    target), else the name with its prefix stripped; hidden names are dropped. `keep` (an earlier read's mapping)
    is kept as it was, so a name a follow picks up later never changes what a watched diagnostic reads."""
    table = NAME_MAPS[names_set]
    raw = list(raw_names)
    mapping: dict[str, str] = dict(keep or {})
    taken = set(mapping.values())
    stripped = {r: strip_prefix(r) for r in raw if r not in mapping}
    for source, target in table.items():
        for r, s in stripped.items():
            if s == source and target not in taken and r not in mapping:
                mapping[r] = target
                taken.add(target)
    for r, s in stripped.items():
        if r in mapping or hidden(s) or s in taken:
            continue
        mapping[r] = s
        taken.add(s)
    return mapping


# --- Detectors over the rows. -----------------------------------------------------------------------------------
class WatchedRun(Task):
    """The stand-in task a detector's `for_task` reads: its `detector` pairing names the watched diagnostic."""

    id = "watch"
    family = "watch"
    trainer = "unknown"
    ground_truth = GroundTruth(metric="return", threshold=math.nan, fails_when="below")
    matched_fix = "baseline"
    methods = ("baseline",)
    diagnostics = ()
    return_floor = 0.0
    return_ceiling = 1.0

    def __init__(self, spec: DetectorSpec, budget: Budget) -> None:
        super().__init__()
        self.detector = spec  # type: ignore[misc]
        self.budgets = {"watch": budget}  # type: ignore[misc]


def watch_budget(warmup: int) -> Budget:
    """A budget whose onset gives the built-ins' warm-up `max(3, onset // 2)` = `warmup` rows with a value."""
    return Budget(iterations=10**9, onset=2 * warmup, seeds=1)


@dataclass
class Watcher:
    """One detector on one diagnostic (or on the whole row: a detector that declares no `metric`)."""

    name: str
    metric: str | None
    detector: Any
    alarmed: bool = False
    alarms: int = 0


@dataclass
class Plan:
    watchers: list[Watcher] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def nearest(name: str, available: Iterable[str], n: int = 3) -> list[str]:
    pool = sorted(set(available))
    close = difflib.get_close_matches(name, pool, n=n, cutoff=0.4)
    if len(close) < n:  # also a name that holds the wanted one, or the other way round (kl in engine_kl)
        close += [p for p in pool if p not in close and (name in p or p in name)][:n - len(close)]
    return close


def _missing_text(metric: str, available: Iterable[str]) -> str:
    near = nearest(metric, available)
    return f"{metric} (not in this log; nearest: {', '.join(near) if near else 'none'})"


def plan(refs: Iterable[str], watched: Mapping[str, bool], thresholds: Mapping[str, float],
         available: Iterable[str], warmup: int, key: str) -> Plan:
    """Build every detector on every watched diagnostic it can run on; one note per detector that cannot run. A
    learned detector is an error, before any is built."""
    from stabench.suite import crossfit, registry

    available = set(available)
    budget = watch_budget(warmup)
    result = Plan()
    classes = [registry.resolve_class("detector", ref) for ref in refs]
    for cls in classes:
        if crossfit.is_learned(cls):
            raise StabenchError(f"detector {cls.name!r} is learned (it declares a fit step): it cannot be cross-fitted "
                                "on a single log, which holds no other runs to fit it on")
    for cls in classes:
        name = cls.name
        if name in registry.SCORED_DETECTORS:
            result.notes.append(f"{name}: cannot run: it is computed from a run's ground truth at scoring time, "
                                "which a log does not have")
            continue
        missing: list[str] = []
        no_threshold: list[str] = []
        built: list[Watcher] = []
        for metric, above in (watched.items() if watched else [("", True)]):
            spec = DetectorSpec(metric=metric, threshold=thresholds.get(metric, math.nan), above=above)
            try:
                detector = cls.for_task(WatchedRun(spec, budget), budget)
            except Exception as exc:
                raise StabenchError(f"detector {name!r}: for_task raised {type(exc).__name__}: {exc}") from exc
            reads = getattr(detector, "metric", None)
            if not isinstance(reads, str):  # reads no one diagnostic (never, always, random-*): the whole row
                built = [Watcher(name, None, detector)]
                break
            if reads != metric:  # the detector chose its own diagnostic: one instance, on it
                if reads in available:
                    built = [Watcher(name, reads, detector)]
                else:
                    missing = [reads]
                break
            if not metric:
                result.notes.append(f"{name}: cannot run: nothing to watch: this log has none of the diagnostics "
                                    f"with a known failure side ({', '.join(WATCH_SIDES)}); name one with "
                                    "--metric NAME:above|below")
                break
            threshold = getattr(detector, "threshold", None)
            if isinstance(threshold, float) and math.isnan(threshold):
                no_threshold.append(metric)
                continue
            if metric not in available:
                missing.append(metric)
                continue
            built.append(Watcher(name, metric, detector))
        for watcher in built:
            if hasattr(watcher.detector, "reseed"):
                watcher.detector.reseed(f"{key}|{watcher.metric or ''}")
        result.watchers += built
        problems = [f"needs {_missing_text(m, available)}" for m in missing]
        if no_threshold:
            problems.append(f"needs a fixed threshold for {', '.join(no_threshold)} "
                            "(give --threshold NAME=VALUE)")
        if problems:
            where = "cannot run" if not built else "cannot run on all it was asked to watch"
            result.notes.append(f"{name}: {where}: {'; '.join(problems)}")
    return result


def default_detectors() -> tuple[str, ...]:
    """The suite's default detectors that read a diagnostic: `never`, `always` and `random-*` anchor the
    score's chance level and alarm whatever the log says; they run only when named."""
    from stabench.suite import registry

    return tuple(d for d in registry.DEFAULT_DETECTORS if d not in ("never", "always")
                 and not d.startswith("random"))


def parse_metric(text: str) -> tuple[str, bool | None]:
    name, _, side = text.rpartition(":") if text.endswith((":above", ":below")) else (text, "", "")
    return name, (None if not side else side == "above")


def parse_threshold(text: str) -> tuple[str, float]:
    name, eq, raw = text.partition("=")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not eq or not name or not math.isfinite(value):
        raise StabenchError(f"--threshold {text!r}: write NAME=VALUE with a finite number, e.g. entropy=0.5")
    return name, value


def _step_text(step: float) -> str:
    return str(int(step)) if float(step).is_integer() else f"{step:g}"


def _value_text(value: Any) -> str:
    try:
        return f"{float(value):.6g}"
    except (TypeError, ValueError):
        return "-"


@dataclass
class Watch:
    """A log being watched: its reads, its mapping, its detectors, and the steps already fed."""

    path: Path
    fmt: str
    names_set: str
    follow: bool
    out: IO[str]
    mapping: dict[str, str] = field(default_factory=dict)
    watchers: list[Watcher] = field(default_factory=list)
    fed: float = -math.inf
    steps: int = 0

    def read(self) -> Series:
        return read_log(self.path, self.fmt, complete_lines=self.follow)

    def rows(self, series: Series) -> tuple[list[float], dict[float, dict[str, float]]]:
        self.mapping = map_names(series, self.names_set, keep=self.mapping)
        names = {raw: self.mapping[raw] for raw in series if raw in self.mapping}
        steps = sorted({s for values in series.values() for s in values})  # a step of any name, even a hidden one
        rows = {}
        for step in steps:
            row: dict[str, float] = {"iteration": step}
            for raw, name in names.items():
                row[name] = series[raw].get(step, math.nan)
            rows[step] = row
        return steps, rows

    def feed(self, series: Series, hold_last: bool) -> None:
        steps, rows = self.rows(series)
        new = [s for s in steps if s > self.fed]
        if hold_last and new:
            new = new[:-1]
        for step in new:
            self._feed_row(step, rows[step])
            self.fed = step

    def _feed_row(self, step: float, row: dict[str, float]) -> None:
        self.steps += 1
        for w in self.watchers:
            try:
                alarm = bool(w.detector.update(dict(row)))
            except Exception as exc:  # the plugin's own code failed: one line naming it and the step
                raise StabenchError(f"detector {w.name!r} raised at step {_step_text(step)}: "
                                    f"{type(exc).__name__}: {exc}") from exc
            if alarm and not w.alarmed:
                w.alarms += 1
                value = row.get(w.metric, math.nan) if w.metric else None
                print(f"{_step_text(step)}, {w.name}, {w.metric or '-'}, "
                      f"{_value_text(value) if w.metric else '-'}", file=self.out, flush=True)
            w.alarmed = alarm


def watch(logdir: str | Path, *, fmt: str | None = None, names: str = "auto", detectors: Iterable[str] = (),
          metrics: Iterable[str] = (), thresholds: Iterable[str] = (), warmup: int = DEFAULT_WARMUP,
          follow: bool = False, interval: float = DEFAULT_INTERVAL, max_polls: int | None = None,
          out: IO[str] | None = None, err: IO[str] | None = None,
          sleep: Callable[[float], None] | None = None) -> list[Watcher]:
    """Run detectors over a log (see the module docstring); returns the watchers (each detector, its diagnostic,
    its alarm count). Errors before anything is fed are one StabenchError line, and nothing is printed."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    sleep = time.sleep if sleep is None else sleep
    if fmt is not None and fmt not in FORMATS:
        raise StabenchError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    if names not in NAME_SETS:
        raise StabenchError(f"unknown name set {names!r}; choose from {', '.join(NAME_SETS)}")
    if warmup < 3:
        raise StabenchError(f"--warmup must be at least 3 (the built-in detectors' smallest window), got {warmup}")
    if interval < 0 or not math.isfinite(interval):
        raise StabenchError(f"--interval must be a number of seconds >= 0, got {interval}")
    if max_polls is not None and (max_polls < 1 or not follow):
        raise StabenchError("--max-polls N needs --follow and N >= 1")
    path = Path(logdir).expanduser()
    if not path.exists():
        raise StabenchError(f"{logdir} does not exist")
    fmt = fmt or infer_format(path)
    series = read_log(path, fmt, complete_lines=follow)
    names_set = choose_names(series, names)
    known = _known(names_set) if names_set != "stabench" else SUITE_COLUMNS
    recognized = [r for r in series if strip_prefix(r) in known]
    if not recognized:
        shown = ", ".join(sorted(series)[:8]) or "none"
        raise StabenchError(f"{path}: no metric this watch recognizes under {names_set} names (the log's names: "
                            f"{shown}); see the name maps in stabench.suite.watch")
    run = Watch(path, fmt, names_set, follow, out)
    steps, _ = run.rows(series)
    available = set(run.mapping.values())
    sides: dict[str, bool] = {}
    for text in metrics:
        name, above = parse_metric(text)
        if above is None:
            if name not in WATCH_SIDES:
                raise StabenchError(f"--metric {name}: no known failure side; write {name}:above or {name}:below")
            above = WATCH_SIDES[name] == "above"
        sides[name] = above
    if not sides:
        sides = {m: side == "above" for m, side in WATCH_SIDES.items() if m in available}
    fixed = dict(parse_threshold(t) for t in thresholds)
    stray = sorted(set(fixed) - set(sides))
    if stray:
        raise StabenchError(f"--threshold {stray[0]}: {stray[0]} is not watched (watched: "
                            f"{', '.join(sides) or 'none'}; add --metric {stray[0]}:above|below)")
    refs = list(detectors) or list(default_detectors())
    planned = plan(refs, sides, fixed, available, warmup, key=f"watch|{path}")
    if not planned.watchers:
        for note in planned.notes:
            print(f"stabench watch: {note}", file=err)
        raise StabenchError("no detector can run on this log")
    run.watchers = planned.watchers
    source = {name: raw for raw, name in run.mapping.items()}
    watched = ", ".join(f"{m}{'' if source.get(m, m) == m else ' <- ' + source[m]} ({'above' if a else 'below'})"
                        for m, a in sides.items() if m in available) or "none"
    span = f"steps {_step_text(steps[0])}-{_step_text(steps[-1])}" if steps else "no steps yet"
    print(f"stabench watch: {path} ({fmt}, {names_set} names, {len(steps)} steps, {span}); warm-up {warmup} "
          f"values; watching {watched}", file=err)
    for note in planned.notes:
        print(f"stabench watch: {note}", file=err)
    print("step, detector, diagnostic, value", file=out, flush=True)
    polls = 1
    try:
        run.feed(series, hold_last=follow)
        while follow and (max_polls is None or polls < max_polls):
            sleep(interval)
            series = run.read()
            polls += 1
            run.feed(series, hold_last=True)
    except KeyboardInterrupt:  # Ctrl-C ends a follow cleanly
        pass
    if follow:
        run.feed(series, hold_last=False)  # the step held back: the watch ends, nothing more will come
    alarms = sum(w.alarms for w in run.watchers)
    print(f"stabench watch: {run.steps} steps fed, {alarms} alarm{'s' if alarms != 1 else ''} raised"
          + (f" ({polls} read{'s' if polls != 1 else ''} of the log)" if follow else ""), file=err)
    return run.watchers


def command(args: Any) -> int:
    """`stabench watch` (suite/cli.py): one StabenchError line and exit 2 for bad input; 0 otherwise."""
    watch(args.logdir, fmt=args.format, names=args.names, detectors=args.detector or (), metrics=args.metric or (),
          thresholds=args.threshold or (), warmup=args.warmup, follow=args.follow, interval=args.interval,
          max_polls=args.max_polls)
    return 0
