"""A deployment's mark and colour come from its name, not its position (issue 31): adding one
deployment to a plan leaves every other's mark and colour as they were (on old code, a name
sorting first shifted every letter and colour)."""

from __future__ import annotations

from pathlib import Path

from vllmfit.cli import plan as plancmd
from vllmfit.cli.render import layout

ROOT = Path(__file__).resolve().parents[1]


def example_names() -> list[str]:
    p = plancmd.build_plan(plancmd.read_objects(plancmd.read_files([str(ROOT / "examples" / "cluster.yaml")])))
    return sorted(layout.looks(p))


def test_a_newcomer_sorting_first_changes_no_one_elses_look() -> None:
    names = example_names()
    before_c, before_m = layout.palette_colors(names), layout.letters(names)
    newcomer = "aaa/first"  # (a name whose hash meets a taken colour first would move that one on: by design)
    assert newcomer < names[0]  # by position it would have been "A" and the first colour
    after_c, after_m = layout.palette_colors([*names, newcomer]), layout.letters([*names, newcomer])
    assert {k: after_c[k] for k in names} == before_c
    assert {k: after_m[k] for k in names} == before_m
    assert after_m[newcomer] == "F" and after_c[newcomer] not in before_c.values()


def test_looks_do_not_depend_on_order_and_stay_distinct() -> None:
    names = example_names()
    assert layout.palette_colors(names[::-1]) == layout.palette_colors(names)
    assert layout.letters(names[::-1]) == layout.letters(names)
    many = [f"ns/d{i:03d}" for i in range(80)]  # more than PALETTE and than one-character marks
    colours, marks = layout.palette_colors(many), layout.letters(many)
    assert len(set(colours.values())) == len(many) and len(set(marks.values())) == len(many)
    assert layout.letters(["default/llama-8b"]) == {"default/llama-8b": "L"}


def test_marks_never_run_out() -> None:
    """26 letters and 676 pairs hold 702 deployments; the 703rd gets three letters (it waited
    forever for a free pair before)."""
    from vllmfit.cli.render.layout import letters

    keys = [f"ns/d{i:04d}" for i in range(800)]
    marks = letters(keys)
    assert len(set(marks.values())) == 800
    assert all(m.isalpha() and m.isupper() for m in marks.values())
    assert sorted(len(m) for m in marks.values()) == [1] * 26 + [2] * 676 + [3] * 98
