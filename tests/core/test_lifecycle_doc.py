"""docs/lifecycle.md draws exactly the transition table."""

from pathlib import Path

from core.lifecycle import TRANSITIONS, mermaid

DOC = Path(__file__).resolve().parents[2] / "docs" / "lifecycle.md"


def test_the_documented_diagram_is_the_table() -> None:
    assert mermaid() in DOC.read_text(), (
        "regenerate docs/lifecycle.md from core.lifecycle.mermaid()"
    )


def test_the_diagram_has_one_edge_per_transition() -> None:
    edges = [line for line in mermaid().splitlines() if ": " in line]
    assert len(edges) == len(TRANSITIONS)
    for (state, trigger), target in TRANSITIONS.items():
        assert f"    {state.value} --> {target.value}: {trigger.value}" in edges
