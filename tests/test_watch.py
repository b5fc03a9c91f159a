"""`stabench watch`: detectors over a real run's logs (TensorBoard, W&B-shaped CSV and JSONL, verl and TRL names).

Each constructed log holds one diagnostic that jumps at a known step beside others that only wobble (1% of their
level, well inside the built-ins' 5% floor on the warm-up's spread), so an alarm before the jump is a false one."""

import io
import json
import math
from pathlib import Path

import pytest
from stabench.suite import watch
from stabench.suite.cli import main

pytestmark = pytest.mark.smoke

PLUGINS = '''
import math
from stabench import Detector


class NeedsClip(Detector):
    """Reads clip_frac whatever it is asked to watch."""
    name = "needs-clip"
    metric = "clip_frac"

    def update(self, row):
        return float(row.get("clip_frac", math.nan)) > 0.5


class Recorder(Detector):
    """Records every row it is fed; never alarms."""
    name = "recorder"
    seen = []

    def __init__(self, metric):
        self.metric = metric

    @classmethod
    def for_task(cls, task, budget):
        return cls(task.detector.metric)

    def update(self, row):
        Recorder.seen.append(dict(row))
        return False


class Fitted(Detector):
    """A learned detector: it declares a fit step."""
    name = "fitted"
    metric = "entropy"

    @classmethod
    def fit(cls, rows, task, budget):
        return {"level": 0.5}

    def update(self, row):
        return False
'''


def wobble(level: float, step: int, k: int = 1) -> float:
    return level * (1 + 0.01 * math.sin(k * step + k))


def verl_rows(n: int = 40, jump: int = 30, drop: str = "actor/entropy", skip: tuple[str, ...] = ()) -> list[dict]:
    """verl's names (no prefix, as verl logs them to W&B and TensorBoard); `drop` falls to a fifth at `jump`."""
    rows = []
    for s in range(n):
        row = {"actor/entropy": wobble(1.2, s), "actor/pg_clipfrac": wobble(0.004, s, 2),
               "actor/ppo_kl": wobble(0.001, s, 3), "actor/grad_norm": wobble(0.8, s, 4),
               "critic/score/mean": wobble(0.4, s, 5), "critic/rewards/mean": wobble(0.4, s, 5),
               "response_length/mean": wobble(300.0, s, 6), "response_length/clip_ratio": wobble(0.02, s, 7),
               "rollout_corr/kl": wobble(0.002, s, 8), "training/rollout_probs_diff_max": wobble(0.3, s, 9),
               "actor/lr": 1e-6, "timing_s/gen": wobble(30.0, s, 10)}
        if s >= jump:
            row[drop] = row[drop] / 5 if drop == "actor/entropy" else row[drop] * 5
        rows.append({k: v for k, v in row.items() if k not in skip})
    return rows


def trl_rows(n: int = 40, jump: int = 25) -> list[dict]:
    """TRL's GRPO names; clip_ratio/region_mean jumps fifteenfold at `jump`."""
    rows = []
    for s in range(n):
        rows.append({"entropy": wobble(0.9, s), "clip_ratio/region_mean": wobble(0.02, s, 2) * (15 if s >= jump else 1),
                     "clip_ratio/low_mean": wobble(0.01, s, 3), "frac_reward_zero_std": wobble(0.3, s, 4),
                     "sampling/importance_sampling_ratio/mean": wobble(1.0, s, 5), "kl": wobble(0.05, s, 6),
                     "reward": wobble(0.6, s, 7), "completions/mean_length": wobble(180.0, s, 8),
                     "grad_norm": wobble(0.5, s, 9), "learning_rate": 1e-6, "epoch": s / 40})
    return rows


def wandb_records(rows: list[dict], prefix: str = "") -> list[dict]:
    """A W&B history export: `_step`, `_runtime`, `_timestamp`, metric columns (with `prefix`: TRL's `train/`)."""
    return [{"_step": s, "_runtime": 2.0 * s, "_timestamp": 1.7e9 + 2 * s, **{prefix + k: v for k, v in r.items()}}
            for s, r in enumerate(rows)]


def write_csv(path: Path, records: list[dict]) -> Path:
    columns = list(dict.fromkeys(k for r in records for k in r))
    lines = [",".join(columns)]
    lines += [",".join("" if r.get(c) is None else repr(r[c]) for c in columns) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_jsonl(path: Path, records: list[dict], mode: str = "w") -> Path:
    with path.open(mode) as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def write_tensorboard(folder: Path, rows: list[dict]) -> Path:
    """As verl's TensorBoard logger writes (torch's SummaryWriter.add_scalar per key and step: one event per value),
    with TensorBoard's own event writer, which torch's wraps."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    folder.mkdir(parents=True)
    writer = EventFileWriter(str(folder))
    for step, row in enumerate(rows):
        for key, value in row.items():
            writer.add_event(Event(wall_time=1.7e9 + step, step=step,
                                   summary=Summary(value=[Summary.Value(tag=key, simple_value=value)])))
    writer.close()
    return folder


def run_cli(capsys, *argv):
    code = main(["watch", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def alarms(out: str) -> list[tuple[float, str, str, str]]:
    lines = out.strip().splitlines()
    assert lines[0] == "step, detector, diagnostic, value"
    parsed = []
    for line in lines[1:]:
        step, detector, diagnostic, value = line.split(", ")
        parsed.append((float(step), detector, diagnostic, value))
    return parsed


def plugins(tmp_path: Path) -> Path:
    path = tmp_path / "watch_plugins.py"
    path.write_text(PLUGINS)
    return path


def assert_alarms_from(found, diagnostic: str, jump: int) -> None:
    assert found, "no alarm at all"
    assert min(step for step, *_ in found) >= jump, f"an alarm before the jump at {jump}: {found}"
    first = sorted(found)[0]
    assert first[0] == jump and first[2] == diagnostic, found
    assert {det for _, det, diag, _ in found if diag == diagnostic} == {"calibrated-threshold", "cusum",
                                                                        "page-hinkley"}


def test_tensorboard_folder_with_verl_names_alarms_at_the_entropy_drop(capsys, tmp_path):
    write_tensorboard(tmp_path / "tensorboard_log" / "proj" / "exp", verl_rows(jump=30))
    code, out, err = run_cli(capsys, tmp_path / "tensorboard_log")  # the one run below is found
    assert code == 0, err
    assert_alarms_from(alarms(out), "entropy", 30)
    assert "(tensorboard, verl names, 40 steps" in err
    assert "entropy <- actor/entropy (below)" in err and "engine_kl <- rollout_corr/kl (above)" in err


def test_wandb_csv_with_trl_names_alarms_at_the_clip_jump(capsys, tmp_path):
    log = write_csv(tmp_path / "wandb_export.csv", wandb_records(trl_rows(jump=25), prefix="train/"))
    code, out, err = run_cli(capsys, log)
    assert code == 0, err
    assert_alarms_from(alarms(out), "clip_frac", 25)
    assert "(csv, trl names, 40 steps, steps 0-39)" in err
    assert "clip_frac <- train/clip_ratio/region_mean (above)" in err
    assert "zero_variance_share <- train/frac_reward_zero_std" in err and "kl_k3 <- train/kl" in err


def test_wandb_jsonl_with_verl_names_alarms_at_the_sampler_gap(capsys, tmp_path):
    log = write_jsonl(tmp_path / "history.jsonl", wandb_records(verl_rows(jump=20, drop="rollout_corr/kl")))
    code, out, err = run_cli(capsys, log, "--names", "verl", "--detector", "cusum")
    assert code == 0, err
    found = alarms(out)
    assert found and min(s for s, *_ in found) >= 20
    assert sorted(found)[0][:3] == (20, "cusum", "engine_kl")


def test_a_detector_whose_metric_the_log_lacks_is_named_once_and_the_others_run(capsys, tmp_path):
    log = write_jsonl(tmp_path / "history.jsonl",
                      wandb_records(verl_rows(jump=30, skip=("actor/pg_clipfrac",))))
    plugin = plugins(tmp_path)
    code, out, err = run_cli(capsys, log, "--detector", f"{plugin}:NeedsClip", "--detector", "cusum",
                             "--detector", "threshold", "--metric", "entropy", "--threshold", "entropy=0.5")
    assert code == 0, err
    notes = [line for line in err.splitlines() if "needs-clip" in line]
    assert len(notes) == 1 and "needs clip_frac (not in this log; nearest:" in notes[0], err
    assert "cannot run" in notes[0]
    found = alarms(out)
    assert {det for _, det, _, _ in found} == {"cusum", "threshold"}
    assert min(s for s, *_ in found) == 30
    # a watched diagnostic the log lacks: each detector asked to watch it says so, in one line of its own
    code, out, err = run_cli(capsys, log, "--detector", "cusum", "--detector", "page-hinkley",
                             "--metric", "entropy", "--metric", "clip_frac")
    assert code == 0, err
    for name in ("cusum", "page-hinkley"):
        lines = [line for line in err.splitlines() if f": {name}: " in line]
        assert len(lines) == 1 and "needs clip_frac (not in this log" in lines[0], err
    assert {diag for _, _, diag, _ in alarms(out)} == {"entropy"}


def test_a_missing_value_is_fed_as_nan_never_zero(capsys, tmp_path):
    records = wandb_records(trl_rows(n=30, jump=99), prefix="train/")
    for r in records[12:15]:
        r["train/entropy"] = None  # W&B leaves the cell empty where the metric was not logged
    log = write_csv(tmp_path / "export.csv", records)
    plugin = plugins(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    watchers = watch.watch(log, detectors=[f"{plugin}:Recorder", "calibrated-threshold", "cusum", "page-hinkley"],
                           metrics=["entropy"], out=out, err=err)
    recorder = next(w for w in watchers if w.name == "recorder")
    seen = type(recorder.detector).seen
    assert [r["iteration"] for r in seen] == list(range(30))  # every step, in order
    missing = [r["entropy"] for r in seen if r["iteration"] in (12, 13, 14)]
    assert len(missing) == 3 and all(math.isnan(v) for v in missing)
    assert all(r["entropy"] != 0 for r in seen)
    assert alarms(out.getvalue()) == []  # an entropy of 0 would have been a collapse to every detector


def test_follow_feeds_rows_appended_between_polls_and_ctrl_c_exits_0(capsys, tmp_path, monkeypatch):
    rows = wandb_records(verl_rows(n=40, jump=25))
    log = write_jsonl(tmp_path / "live.jsonl", rows[:15])
    half = json.dumps(rows[29]) + "\n"
    out, err = io.StringIO(), io.StringIO()
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:  # the trainer writes while the watch sleeps
        sleeps.append(seconds)
        if len(sleeps) == 1:
            write_jsonl(log, rows[15:29], mode="a")
            with log.open("a") as f:
                f.write(half[:10])  # row 29 is still being written at the next read
        elif len(sleeps) == 2:
            assert sorted(alarms(out.getvalue()))[0][:3] == (25, "cusum", "entropy")  # fed before the run ended
            with log.open("a") as f:
                f.write(half[10:])
            write_jsonl(log, rows[30:], mode="a")

    watchers = watch.watch(log, follow=True, interval=0.5, max_polls=4, detectors=["cusum"], out=out, err=err,
                           sleep=sleep)
    assert sleeps == [0.5, 0.5, 0.5]  # 4 reads: the first and one after each sleep
    assert "40 steps fed" in err.getvalue() and "(4 reads of the log)" in err.getvalue()
    found = alarms(out.getvalue())
    assert sorted(found)[0][:3] == (25, "cusum", "entropy") and min(s for s, *_ in found) == 25
    assert sum(w.alarms for w in watchers) == len(found)

    # Ctrl-C while following: a clean exit 0, the steps read so far fed
    def interrupt(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(watch.time, "sleep", interrupt)
    code, out, err = run_cli(capsys, log, "--follow", "--interval", "0.1", "--detector", "cusum")
    assert code == 0, err
    assert "40 steps fed" in err and "(1 read of the log)" in err
    assert sorted(alarms(out))[0][:3] == (25, "cusum", "entropy")


def test_a_log_the_suite_wrote_hides_what_a_detector_must_not_see(capsys, tmp_path):
    """`stabench tensorboard`'s export of a metrics table: the true return, ground truth and alarms are not fed."""
    import pandas as pd
    from stabench.suite import curves

    rows = []
    for variant in ("injected", "control"):
        for it in range(12):
            shock = variant == "injected" and it >= 6
            rows.append({"task": "toy", "method": "baseline", "seed": 0, "variant": variant, "iteration": it,
                         "step": 10.0 * (it + 1), "return": 0.9 - 0.5 * shock, "entropy": wobble(1.0, it),
                         "grad_norm_total": wobble(0.5, it) * (40 if shock else 1), "w": wobble(0.3, it, 2),
                         "gt_exact": 0.1 * it, "alarm/cusum": shock, "onset_iteration": 6, "iterations": 12})
    curves.export(pd.DataFrame(rows), tmp_path / "tensorboard")
    code, out, err = run_cli(capsys, tmp_path / "tensorboard", "--names", "stabench")
    assert code == 2 and "holds 2 TensorBoard runs" in err and out == ""
    folder = tmp_path / "tensorboard" / "toy" / "baseline" / "seed-0" / "injected"
    plugin = plugins(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    watchers = watch.watch(folder, detectors=[f"{plugin}:Recorder", "cusum"], warmup=3, out=out, err=err)
    assert "(tensorboard, stabench names, 12 steps" in err.getvalue()
    assert "watching entropy (below), grad_norm_total (above)" in err.getvalue()
    seen = type(next(w for w in watchers if w.name == "recorder").detector).seen
    assert seen and all({"grad_norm_total", "w", "step", "entropy"} <= set(r) for r in seen)
    assert not any(k == "return" or k.startswith(("alarm/", "gt_")) for r in seen for k in r)
    assert [r["iteration"] for r in seen] == [i for i in range(12) for _ in range(2)]  # one per diagnostic
    found = alarms(out.getvalue())
    assert sorted(found)[0][:3] == (6, "cusum", "grad_norm_total")  # the shock, not before


def test_on_a_log_the_suite_wrote_the_watch_raises_the_suite_s_own_alarms(capsys, tmp_path):
    """Fed as a trial feeds them: on the export of a run, each built-in raises its alarms at the rows where the
    suite's own replay (what writes a run's alarm/<name> columns) raises them, missing values included."""
    import numpy as np
    import pandas as pd
    from stabench.suite import curves, detectors
    from stabench.suite.api import Budget, DetectorSpec, GroundTruth, Task

    class Shock(Task):
        id, family, trainer = "shock", "grids", "toy"
        budgets = {"quick": Budget(iterations=60, onset=20, seeds=1)}
        ground_truth = GroundTruth("return", 0.5, "below")
        matched_fix, methods, diagnostics = "baseline", ("baseline",), ()
        detector = DetectorSpec("grad_norm_total", 1.6)
        return_floor, return_ceiling = 0.0, 1.0

    rng = np.random.default_rng(0)
    values = np.exp(rng.normal(0.0, 0.2, 60) + np.where(np.arange(60) >= 20, np.linspace(0, 1.5, 60), 0))
    values[[7, 25, 26, 41]] = np.nan  # not logged at these iterations
    frame = pd.DataFrame({"task": "shock", "method": "baseline", "seed": 0, "variant": "injected",
                          "iteration": np.arange(60), "grad_norm_total": values.astype(np.float32).astype(float),
                          "return": 1.0})
    task, budget = Shock(), Shock.budgets["quick"]
    curves.export(frame, tmp_path / "tb")
    refs = ("threshold", "calibrated-threshold", "cusum", "page-hinkley")
    code, out, err = run_cli(capsys, tmp_path / "tb", "--names", "stabench", "--warmup", budget.onset // 2,
                             "--threshold", "grad_norm_total=1.6", *[a for r in refs for a in ("--detector", r)])
    assert code == 0, err
    raised = alarms(out)
    for ref in refs:
        suite = detectors.replay(ref, task, budget, frame, "key")
        edges = [i for i in range(60) if suite[i] and (i == 0 or not suite[i - 1])]
        assert edges, ref
        assert [int(s) for s, det, _, _ in raised if det == ref] == edges, ref


def _file(name: str, text: str):
    def make(folder: Path) -> Path:
        (folder / name).write_text(text)
        return folder / name
    return make


def _folder(folder: Path) -> Path:
    (folder / "runs").mkdir()
    return folder / "runs"


def _trl_csv(folder: Path) -> Path:
    return write_csv(folder / "x.csv", wandb_records(trl_rows(n=5), prefix="train/"))


@pytest.mark.parametrize(("make", "argv", "message"), [
    (lambda p: p / "nowhere", [], "does not exist"),
    (_file("x.csv", "_step,foo,bar\n0,1,2\n"), [], "no metric this watch recognizes"),
    (_file("bad.jsonl", '{"_step": 0, "entropy": 1.0}\n{"_step": 1, "entropy": \n'), [], "malformed JSON on line 2"),
    (_file("bad.csv", "_step,train/entropy\n0,1.0\n1,1.0,7\n"), [], "line 3 has 3 fields"),
    (_file("empty.csv", ""), [], "empty CSV"),
    (_folder, [], "holds no TensorBoard event files"),
    (_file("log.txt", "x"), [], "cannot tell the format"),
    (_trl_csv, ["--format", "xml"], "invalid choice"),
    (_trl_csv, ["--max-polls", "2"], "needs --follow"),
    (_trl_csv, ["--metric", "epoch"], "no known failure side"),
    (_trl_csv, ["--threshold", "kl_k3=big"], "NAME=VALUE"),
    (_trl_csv, ["--threshold", "ratio_max=2"], "is not watched"),
    (_trl_csv, ["--detector", "nope"], "unknown detector"),
    (_trl_csv, ["--warmup", "2"], "at least 3"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_printed(capsys, tmp_path, make, argv, message):
    target = make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    code, out, err = run_cli(capsys, target, *argv)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("stabench: error: ") and message in err, err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


def test_no_detector_that_can_run_is_an_error_after_naming_each(capsys, tmp_path):
    log = write_csv(tmp_path / "x.csv", wandb_records(trl_rows(n=5)))
    code, out, err = run_cli(capsys, log, "--detector", "threshold")
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines[-1] == "stabench: error: no detector can run on this log"
    assert len(lines) == 2 and "threshold: cannot run: needs a fixed threshold for" in lines[0]


def test_a_learned_detector_is_refused_in_one_line_exit_2(capsys, tmp_path):
    """A learned detector is fitted only on other runs than those it alarms on (`suite.crossfit`); a single log holds
    no other run, so the watch refuses it (built-in or plugin) before anything runs, even beside one that can run."""
    log = _trl_csv(tmp_path)
    plugin = plugins(tmp_path)
    for ref, name in (("logistic-z", "logistic-z"), (f"{plugin}:Fitted", "fitted")):
        code, out, err = run_cli(capsys, log, "--detector", "cusum", "--detector", ref)
        assert code == 2 and out == ""
        assert err.splitlines() == [f"stabench: error: detector {name!r} is learned (it declares a fit step): it "
                                    "cannot be cross-fitted on a single log, which holds no other runs to fit it on"]
    assert run_cli(capsys, log, "--detector", "cusum")[0] == 0  # the same watch without it runs


def test_the_name_maps_cover_the_issue_names_and_map_onto_suite_names():
    for name in ("actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "critic/score/mean",
                 "critic/rewards/mean", "response_length/mean", "response_length/clip_ratio", "rollout_corr/kl",
                 "training/rollout_probs_diff_max"):
        assert name in watch.VERL_NAMES
    for name in ("entropy", "clip_ratio/region_mean", "frac_reward_zero_std", "kl", "reward",
                 "completions/mean_length", "grad_norm"):
        assert name in watch.TRL_NAMES
    for table in (watch.VERL_NAMES, watch.TRL_NAMES):
        assert set(table.values()) <= watch.SUITE_COLUMNS
    assert watch.map_names(["train/clip_ratio", "train/clip_ratio/region_mean"], "trl") == {
        "train/clip_ratio/region_mean": "clip_frac", "train/clip_ratio": "clip_ratio"}  # the first in the map wins
    assert watch.choose_names(["train/entropy", "train/kl", "train/reward"], "auto") == "trl"
    assert watch.choose_names(["actor/entropy"], "auto") == "verl"
    assert watch.choose_names(["entropy", "clip_frac", "approx_kl", "alarm/cusum"], "auto") == "stabench"
