"""The state of a regeneration of every committed number (`results/regenerate.sh`), which outlasts one sitting.

`results/regeneration.json` records the machine's fingerprint, the commit whose code made the rows, and when each
step finished. Going on is allowed only on the same machine and while the code that moves rows is unchanged, so a
regeneration done in several sittings is still one machine's and one code's:

    python -m stabench.suite.regeneration STATE begin            # record, or check that going on is allowed
    python -m stabench.suite.regeneration STATE finished STEP    # exit 0 if STEP finished earlier
    python -m stabench.suite.regeneration STATE done STEP        # record STEP as finished now
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from stabench.suite.fingerprint import describe, machine_fingerprint, same_machine

# What moves rows: a change here between two sittings means starting over (docs and results may change).
CODE_PATHS = ("tasks", "baselines", "suite", "stabench", "pyproject.toml")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], capture_output=True, text=True)


def begin(path: Path) -> str | None:
    """Start the record, or check that an existing one may go on here; the reason it may not, else None."""
    here = machine_fingerprint()
    head = _git("rev-parse", "HEAD").stdout.strip()
    if not path.is_file():
        path.write_text(json.dumps({"fingerprint": here, "machine": describe(here), "commit": head,
                                    "steps": {}}, indent=2) + "\n")
        return None
    old = json.loads(path.read_text())
    if not same_machine(old["fingerprint"], here):
        return (f"{path} was begun on {old['machine']}, this is {describe(here)}: finish it there, or start over "
                "here with REGENERATE_FRESH=1")
    if _git("diff", "--quiet", old["commit"], "HEAD", "--", *CODE_PATHS).returncode:
        return (f"the code under {', '.join(CODE_PATHS)} changed since {old['commit'][:10]}, where this "
                "regeneration began: start over with REGENERATE_FRESH=1")
    return None


def finished(path: Path, step: str) -> bool:
    return path.is_file() and step in json.loads(path.read_text()).get("steps", {})


def done(path: Path, step: str) -> None:
    state = json.loads(path.read_text())
    state["steps"][step] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    path.write_text(json.dumps(state, indent=2) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in ("begin", "finished", "done") or (argv[1] != "begin") != (len(argv) == 3):
        print("usage: python -m stabench.suite.regeneration STATE begin | finished STEP | done STEP", file=sys.stderr)
        return 2
    path, verb = Path(argv[0]), argv[1]
    if verb == "begin":
        reason = begin(path)
        if reason:
            print(f"regenerate: error: {reason}", file=sys.stderr)
            return 2
        return 0
    if verb == "finished":
        return 0 if finished(path, argv[2]) else 1
    done(path, argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
