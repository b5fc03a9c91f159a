"""What each of issue 29's speed-ups gives, one at a time: a trial with one of them switched back off, against the
trial with all of them, side by side.

    python bench/trial_ablation.py --turns 3 gpt2:entropy-collapse allocator:calibration-collapse ...

A switch turns one change off by restoring the earlier code path in the process (a monkeypatch, so the switch
runs on the code as it is): `gpt2` transformers' own forward for the tiny GPT-2; `gelu` the GELU without its
in-place evaluation path; `allocator` glibc's default thresholds; `lean-adam` `Optimizer.step` / `zero_grad`
instead of `baselines.adam`; `foreach` Adam's default per-parameter loop (and with it `Optimizer.step`), where
the trainers ask for foreach; `room-table` policy-churn's room stepped by MiniGrid; `two-goals-vector`
primacy-bias's worlds in gymnasium's SyncVectorEnv instead of `TwoGoalsVectorEnv`; `two-goals-table` both that and
each world stepped by MiniGrid. Every switch keeps the rows bit for bit (checked here on the
sum of every numeric column). Each run is a fresh process: import, one warm-up trial (seed 1), the measured trial
(seed 0, baseline); turns alternate the order. Reported: the median of each side and of the per-turn ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
switch, task = sys.argv[1], sys.argv[2]
import torch
from stabench.baselines import adam, tokens
from stabench.suite import trial
if switch == "gpt2":
    tokens._plain_gpt2 = lambda model: False
elif switch == "gelu":
    tokens._gelu_new = lambda act, x: act.forward(x)
elif switch == "allocator":
    trial.keep_freed_memory = lambda: None
elif switch == "lean-adam":
    adam.step = lambda opt: opt.step()
    adam.zero_grad = lambda opt: opt.zero_grad(set_to_none=True)
elif switch == "foreach":
    init = torch.optim.Adam.__init__
    def plain(self, params, *args, **kwargs):
        if kwargs.get("foreach"):
            kwargs["foreach"] = None
        init(self, params, *args, **kwargs)
    torch.optim.Adam.__init__ = plain
elif switch == "room-table":
    from stabench.tasks import policy_churn
    policy_churn.make_empty_random_flat = policy_churn.minigrid_empty_random_flat
elif switch in ("two-goals-vector", "two-goals-table"):
    from stabench.tasks import primacy_bias as rc
    from stabench.tasks.worlds import grids
    rc.TwoGoalsVectorEnv = lambda n: grids.make_vector_env(rc.ENV_ID, n)
    if switch == "two-goals-table":
        rc.make_two_goals = rc.minigrid_two_goals
elif switch != "none":
    raise SystemExit(f"unknown switch {switch}")
trial.run_trial(trial.TrialSpec(task, "baseline", 1, "quick"))
start = time.perf_counter()
rows = trial.run_trial(trial.TrialSpec(task, "baseline", 0, "quick"))
seconds = time.perf_counter() - start
print("RESULT " + json.dumps({"trial": seconds, "sum": float(rows.select_dtypes("number").fillna(0).sum().sum())}))
"""


def measure(switch: str, task: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, switch, task], capture_output=True, text=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"{switch} {task}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="+", help="switch:task")
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for case in args.cases:
        switch, task = case.split(":")
        runs: dict[str, list[dict]] = {"none": [], switch: []}
        for turn in range(args.turns):
            for name in (("none", switch) if turn % 2 == 0 else (switch, "none")):
                runs[name].append(measure(name, task))
        off = statistics.median(r["trial"] for r in runs[switch])
        on = statistics.median(r["trial"] for r in runs["none"])
        ratio = statistics.median(a["trial"] / b["trial"] for a, b in zip(runs[switch], runs["none"]))
        same = len({r["sum"] for r in runs["none"] + runs[switch]}) == 1
        rows.append(f"| {switch} | {task} | {off:.2f} | {on:.2f} | {ratio:.2f}x | {'yes' if same else 'NO'} |")
        print(rows[-1], flush=True)
    print("\n| change switched off | task | s/trial without it | s/trial with all | its speed-up | rows equal |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
