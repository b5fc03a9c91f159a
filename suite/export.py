"""The leaderboard leaves the repository as more than CSV: JSON for programs (`stabench leaderboard --json`) and
Hugging Face's evaluation-results format (`stabench leaderboard --hf OUT.yaml`) for model cards.

JSON: one object per leaderboard row, its per-task values (the injected runs' normalized return, or the detector
skill score, with the control runs' value and whether the method acts there) and its aggregate and probability of
improvement, each with its 95% interval, and its `rank_band` (`leaderboard.row_bands`: within its like-with-like
group, rows whose intervals overlap, directly or through a chain, share a band and are not ordered; 1 is the top;
null for an unranked row). Numbers are numbers, a missing value is null (never NaN, which JSON lacks).
The leaderboard stores per-task means only; per-task intervals come from the run folder (`stabench score DIR
--json`).

Hugging Face: the model-index of a model card (`huggingface_hub.EvalResult`, the `model-index:` block of a card's
YAML header), one entry per row: per task a result (task type `reinforcement-learning`, dataset `stabench` with the
task as its config and the tier as its split) and one for the aggregate over the common task set, whose metric
`args` carry the interval (`ci_low`, `ci_high`, `confidence`). Written as plain YAML (PyYAML, which Ray already
needs) or JSON; huggingface_hub is not required. Hub's newer `.eval_results/` files name a registered benchmark
dataset and hold a bare value without an interval, so the model-index is the format that keeps the interval.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from stabench.suite.api import StabenchError

HF_SUFFIXES = {".yaml": "yaml", ".yml": "yaml", ".json": "json"}
TASK_TYPE = "reinforcement-learning"
DATASET = "stabench"
METRICS = {  # track -> (metric type, pretty name) of the per-task value and of the aggregate
    "stabilizer": (("normalized_return", "normalized return after onset (injected runs)"),
                   ("iqm_normalized_return", "IQM of normalized return after onset (injected runs)")),
    "detector": (("detector_skill", "detector skill score (100 = oracle, 0 = chance)"),
                 ("mean_detector_skill", "mean detector skill score over tasks (100 = oracle, 0 = chance)")),
}


def _number(text: Any) -> float | None:
    """A CSV cell as a float; None for a missing value ("nan", empty, None)."""
    if text is None or text == "":
        return None
    value = float(text)
    return None if math.isnan(value) else value


def _interval(value: Any, low: Any, high: Any) -> dict[str, float | None]:
    return {"value": _number(value), "ci_low": _number(low), "ci_high": _number(high)}


def json_rows(rows: list[dict]) -> list[dict]:
    """The leaderboard rows as JSON-ready objects (see the module docstring)."""
    from stabench.suite.leaderboard import row_bands

    out = []
    for row, band in zip(rows, row_bands(rows)):
        per, control = json.loads(row["per_task"]), json.loads(row.get("control_per_task") or "{}")
        acts = set(json.loads(row.get("acts_on") or "[]"))
        stabilizer = row["track"] == "stabilizer"
        per_task = {}
        for task in sorted(per):
            cell: dict[str, Any] = {"value": _number(per[task])}
            if stabilizer:
                cell["control"] = _number(control.get(task))
                cell["acts"] = task in acts
            per_task[task] = cell
        out.append({
            "track": row["track"], "name": row["name"], "version": row["version"], "tier": row["tier"],
            "suite_version": row["suite_version"], "date": row["date"], "n_seeds": int(row["n_seeds"]),
            "ranked": row.get("ranked", "yes") == "yes", "rank_band": band,
            "aggregate": _interval(row["aggregate"], row["ci_low"], row["ci_high"]),
            "probability_of_improvement": (_interval(row["poi"], row["poi_ci_low"], row["poi_ci_high"])
                                           if stabilizer else None),
            "per_task": per_task,
            "acts_on": sorted(acts) if stabilizer else None,
            "libraries": json.loads(row["libraries"]), "git_commit": row["git_commit"],
            "fingerprint": json.loads(row.get("fingerprint") or "{}"),  # the run's machine; {} made before it
            "results_digest": row["results_digest"], "row_digest": row["row_digest"],
        })
    return out


def to_json(rows: list[dict], source: str) -> str:
    """`stabench leaderboard --json`: {"leaderboard": source, "confidence": 0.95, "rows": [...]}."""
    return json.dumps({"leaderboard": source, "confidence": 0.95, "rows": json_rows(rows)}, indent=2,
                      allow_nan=False)


def model_index(rows: list[dict]) -> list[dict]:
    """The rows as a Hugging Face model-index: one entry per row, a result per task and one for the aggregate."""
    index = []
    for row in json_rows(rows):
        (metric, label), (agg_metric, agg_label) = METRICS[row["track"]]
        track = f"RL training stability, {row['track']} track"
        split, revision = row["tier"], f"stabench-{row['suite_version']}"
        results = []
        for task, cell in row["per_task"].items():
            if cell["value"] is None:  # a task without a failing run has no detector score
                continue
            metrics = [{"type": metric, "name": label, "value": cell["value"], "args": {"n_seeds": row["n_seeds"]}}]
            if cell.get("control") is not None:
                metrics.append({"type": f"control_{metric}", "name": f"{label.split(' (')[0]} (control runs)",
                                "value": cell["control"], "args": {"n_seeds": row["n_seeds"]}})
            results.append({"task": {"type": TASK_TYPE, "name": track},
                            "dataset": {"type": DATASET, "name": f"stabench {task} ({split} tier)", "config": task,
                                        "split": split, "revision": revision},
                            "metrics": metrics})
        aggregate = row["aggregate"]
        if aggregate["value"] is not None:
            metrics = [{"type": agg_metric, "name": agg_label, "value": aggregate["value"],
                        "args": {"ci_low": aggregate["ci_low"], "ci_high": aggregate["ci_high"], "confidence": 0.95,
                                 "interval": "stratified bootstrap", "n_tasks": len(row["per_task"]),
                                 "ranked": row["ranked"]}}]
            poi = row["probability_of_improvement"]
            if poi and poi["value"] is not None:
                metrics.append({"type": "probability_of_improvement", "name": "P(improve) over the baseline",
                                "value": poi["value"], "args": {"ci_low": poi["ci_low"], "ci_high": poi["ci_high"],
                                                                "confidence": 0.95}})
            # a ranked row covers the common default task set; an unranked one only the tasks it ran on
            config = "default-tasks" if row["ranked"] else "tasks-run"
            label = "default tasks" if row["ranked"] else f"{len(row['per_task'])} tasks it ran on, unranked"
            results.append({"task": {"type": TASK_TYPE, "name": track},
                            "dataset": {"type": DATASET, "name": f"stabench {label} ({split} tier)",
                                        "config": config, "split": split, "revision": revision},
                            "metrics": metrics})
        name = row["name"] if row["version"] == "builtin" else f"{row['name']}-v{row['version']}"
        index.append({"name": name, "results": results})
    return index


def check_hf_path(path: Path) -> str:
    """The format the file's suffix asks for; refuses, before anything is computed, a path it cannot write."""
    kind = HF_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise StabenchError(f"--hf writes .yaml, .yml or .json, not {path.name!r}")
    if path.is_dir():
        raise StabenchError(f"--hf {path} is a folder; name a file")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise StabenchError(f"--hf {path}: {parent} " + ("is not a folder" if parent.exists() else "does not exist"))
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise StabenchError(f"--hf {path}: not writable")
    return kind


def write_hf(rows: list[dict], path: Path, source: str) -> int:
    """Write the model-index to `path` (YAML or JSON by suffix) atomically; returns the number of entries."""
    kind = check_hf_path(path)
    index = model_index(rows)
    header = (f"# stabench leaderboard ({source}) in Hugging Face's model-index format: copy a method's entry into "
              "the YAML header of its model card.\n")
    if kind == "json":
        text = json.dumps({"model-index": index}, indent=2, allow_nan=False) + "\n"
    else:
        import yaml

        text = header + yaml.safe_dump({"model-index": index}, sort_keys=False, allow_unicode=True, width=120)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StabenchError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return len(index)
