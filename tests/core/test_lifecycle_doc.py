"""docs/lifecycle.md draws exactly the transition table and its deadline actions."""

from pathlib import Path

from core.lifecycle import DEADLINE_ACTIONS, TRANSITIONS, mermaid

DOC = Path(__file__).resolve().parents[2] / "docs" / "lifecycle.md"


def test_the_documented_diagram_is_the_table() -> None:
    assert mermaid() in DOC.read_text(), (
        "regenerate docs/lifecycle.md from core.lifecycle.mermaid()"
    )


def test_the_diagram_has_one_edge_per_transition() -> None:
    edges = [line for line in mermaid().splitlines() if ": " in line]
    assert len(edges) == len(TRANSITIONS)
    for (state, trigger), target in TRANSITIONS.items():
        deadline = " (deadline)" if DEADLINE_ACTIONS.get(state) is trigger else ""
        assert f"    {state.value} --> {target.value}: {trigger.value}{deadline}" in edges


def test_the_diagram_marks_each_deadline_action_once() -> None:
    marked = [line for line in mermaid().splitlines() if line.endswith(" (deadline)")]
    assert sorted(marked) == sorted(
        f"    {state.value} --> {TRANSITIONS[(state, trigger)].value}: {trigger.value} (deadline)"
        for state, trigger in DEADLINE_ACTIONS.items()
    )
