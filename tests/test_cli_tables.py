"""`vllmfit models -o wide` and `gpus -o wide` on an 80-column terminal: every cell whole, one line
a row (issue 24 item 4: the aliases column was cut to "llama-3.1-8b, llama")."""

from __future__ import annotations

import argparse
import io

import pytest
from rich.console import Console

from vllmfit.cli import estimate
from vllmfit.sources import catalog


def _wide(fn, monkeypatch) -> list[str]:  # type: ignore[no-untyped-def]
    buf = io.StringIO()
    real = estimate._print_table
    monkeypatch.setattr(estimate, "_print_table", lambda rows: real(rows, Console(file=buf, width=80)))
    assert fn(argparse.Namespace(output="wide")) == 0
    return buf.getvalue().splitlines()


def test_models_wide_prints_every_alias_whole_on_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = _wide(estimate.run_models, monkeypatch)
    models = list(catalog.models().values())
    assert len(lines) == 2 + len(models)  # header, rule, one line a model: nothing wrapped
    for m, line in zip(models, lines[2:]):
        assert line.startswith(m.name + " ")
        assert line.rstrip().endswith(", ".join(m.aliases)), line  # the last column, whole


def test_gpus_wide_prints_every_alias_whole_on_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = _wide(estimate.run_gpus, monkeypatch)
    gpus = list(catalog.gpus().values())
    assert len(lines) == 2 + len(gpus)
    for g, line in zip(gpus, lines[2:]):
        assert line.startswith(g.product + " ") and g.name in line
        assert line.rstrip().endswith(", ".join(g.aliases)), line
