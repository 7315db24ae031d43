"""``intellect-node runs`` prints what a manifest says (its model name, environment): a manifest's text
is the organiser's word, so terminal controls in it (C0/C1 escapes, bidi overrides) never reach the
terminal."""

from __future__ import annotations

from intellect_node.commands.runs import render


def _row(**over: object) -> dict[str, object]:
    row: dict[str, object] = {"run_id": "r1", "model": "m", "env": "add3", "organiser": "12D3KooWabcd1234",
                              "cid": "bafkreiexample", "nodes": {}, "policy_version": -1, "step": -1,
                              "age_s": 3}
    row.update(over)
    return row


def test_terminal_controls_in_a_manifest_do_not_reach_the_table() -> None:
    hostile = "evil\x1b[2J\x9b31m\u202egnp.exe\u200b\x07"
    out = render([_row(model=hostile, env=hostile, run_id=hostile)])
    for ch in ("\x1b", "\x9b", "\u202e", "\u200b", "\x07"):
        assert ch not in out
    assert "evil" in out and "gnp.exe" in out


def test_a_role_name_from_a_listing_is_cleaned_too() -> None:
    out = render([_row(nodes={"wor\x1b]0;title\x07ker": 2})])
    assert "\x1b" not in out and "\x07" not in out
