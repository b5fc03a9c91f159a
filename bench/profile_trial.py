"""Where a trial's time goes: py-spy samples one warm quick-tier trial per task, and each sample is put in one bucket.

    python bench/profile_trial.py entropy-collapse policy-churn ...   [--method baseline] [--rate 250]

For each task a child process (under `py-spy record`) imports the suite, runs one trial of seed 1 (the warm-up:
first-call costs, the warm-start cache) and then the measured trial of seed 0, and reports the two wall times and
the import time. Only the measured trial's samples are bucketed, by the first rule that matches its stack:

- copy at onset (`branch_at_onset`), detectors' replay (`suite/detectors.py`), the trial's own tables (pandas);
- diagnostics: `suite/diagnostics.py` called by the run's step (not by a trainer);
- inside the trainer's `iterate`: backward, optimizer (step, zero_grad), environment (gymnasium, MiniGrid, the
  worlds' steps, the task's reward function), rollout (sampling the actions or answers: its forwards included;
  PPO's rollout forwards count as forward), forward (the model's other forwards: the update's and the
  reference's), trainer (other): the loss arithmetic, ratio statistics, the stabilizer hooks' guards, Python;
- outside `iterate`, in the run's `step`: the task's evaluation (held-out enumeration, exact ground truth, the
  row), its environment and its own extra model work.

Needs `pip install py-spy`. py-spy's sampling costs little; the wall times are those of the child with it attached.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import sys, time
t0 = time.perf_counter()
from stabench.suite.trial import TrialSpec, run_trial
import torch, transformers  # noqa: F401  (what a trial imports)
t1 = time.perf_counter()
def warmup(spec): return run_trial(spec)
def measured(spec): return run_trial(spec)
warmup(TrialSpec(sys.argv[1], sys.argv[2], 1, "quick"))
t2 = time.perf_counter()
measured(TrialSpec(sys.argv[1], sys.argv[2], 0, "quick"))
t3 = time.perf_counter()
print(f"TIMES imports={t1 - t0:.2f} warmup={t2 - t1:.2f} trial={t3 - t2:.2f}", flush=True)
"""

BUCKETS = ["forward", "backward", "optimizer", "rollout (sampling)", "environment / reward", "trainer (other)",
           "task evaluation (exact)", "diagnostics", "detectors replay", "copy at onset", "tables (pandas)",
           "other"]


def parse(frame: str) -> tuple[str, str]:
    """'func (path:line)' -> (func, path)."""
    name, _, rest = frame.rpartition(" (")
    return name, rest.rsplit(":", 1)[0]


def env_frame(name: str, path: str, in_trainer: bool) -> bool:
    """A frame of the environment: gymnasium, MiniGrid, a vector env's or a world's step; inside a trainer's
    `iterate` also any task code but a network's (the reward function the trainer calls)."""
    if "gymnasium/" in path or "minigrid/" in path:
        return True
    method = name.rsplit(".", 1)[-1]
    if "tasks/" not in path:
        return False
    return "Env." in name or method in ("step", "reset") or (in_trainer and method not in ("forward", "hidden",
                                                                                            "features"))


def bucket(stack: list[tuple[str, str]]) -> str | None:
    names = [n for n, _ in stack]
    if "measured" not in names:
        return None
    stack = stack[names.index("measured") + 1:]
    names = [n for n, _ in stack]
    files = [f for _, f in stack]
    if "branch_at_onset" in names:
        return "copy at onset"
    if any(f.endswith("suite/detectors.py") for f in files):
        return "detectors replay"
    in_iterate = next((i for i, n in enumerate(names) if n.endswith(".iterate")), None)
    in_step = next((i for i, n in enumerate(names) if n.endswith(".step") and "tasks/" in files[i]), None)
    if in_step is None:
        return "tables (pandas)" if any("pandas/" in f for f in files) else "other"
    # diagnostics called by the run (not by a trainer computing its own extras)
    for i in range(in_step + 1, len(stack)):
        if files[i].endswith("suite/diagnostics.py"):
            if in_iterate is None or i < in_iterate:
                return "diagnostics"
            break
    if in_iterate is None:
        if any(env_frame(n, f, False) for n, f in stack[in_step + 1:]):
            return "environment / reward"
        return "task evaluation (exact)"
    inner = stack[in_iterate + 1:]
    inner_names = [n for n, _ in inner]
    inner_files = [f for _, f in inner]
    if any("backward" in n for n in inner_names):
        return "backward"
    if any(n == "Optimizer.zero_grad" or "torch/optim/" in f or f.endswith("baselines/adam.py") for n, f in inner):
        return "optimizer"
    if any(env_frame(n, f, True) for n, f in inner):
        return "environment / reward"
    if any(n in ("sample_answers", "PPO.sample", "sample") or "rollout" in n.lower() for n in inner_names):
        return "rollout (sampling)"
    if any(f.endswith("torch/nn/modules/module.py") for f in inner_files) or any(
            n in ("lm_logits", "_gpt2_logits", "answer_logits", "token_logp") for n in inner_names):
        return "forward"
    return "trainer (other)"


def profile(task: str, method: str, rate: int) -> tuple[dict[str, float], str, collections.Counter]:
    with tempfile.TemporaryDirectory() as tmp:
        script, raw = Path(tmp) / "child.py", Path(tmp) / "raw.txt"
        script.write_text(CHILD)
        py_spy = Path(sys.executable).with_name("py-spy")
        out = subprocess.run([str(py_spy), "record", "-r", str(rate), "-f", "raw", "-o", str(raw), "--",
                              sys.executable, str(script), task, method], capture_output=True, text=True,
                             check=True)
        times = next(line for line in out.stdout.splitlines() if line.startswith("TIMES"))
        counts: dict[str, float] = collections.Counter()
        leaves: collections.Counter = collections.Counter()
        for line in raw.read_text().splitlines():
            frames, _, n = line.rpartition(" ")
            stack = [parse(f) for f in frames.split(";")]
            b = bucket(stack)
            if b is not None:
                counts[b] += int(n)
                leaves[(b, stack[-1][0], stack[-1][1].split("site-packages/")[-1])] += int(n)
    return counts, times, leaves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tasks", nargs="+")
    parser.add_argument("--method", default="baseline")
    parser.add_argument("--rate", type=int, default=250, help="samples per second (default: 250)")
    parser.add_argument("--leaves", type=int, default=0, help="also print this many top leaf functions")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    header = "| task | trial s | " + " | ".join(BUCKETS) + " |"
    rows = []
    for task in args.tasks:
        start = time.perf_counter()
        counts, times, leaves = profile(task, args.method, args.rate)
        total = sum(counts.values()) or 1
        shares = " | ".join(f"{100 * counts.get(b, 0) / total:.0f}%" for b in BUCKETS)
        trial = times.split("trial=")[1]
        rows.append(f"| {task} | {trial} | {shares} |")
        print(f"{task}: {times} ({time.perf_counter() - start:.0f} s with py-spy)", flush=True)
        for (b, fn, f), n in leaves.most_common(args.leaves):
            print(f"    {100 * n / total:5.1f}%  {b:<24} {fn} ({f})")
    print("\n" + header + "\n|" + "---|" * (len(BUCKETS) + 2))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
