"""The calibration bar, on constructed stabilizer-track rows (no training)."""

import math

from stabench.suite.calibration import verdicts


def _row(method, role, failure, ret, low, high, control_failure=0.0, control_return=0.9):
    return {"task": "t", "method": method, "role": role, "failure_rate": failure, "normalized_return": ret,
            "ci_low": low, "ci_high": high, "control_failure_rate": control_failure,
            "control_normalized_return": control_return}


def _good():
    return [
        _row("baseline", "baseline", 1.0, 0.2, 0.1, 0.3),
        _row("fix", "matched-fix", 0.1, 0.8, 0.7, 0.9),
        _row("no-update", "reference", 1.0, -0.2, -0.3, -0.1),
        _row("frozen-at-onset", "reference", 1.0, 0.0, -0.05, 0.05),
    ]


def test_a_task_that_clears_every_check_meets_the_bar():
    (v,) = verdicts(_good())
    assert v["meets_bar"] and all(v["checks"].values())
    assert v["fix"] == "fix" and v["reference_failure"] == 1.0 and math.isclose(v["reference_return"], 0.0)


def test_each_check_can_fail_on_its_own():
    cases = {
        "references fail": (3, dict(failure_rate=0.5)),
        "references score low": (3, dict(normalized_return=0.5, ci_high=-0.06)),  # not learning nearly wins
        "baseline fails": (0, dict(failure_rate=0.7)),
        "control healthy": (0, dict(control_failure_rate=0.2)),
        "control learns": (0, dict(control_normalized_return=0.5)),
        "fix helps": (1, dict(failure_rate=0.3)),
        "fix interval clear": (1, dict(ci_low=0.25)),
    }
    for check, (index, change) in cases.items():
        rows = _good()
        rows[index] = {**rows[index], **change}
        (v,) = verdicts(rows)
        assert v["checks"][check] is False and not v["meets_bar"], check
        assert all(ok for name, ok in v["checks"].items() if name != check), check


def test_a_fresh_seed_run_is_judged_on_its_failure_rates():
    rows = _good()
    rows[0] = {**rows[0], "control_normalized_return": 0.79}  # fresh seeds: other onset policies, other floor
    (v,) = verdicts(rows)
    assert not v["meets_bar"] and v["meets_rate_checks"]
    rows[1] = {**rows[1], "failure_rate": 0.3}
    (v,) = verdicts(rows)
    assert not v["meets_rate_checks"]


def test_a_run_without_the_references_cannot_meet_the_bar():
    (v,) = verdicts(_good()[:2])
    assert v["checks"]["references fail"] is None and not v["meets_bar"]


def test_score_refuses_runs_that_overlap(capsys):
    from pathlib import Path

    from stabench.suite.cli import main

    run = str(Path(__file__).parent / "data" / "paper_results")
    assert main(["score", run, run, "--calibration"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stabench: error: the runs overlap")
