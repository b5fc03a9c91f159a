"""README's table of tasks is the registry's (`suite.catalog`): regenerating it changes nothing, and it lists
every registered task with its matched fix."""

import pytest
from stabench.suite import catalog, registry

pytestmark = pytest.mark.smoke


def test_the_readme_table_is_the_generated_one():
    text = catalog.README.read_text()
    table = catalog.markdown(catalog.task_rows())
    assert catalog.with_table(text, table) == text, "README's table of tasks is stale: python -m stabench.suite.catalog"


def test_every_registered_task_is_a_row_with_its_fix():
    rows = catalog.task_rows()
    assert [r["task"].split("`")[1] for r in rows] == registry.names("task")
    for row, name in zip(rows, registry.names("task")):
        cls = registry.resolve_class("task", name)
        assert row["matched fix"] == f"`{cls.matched_fix}`"
        assert ("(experimental)" in row["task"]) == cls.experimental
        assert "`baseline`" not in row["other methods (checks)"]


def test_with_table_replaces_only_what_lies_between_the_markers():
    text = f"before\n{catalog.BEGIN}\nold | table\n{catalog.END}\nafter\n"
    assert catalog.with_table(text, "| new |\n") == f"before\n{catalog.BEGIN}\n| new |\n{catalog.END}\nafter\n"
