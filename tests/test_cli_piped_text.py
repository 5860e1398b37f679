"""Text sent to a pipe or a file: no line continues the one before it (a legend entry, a GPU row,
a flag list is one line), COLUMNS sets the layout's width, marks are capital letters, and the
legend draws no deployment's colour for the components."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllmfit import main as cli
from vllmfit.cli import plan as plancmd
from vllmfit.cli import render
from vllmfit.cli.render import layout

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = [["examples/cluster.yaml"], ["examples/sharing/mixed.yaml"], ["examples/sharing/six-small.yaml"],
            ["examples/cluster.yaml", "examples/llama-70b-too-big.yaml"], ["examples/dra-cluster.yaml"]]


def plan_of(files: list[str]):  # type: ignore[no-untyped-def]
    return plancmd.build_plan(plancmd.read_objects(plancmd.read_files([str(ROOT / f) for f in files])))


def piped(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    got = capsys.readouterr()
    return code, got.out, got.err


@pytest.mark.parametrize("files", EXAMPLES, ids=lambda f: "+".join(Path(x).stem for x in f))
@pytest.mark.parametrize("columns", ["", "80", "120"])
def test_piped_plan_has_no_continuation_lines(files: list[str], columns: str, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    code, out, _ = piped(["plan", *(a for f in files for a in ("-f", str(ROOT / f)))], capsys)
    assert code in (0, 1)
    width = int(columns or 160)
    p = plan_of(files)
    looks = layout.looks(p)
    lines = out.splitlines()
    for line in lines:  # a wrapped table cell starts far to the right; the deepest indent here is a fix's 4
        assert not line.startswith(" " * 5), line
    for key, look in looks.items():  # each key entry: its mark and its name on one line
        assert any(re.search(rf"(^|\s){look.letter}  {re.escape(key)}(\s|$)", ln) for ln in lines), key
    for d in p.decisions.values():  # every flag list whole
        if d.flags is not None and d.admitted:
            assert "  " + " ".join(d.flags.args()) in lines
    for node in p.ledger.nodes:  # the GPU rows and the legend fit COLUMNS
        at = lines.index(layout.node_title(p, node))
        for row in lines[at + 1: at + 1 + len(p.ledger.nodes[node].gpus)]:
            assert row.startswith("GPU") and len(row) <= width, row
    head = lines[: lines.index(layout.node_title(p, min(p.ledger.nodes)))]
    assert all(len(ln) <= width for ln in head), head


def test_a_narrow_pipe_gives_one_legend_entry_per_line(monkeypatch: pytest.MonkeyPatch) -> None:
    items = render.terminal.plain_legend(layout.looks(plan_of(["examples/sharing/mixed.yaml"])), 30)
    text = [t.plain for t in items]
    assert "  ██ weights" in text and "  ░░ held back (capacity - budget)" in text
    assert all(re.fullmatch(r" [A-Z]  apps/\S+", t) for t in text if "apps/" in t)


@pytest.mark.parametrize("files", EXAMPLES, ids=lambda f: "+".join(Path(x).stem for x in f))
def test_marks_are_capital_letters_never_two_alike_by_case(files: list[str]) -> None:
    marks = [lk.letter for lk in layout.looks(plan_of(files)).values()]
    assert all(m.isalpha() and m.isupper() for m in marks), marks
    assert len({m.lower() for m in marks}) == len(marks)


def test_a_name_keeps_its_mark_in_every_plan_it_is_in() -> None:
    a = layout.looks(plan_of(["examples/cluster.yaml"]))
    b = layout.looks(plan_of(["examples/cluster.yaml", "examples/llama-70b-too-big.yaml"]))
    assert {k: lk.letter for k, lk in a.items()} == {k: b[k].letter for k in a}
    many = [f"ns/d{i:03d}" for i in range(80)]
    marks = layout.letters(many)
    assert all(m.isalpha() and m.isupper() for m in marks.values()) and len(set(marks.values())) == 80


def test_the_legend_swatches_are_no_deployments_colour() -> None:
    p = plan_of(["examples/sharing/mixed.yaml"])
    colours = {lk.color for lk in layout.looks(p).values()}
    svg = render.plan_svg(p)
    legend = svg[svg.index('<g class="legend">'):]
    legend = legend[: legend.index("</g>")]
    first = re.findall(r'fill="(#[0-9a-f]{6})" fill-opacity', legend)[:3]
    assert first and not set(first) & colours
    html = render.plan_html(p)
    sw = re.findall(r'class="sw" style="background:(#[0-9a-f]{6});opacity', html)
    assert len(sw) == 3 and not set(sw) & colours
    assert not render.terminal.legend(layout.looks(p)).spans or all(
        not any(c in str(s.style) for c in colours) for s in render.terminal.legend(layout.looks(p)).spans)


@pytest.mark.parametrize("columns", ["80", "300"])
def test_piped_estimate_lines_do_not_depend_on_the_width(columns: str, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    code, out, _ = piped(["estimate", "--model", "llama-3.1-70b", "--gpu", "L4"], capsys)
    assert code == 1
    lines = out.splitlines()
    assert any(ln.startswith("flags (if it fit): --max-model-len=131072 ") for ln in lines)
    assert "  - needs 215.4 GiB per GPU, over the 20.3 GiB of budget left" in lines
    assert not any(ln.startswith(" " * 5) and not set(ln) & set("┃│━") for ln in lines)
