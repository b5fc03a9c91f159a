"""The machine a run was made on: what decides whether its numbers can be reproduced bit for bit.

The same code on another CPU rounds float sums differently, and training amplifies the difference chaotically,
seed by seed: rows are bit-identical only on the same fingerprint, and elsewhere replicate within a tolerance
(README, "Replicating a row"). The fingerprint names what moves floats: the CPU (vendor, model, the kernel set torch
dispatches to), the threads a trial runs on, the torch, Python and OS versions, and the sha256 of every warm start
the package ships (`stabench.tasks/warm_starts/`, found without importing the tasks).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import platform
import sys
from pathlib import Path

import torch

TRIAL_THREADS = 1  # `suite.trial.run_trial` sets one torch thread per trial
WARM_START_FOLDER = "warm_starts"
# The fields two machines must share for their rows to be bit-identical; the versions of the other libraries sit in
# the manifest's `libraries`.
MACHINE_FIELDS = ("cpu_vendor", "cpu_model", "cpu_capability", "threads", "torch", "python", "os")
KEY_FIELDS = tuple(f for f in MACHINE_FIELDS if f != "os")  # the OS release changes no float


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("vendor_id", "model name") and key not in info:
            info[key] = value.strip()
    return info


# path -> ((mtime_ns, size), sha256): a trial's worker computes its fingerprint once per trial, and reads each warm
# start again only when the file changed
_HASHED: dict[str, tuple[tuple[int, int], str]] = {}


def _sha256(path: Path) -> str:
    stat = path.stat()
    stamp = (stat.st_mtime_ns, stat.st_size)
    known = _HASHED.get(str(path))
    if known is None or known[0] != stamp:
        known = (stamp, hashlib.sha256(path.read_bytes()).hexdigest())
        _HASHED[str(path)] = known
    return known[1]


def warm_start_hashes() -> dict[str, str]:
    """sha256 of every warm start the package ships, by file stem (`entropy-collapse`,
    `kl-estimator-bias-reference`)."""
    spec = importlib.util.find_spec("stabench.tasks")
    hashes: dict[str, str] = {}
    for folder in spec.submodule_search_locations if spec and spec.submodule_search_locations else []:
        for path in sorted((Path(folder) / WARM_START_FOLDER).glob("*.safetensors")):
            hashes[path.stem] = _sha256(path)
    return hashes


def machine_fingerprint() -> dict:
    """This machine's fingerprint: a JSON-able dict of MACHINE_FIELDS plus `warm_starts` (file stem -> sha256)."""
    info = _cpuinfo()
    return {
        "cpu_vendor": info.get("vendor_id") or platform.processor() or platform.machine(),
        "cpu_model": info.get("model name") or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": TRIAL_THREADS,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}" if sys.platform != "win32" else platform.platform(),
        "warm_starts": warm_start_hashes(),
    }


def machine_key(fingerprint: dict | None) -> tuple:
    """What must be equal for two runs to be bit-identical (the OS release is left out: it changes no float)."""
    if not fingerprint:
        return ()
    warm = json.dumps(fingerprint.get("warm_starts", {}), sort_keys=True)
    return (*(str(fingerprint.get(f, "")) for f in KEY_FIELDS), warm)


def machine_id(fingerprint: dict | None) -> str:
    """A short name of `machine_key` (12 hex digits; "" for an unknown fingerprint): what `trials.csv` records of the
    machine each trial ran on, equal for two fingerprints exactly when `same_machine` holds."""
    if not fingerprint:
        return ""
    return hashlib.sha256(json.dumps(machine_key(fingerprint)).encode()).hexdigest()[:12]


def differing(a: dict | None, b: dict | None) -> list[str]:
    """The fields of `machine_key` in which two fingerprints differ (`warm_starts` for any warm start)."""
    differ = [f for f in KEY_FIELDS if str((a or {}).get(f, "")) != str((b or {}).get(f, ""))]
    return differ + (["warm_starts"] if (a or {}).get("warm_starts", {}) != (b or {}).get("warm_starts", {}) else [])


def same_machine(a: dict | None, b: dict | None) -> bool:
    """Whether two fingerprints promise bit-identical rows. An unknown (empty) fingerprint matches nothing."""
    return bool(a) and bool(b) and machine_key(a) == machine_key(b)


def describe(fingerprint: dict | None) -> str:
    """One short line: `AMD EPYC (AuthenticAMD, AVX2), 1 thread, torch 2.13.0, Python 3.11.9`; `unknown` if empty."""
    if not fingerprint:
        return "unknown"
    threads = fingerprint.get("threads")
    return (f"{fingerprint.get('cpu_model', '?')} ({fingerprint.get('cpu_vendor', '?')}, "
            f"{fingerprint.get('cpu_capability', '?')}), {threads} thread{'s' if threads != 1 else ''}, "
            f"torch {fingerprint.get('torch', '?')}, Python {fingerprint.get('python', '?')}")
