#!/usr/bin/env bash
# Regenerate every committed number on one machine (issue on comparable rows, item 6).
#
#   bash results/regenerate.sh [STEP ...]      steps: check quick matrix tuning tuned calibration grid leaderboard paper
#
# Run it from a clean checkout, installed as the README says, on a quiet 2-core machine, after the last change that
# moves rows: every folder then carries the same machine fingerprint (manifest.json), and `--resume`/`--extend` refuse
# to mix another machine's rows into them. A step writes only its own folders; run the steps in this order (tuned
# reads tuning; leaderboard reads matrix and tuned; paper reads everything). Time on 2 cores, from the last
# regeneration's records (bench/RESULTS.md): quick about 10 min, matrix 2-3 h, tuning about 8 min, tuned about
# 25 min, calibration about 40 min, grid a few minutes, leaderboard about 10 min, paper about 5 min.
#
# The whole takes longer than one sitting, so it is resumable: results/regeneration.json records the machine's
# fingerprint, the commit of the code that moves rows, and each finished step (and each finished method of tuning
# and task of calibration). Run again, the script skips what finished and continues an interrupted matrix or tuned
# run with `--resume`; it refuses to go on on another machine or after
# the code under tasks/, baselines/, suite/ or pyproject.toml changed (start over with REGENERATE_FRESH=1).
# After it: reprint the tables of results/calibration.md (`stabench reprint results/calibration.md` reruns the
# `stabench score` commands written above them), state any verdict within one seed of the bar (`spare seeds` 0)
# there (results/calibration/margins.csv, written here, carries them to `stabench list`, the leaderboard and the
# paper), and re-time the quick tier in bench/RESULTS.md, row 4.
set -euo pipefail
cd "$(dirname "$0")/.."
S="${STABENCH:-.venv/bin/stabench}"
PY="${PYTHON:-.venv/bin/python}"
TUNED_METHODS=(kl-anchor entropy-bonus clip-higher token-tis grad-clip)
MARGINS=results/calibration/margins.csv
STATE=results/regeneration.json
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(check quick matrix tuning tuned calibration grid leaderboard paper)
[ "${REGENERATE_FRESH:-0}" = 1 ] && rm -f "$STATE"

state() {  # begin | done STEP | finished STEP (exit 0 when STEP is recorded finished)
  "$PY" -m stabench.suite.regeneration "$STATE" "$@"
}
state begin

fresh() {  # a folder is replaced whole, never extended across machines
  rm -rf "$1"
}

for step in "${steps[@]}"; do
  if [ "$step" != check ] && state finished "$step"; then
    echo "== $step: finished earlier on this machine ($STATE)"
    continue
  fi
  echo "== $step ($(date -u +%FT%TZ))"
  case "$step" in
    check)
      # the code a Ray worker imports is this checkout's: a worker puts the driver's folder first on its path, so
      # a checkout without its own install (`pip install -e .`) runs another checkout's tasks, silently
      "$PY" -c "import pathlib, stabench.suite as s; f = pathlib.Path(s.__file__).resolve(); \
assert pathlib.Path.cwd().resolve() in f.parents, f'this checkout imports {f}: install it (pip install -e .)'"
      "$S" warm-start  # every shipped warm start matches its declared sha256
      "$PY" -c "from stabench.suite.fingerprint import describe, machine_fingerprint; print(describe(machine_fingerprint()))"
      ;;
    quick)
      fresh results/quick
      "$S" run --tier quick --cpus 2 --out results/quick
      ;;
    matrix)  # an interrupted matrix (a manifest, no table yet) continues where it stopped
      if [ -f results/matrix/manifest.json ] && [ ! -f results/matrix/metrics.parquet ]; then
        "$S" run --tier quick --matrix --seeds 10 --cpus 2 --no-tensorboard --out results/matrix --resume
      else
        fresh results/matrix
        "$S" run --tier quick --matrix --seeds 10 --cpus 2 --no-tensorboard --out results/matrix
      fi
      "$S" score results/matrix --calibration --write-margins "$MARGINS" > /dev/null  # seeds 0-9
      ;;
    tuning)  # method by method; a method finished in an earlier sitting is kept
      for m in "${TUNED_METHODS[@]}"; do
        if state finished "tuning:$m"; then continue; fi
        fresh "results/tuning/$m"
        "$S" tune --method "$m" --budget 4 --seeds 2 --cpus 2
        state done "tuning:$m"
      done
      ;;
    tuned)  # each tuned setting beside its default, the baseline and both references, in one run
      methods="baseline,no-update,frozen-at-onset"
      for m in "${TUNED_METHODS[@]}"; do methods="$methods,$m,$m@tuned"; done
      if [ -f results/tuned/manifest.json ] && [ ! -f results/tuned/metrics.parquet ]; then  # interrupted: go on
        "$S" run --tier quick --seeds 10 --cpus 2 --no-tensorboard --methods "$methods" --out results/tuned --resume
      else
        fresh results/tuned
        "$S" run --tier quick --seeds 10 --cpus 2 --no-tensorboard --methods "$methods" --out results/tuned
      fi
      ;;
    calibration)  # fresh seeds 100-109 for every default task; both seed sets for the experimental ones, whose
      # seeds 0-9 (not in the matrix) run every method the task names and every method a prediction tests on it
      "$PY" - <<'EOF' > /tmp/stabench-calibration-plan.txt
from pathlib import Path
from stabench.suite import fidelity, registry
from stabench.suite.api import REFERENCE_METHODS
predictions = fidelity.read_predictions(Path("paper") / fidelity.PREDICTIONS)[0]
for name in registry.names("task"):
    task = registry.get_task(name)
    tested = [p.method for p in predictions if p.task == task.id and p.testable]
    methods = ",".join(dict.fromkeys(("baseline", *task.methods, *tested, *REFERENCE_METHODS)))
    print(task.id, task.matched_fix, int(task.experimental), methods)
EOF
      while read -r task fix experimental methods; do  # task by task; a task finished in an earlier sitting is kept
        if state finished "calibration:$task"; then continue; fi
        if [ "$experimental" = 1 ]; then
          fresh "results/calibration/$task/seeds-0-9"
          "$S" run --tier quick --tasks "$task" --seeds 10 --cpus 2 --no-tensorboard --methods "$methods" \
            --out "results/calibration/$task/seeds-0-9"
        fi
        fresh "results/calibration/$task/seeds-100-109"
        "$S" run --tier quick --tasks "$task" --seeds 10 --seed-start 100 --cpus 2 --no-tensorboard \
          --methods "baseline,$fix,no-update,frozen-at-onset" --out "results/calibration/$task/seeds-100-109"
        for dir in results/calibration/"$task"/seeds-0-9 results/calibration/"$task"/seeds-100-109; do
          if [ -d "$dir" ]; then "$S" score "$dir" --calibration --write-margins "$MARGINS" > /dev/null; fi
        done
        state done "calibration:$task"
      done < /tmp/stabench-calibration-plan.txt
      ;;
    grid)
      fresh results/staleness-grid
      "$S" run --tier quick --tasks parallel-staleness --methods baseline --grid staleness --seeds 3 --cpus 2 \
        --no-tensorboard --out results/staleness-grid
      ;;
    leaderboard)  # every built-in stabilizer and detector from the matrix, the tuned settings from their run
      rm -f results/leaderboard.csv results/LEADERBOARD.md
      "$S" submit results/matrix
      for m in "${TUNED_METHODS[@]}"; do  # the tuned setting and, for the tuned table's same-run pairing, its default
        name=$("$PY" -c "import json; print(json.load(open('results/tuning/$m/tuning.json'))['setting_ref'])")
        "$S" submit results/tuned --method "$name" --method "$m"
      done
      "$S" verify results/matrix results/tuned
      ;;
    paper)
      "$S" paper
      ;;
    *)
      echo "unknown step $step" >&2
      exit 2
      ;;
  esac
  if [ "$step" != check ]; then state done "$step"; fi
done
