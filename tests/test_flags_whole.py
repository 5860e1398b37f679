"""No vLLM flag is ever split: in the terminal at any width, in text sent to a pipe or a
file, and in HTML (where a browser breaks at hyphens: each flag is `white-space: nowrap`)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from vllmfit.cli import plan as plancmd
from vllmfit.cli import render
from vllmfit.cli.output import console

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def example() -> object:
    return plancmd.build_plan(plancmd.read_objects(plancmd.read_files([str(ROOT / "examples" / "cluster.yaml")])))


def all_flags(p: object) -> list[str]:
    out = [a for d in p.decisions.values() if d.flags is not None and d.admitted for a in d.flags.args()]  # type: ignore[attr-defined]
    assert len(out) > 20
    return out


def lines_of(text: str) -> list[str]:
    return text.splitlines()


@pytest.mark.parametrize("width", [40, 80, 120])
def test_a_terminal_of_any_width_prints_each_flag_list_whole(example: object, width: int) -> None:
    buf = io.StringIO()
    render.print_plan(Console(file=buf, width=width, force_terminal=True, color_system=None, soft_wrap=False), example)
    text = buf.getvalue()
    for d in example.decisions.values():  # type: ignore[attr-defined]
        if d.flags is not None and d.admitted:
            assert "  " + " ".join(d.flags.args()) in lines_of(text)  # one line: the terminal folds it, a copy is whole


def test_text_to_a_pipe_or_file_keeps_each_flag_list_on_one_line(example: object) -> None:
    buf = io.StringIO()
    render.print_plan(console(buf), example)
    text = buf.getvalue()
    for d in example.decisions.values():  # type: ignore[attr-defined]
        if d.flags is not None and d.admitted:
            assert "  " + " ".join(d.flags.args()) in lines_of(text)


def test_html_never_breaks_a_flag_or_a_name(example: object) -> None:
    doc = render.plan_html(example)
    assert re.search(r"\.flag,\.name\{white-space:nowrap\}", doc)
    wrapped = set(re.findall(r'<code class="flag">([^<]+)</code>', doc))
    assert set(all_flags(example)) <= wrapped
    for d in example.decisions:  # type: ignore[attr-defined]
        name = re.escape(d).replace("/", "/<wbr>")  # a name breaks after its '/' only
        assert re.search(rf'<span class="name">(<span class="key"[^>]*>[^<]*</span> )?{name}</span>', doc), d


def test_estimate_prints_its_flags_on_one_line_in_a_pipe(capsys: pytest.CaptureFixture[str]) -> None:
    from vllmfit import main as cli

    assert cli.main(["estimate", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "NVIDIA-L4",
                     "--max-model-len", "8192"]) == 0
    out = capsys.readouterr().out
    [line] = [ln for ln in out.splitlines() if ln.startswith("flags: ")]
    assert "--kv-cache-memory-bytes=" in line and "--max-model-len=8192" in line
