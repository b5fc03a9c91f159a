"""`stabench run`'s progress: done/total, rate and ETA as plain lines, and a private Ray that starts quietly."""

import logging
from types import SimpleNamespace

import pytest
from conftest import TOY
from stabench.suite import runner

pytestmark = pytest.mark.smoke


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (12.4, "12s"), (59.6, "1m00s"), (250, "4m10s"),
                                               (3600, "1h00m"), (3900, "1h05m"), (float("nan"), "?")])
def test_durations_are_short(seconds, text):
    assert runner.format_duration(seconds) == text


def test_eta_is_the_trials_left_at_this_sessions_rate():
    # 3 of 12 done in a minute: 3 trials/min, 9 left -> 3 minutes
    assert runner.progress_note(3, 12, 60.0, 3) == "25%, 1m00s elapsed, 3.0 trials/min, ETA 3m00s"
    # a resumed run: 8 were done before this session, 2 finished in 60 s here -> 2/min, 10 left -> 5 minutes
    assert runner.progress_note(10, 20, 60.0, 2) == "50%, 1m00s elapsed, 2.0 trials/min, ETA 5m00s"
    assert runner.progress_note(7, 7, 95.0, 7) == "100%, 1m35s elapsed, done"
    assert runner.progress_note(5, 9, 0.0, 0).endswith("ETA ?")


def trial(method: str, seed: int, status: str = "ok", seconds: float = 2.0):
    return SimpleNamespace(config={"trial": {"task": f"{TOY}:ToyTask", "method": method, "seed": seed, "knobs": []}},
                           last_result={"status": status, "seconds": seconds})


def test_one_plain_line_per_trial_with_done_total_rate_and_eta(capsys):
    now = [100.0]
    progress = runner.ProgressCallback(total=4, already=1, clock=lambda: now[0])  # one finished before a resume
    now[0] += 30.0
    progress.on_trial_complete(0, [], trial("baseline", 0))
    now[0] += 30.0
    progress.on_trial_error(0, [], trial("baseline", 1))
    now[0] += 10.0
    progress.on_trial_complete(0, [], trial("no-update", 0, seconds=0.5))
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "[  2/4] toy baseline seed=0: ok in 2.0 s; 50%, 30s elapsed, 2.0 trials/min, ETA 1m00s",
        f"[  3/4] [error] {TOY}:ToyTask baseline seed=1 failed inside Ray; 75%, 1m00s elapsed, 2.0 trials/min, "
        "ETA 30s",
        "[  4/4] toy no-update seed=0: ok in 0.5 s; 100%, 1m10s elapsed, done",
    ]
    assert not any(c in line for line in lines for c in ("\x1b", "\r"))


class FakeRay:
    """Stands in for `ray.init` / `ray.shutdown`: records the call and, like Ray 2.60 starting a new local
    cluster, logs its token-authentication notice."""

    def __init__(self):
        self.kwargs = None

    def init(self, **kwargs):
        from ray._private.authentication import authentication_token_setup as auth

        self.kwargs = kwargs
        auth._warn_token_auth_enabled()

    def shutdown(self):
        pass


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    fake = FakeRay()
    monkeypatch.setattr(ray, "init", fake.init)
    monkeypatch.setattr(ray, "shutdown", fake.shutdown)
    return fake


def test_the_private_ray_starts_without_dashboard_and_without_the_token_notice(fake_ray, caplog):
    logger = logging.getLogger(runner.QUIET_LOGGERS[0])
    before = logger.level
    with caplog.at_level(logging.WARNING), runner.RayCluster(None, 1):
        pass
    assert fake_ray.kwargs["address"] == "local" and fake_ray.kwargs["include_dashboard"] is False
    assert not [r for r in caplog.records if "Token authentication" in r.getMessage()]
    assert logger.level == before  # only while it starts


def test_a_cluster_given_by_address_keeps_its_own_settings_and_output(fake_ray, caplog):
    with caplog.at_level(logging.WARNING), runner.RayCluster("127.0.0.1:6379", None):
        pass
    assert fake_ray.kwargs["address"] == "127.0.0.1:6379" and "include_dashboard" not in fake_ray.kwargs
    assert [r for r in caplog.records if "Token authentication" in r.getMessage()]
