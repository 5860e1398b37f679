"""Test helpers live in the test kits (opkit, bookkit, reservationkit, placement_fakes, ...) or a
conftest: no test module imports another, so each can be read, run and changed on its own."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_test_module_imports_another() -> None:
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [n.module or ""] if isinstance(n, ast.ImportFrom) and not n.level else []
            found += [f"{path.relative_to(TESTS)}:{n.lineno}: {m}" for m in names
                      if m.split(".")[-1].startswith("test_")]
    assert found == []
