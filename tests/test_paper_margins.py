"""A task whose committed calibration is thin or missed says so in the paper, where the task is shown."""

import pandas as pd
from stabench.suite import paper


def test_the_paper_states_a_thin_margin_where_it_shows_the_task(monkeypatch):
    note = "seeds 0-9: within one seed of the bar: control healthy"
    monkeypatch.setattr(paper, "margin_notes", lambda: {"dead-layers": note})
    text = paper.task_sections(pd.DataFrame({"task": ["dead-layers", "entropy-collapse"]}), set())
    dead, entropy = text.split("### entropy-collapse")
    assert f"Calibration margin (results/calibration/margins.csv): {note}" in dead
    assert "Calibration margin" not in entropy
