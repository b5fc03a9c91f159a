"""The calibration bar, on constructed stabilizer-track rows (no training)."""

import math

import pytest
from stabench.suite.calibration import binomial_interval, format_markdown, rate_text, verdicts


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


def _counted(rows, n=10, fails=(10, 0, 1, 10, 10)):
    """The rows with failure counts: baseline, control, fix, no-update, frozen-at-onset failures out of n."""
    base, fix, *refs = (dict(r) for r in rows)
    for row, k in zip((base, fix, *refs), (fails[0], fails[2], *fails[3:])):
        row.update(failed_runs=k, runs=n, failure_rate=k / n)
    base.update(control_failed_runs=fails[1], control_runs=n, control_failure_rate=fails[1] / n)
    return [base, fix, *refs]


def test_failure_rates_carry_exact_binomial_intervals():
    low, high = binomial_interval(8, 10)
    assert math.isclose(low, 0.4439045, abs_tol=1e-6) and math.isclose(high, 0.9747893, abs_tol=1e-6)
    assert binomial_interval(0, 10)[0] == 0.0 and binomial_interval(10, 10)[1] == 1.0
    assert rate_text(8, 10) == "8/10 [0.44, 0.97]" and rate_text(0, 0) == "-"


def test_margins_count_the_seeds_to_spare_and_flag_a_verdict_within_one_seed_of_the_bar():
    (v,) = verdicts(_counted(_good()))
    # references 10/10 (>= 8 needed): 2 spare; baseline 10/10: 2; control 0/10 (<= 1): 1; fix 1/10 (<= 2): 1
    assert v["margins"] == {"references fail": 2, "baseline fails": 2, "control healthy": 1, "fix helps": 1}
    assert v["thin"] == []
    (v,) = verdicts(_counted(_good(), fails=(8, 1, 2, 10, 8)))  # each on the bar: one seed more misses
    assert v["margins"] == {"references fail": 0, "baseline fails": 0, "control healthy": 0, "fix helps": 0}
    assert v["thin"] == sorted(v["margins"]) and v["meets_rate_checks"]
    (v,) = verdicts(_counted(_good(), fails=(7, 0, 0, 10, 10)))  # policy-churn's 7/10 misses by one
    assert v["margins"]["baseline fails"] == -1 and not v["meets_rate_checks"]
    (v,) = verdicts(_counted(_good(), fails=(8, 0, 2, 10, 10)))  # the gap to the baseline binds: 8 - 2 = 6
    assert v["margins"]["fix helps"] == 0
    text = format_markdown([v])
    assert "8/10 [0.44, 0.97]" in text and text.rstrip().endswith("| baseline fails, fix helps |")


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


def test_margins_file_keeps_one_row_per_task_and_seed_set_and_names_what_is_thin(tmp_path):
    from stabench.suite.calibration import margin_notes, margin_records, write_margins

    path = tmp_path / "margins.csv"
    good = verdicts(_counted(_good()))
    write_margins(margin_records(good, {"t": "0-9"}), path)
    assert margin_notes(path) == {}  # met with seeds to spare: nothing to say
    thin = verdicts(_counted(_good(), fails=(8, 0, 0, 10, 10)))
    write_margins(margin_records(thin, {"t": "100-109"}), path)
    write_margins(margin_records(thin, {"t": "0-9"}), path)  # replaces the first 0-9 row, keeps 100-109
    assert path.read_text().count("\nt,") == 2
    assert margin_notes(path) == {"t": "seeds 0-9: within one seed of the bar: baseline fails"
                                       " | seeds 100-109: within one seed of the bar: baseline fails"}
    missed = verdicts(_counted(_good(), fails=(7, 0, 0, 10, 10)))
    write_margins(margin_records(missed, {"t": "0-9"}), path)
    assert margin_notes(path)["t"].startswith("seeds 0-9: missed baseline fails")
    assert margin_notes(tmp_path / "absent.csv") == {}
    returns = verdicts(_counted([dict(r, control_normalized_return=0.5) for r in _good()]))
    write_margins(margin_records(returns, {"t": "100-109"}), path)  # fresh seeds: only the rate checks apply
    assert "100-109" not in margin_notes(path)["t"]
    write_margins(margin_records(returns, {"t": "0-9"}), path)
    assert margin_notes(path)["t"] == "seeds 0-9: missed control learns"


def test_write_margins_needs_calibration(tmp_path, capsys):
    from pathlib import Path

    from stabench.suite.cli import main

    run = str(Path(__file__).parent / "data" / "paper_results")
    assert main(["score", run, "--write-margins", str(tmp_path / "m.csv")]) == 2
    assert capsys.readouterr().err.strip() == "stabench: error: --write-margins needs --calibration"
    assert not (tmp_path / "m.csv").exists()


def test_measured_anchors_are_frozen_at_onsets_injected_and_the_baselines_control_means():
    import pandas as pd
    from stabench.suite import calibration

    rows = [("frozen-at-onset", "injected", 0.2), ("frozen-at-onset", "injected", 0.4),
            ("frozen-at-onset", "control", 9.0), ("baseline", "control", 0.7), ("baseline", "control", 0.9),
            ("baseline", "injected", -5.0), ("kl-anchor", "control", 7.0)]
    per_run = pd.DataFrame([{"task": "entropy-collapse", "method": m, "variant": v, "post_onset_return": r}
                            for m, v, r in rows])
    [row] = calibration.measured_anchors(per_run)
    assert row["measured floor"] == pytest.approx(0.3) and row["floor seeds"] == 2
    assert row["measured ceiling"] == pytest.approx(0.8) and row["ceiling seeds"] == 2
    from stabench.tasks.entropy_collapse import EntropyCollapse as Task

    assert (row["return_floor"], row["return_ceiling"]) == (Task.return_floor, Task.return_ceiling)
    assert "| entropy-collapse | " in calibration.format_anchors([row])
