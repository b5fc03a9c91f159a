"""Seconds per trial, two versions of the code side by side: `--old` (a Python whose `stabench` is another checkout,
for example a git worktree of the commit before a change) against this one.

    git worktree add /tmp/base HEAD~1 && cp -a .venv /tmp/vbase
    /tmp/vbase/bin/python -m pip install --no-deps -e /tmp/base   # not /tmp/vbase/bin/pip: a copied pip's first
                                                                  # line still names .venv's Python
    python bench/trial_speed.py --old /tmp/vbase/bin/python --turns 3 entropy-collapse policy-churn ...

For each task, `--turns` turns; in each turn both versions run, in alternating order (old first in even turns), each
in a fresh process that imports the suite, runs one warm-up trial (seed 1: first-call costs, warm-start caches) and
then the measured quick-tier trial (seed 0, baseline unless `--method`). The machine's speed drifts on a shared
host, so the table reports the median of each version's turns and the median of the per-turn ratios. Also
reported: the import time and the warm-up (first) trial of each process, the cost a sweep's worker pays once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import stabench.suite.api as api
from stabench.suite.trial import TrialSpec, run_trial
import torch, transformers  # noqa: F401  (what a trial imports)
t1 = time.perf_counter()
run_trial(TrialSpec(sys.argv[1], sys.argv[2], 1, "quick"))
t2 = time.perf_counter()
run_trial(TrialSpec(sys.argv[1], sys.argv[2], 0, "quick"))
t3 = time.perf_counter()
print("RESULT " + json.dumps({"imports": t1 - t0, "first": t2 - t1, "trial": t3 - t2, "source": api.__file__}))
"""


def measure(python: str, task: str, method: str) -> dict:
    out = subprocess.run([python, "-c", CHILD, task, method], capture_output=True, text=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"{python} {task}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tasks", nargs="+")
    parser.add_argument("--old", required=True, help="the Python of the other checkout")
    parser.add_argument("--new", default=sys.executable, help="the Python of this checkout (default: this one)")
    parser.add_argument("--method", default="baseline")
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for task in args.tasks:
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for turn in range(args.turns):
            for name in (("old", "new") if turn % 2 == 0 else ("new", "old")):
                runs[name].append(measure(getattr(args, name), task, args.method))
            print(f"{task} turn {turn + 1}: old {runs['old'][-1]['trial']:.2f} s, new {runs['new'][-1]['trial']:.2f} s",
                  flush=True)
        med = {k: statistics.median(r["trial"] for r in v) for k, v in runs.items()}
        ratio = statistics.median(o["trial"] / n["trial"] for o, n in zip(runs["old"], runs["new"]))
        first = {k: statistics.median(r["first"] for r in v) for k, v in runs.items()}
        imports = {k: statistics.median(r["imports"] for r in v) for k, v in runs.items()}
        rows.append(f"| {task} | {med['old']:.2f} | {med['new']:.2f} | {ratio:.2f}x | {first['old']:.1f} / "
                    f"{first['new']:.1f} | {imports['old']:.1f} / {imports['new']:.1f} |")
    print(f"\nsources: old {runs['old'][0]['source']}, new {runs['new'][0]['source']}; {args.turns} turns, "
          f"method {args.method}, quick tier, one thread")
    print("| task | old s/trial | new s/trial | speed-up (median of turns) | first trial s, old / new | "
          "imports s, old / new |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
