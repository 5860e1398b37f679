"""Nothing outside the ledger's module reaches into its private attributes: the search, the
reasons, placing and re-planning read it through its public methods and attributes (`heads`,
`slot`, `free_index`, `group_index`, `node_group_key`, `add_bookings` on a scratch copy), so a
snapshot's sharing and copy-on-write stay the ledger's own business. An AST scan of the whole
package (every `x._name` where `_name` is one of `Ledger`'s private attributes or methods and `x`
is not `self`); it is shown to catch a planted reach."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "operator" / "vllmfit"
LEDGER = PACKAGE / "core" / "placement" / "ledger.py"


def private_names() -> set[str]:
    tree = ast.parse(LEDGER.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Ledger")
    names = {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and f.name.startswith("_")
             and not f.name.startswith("__")}
    names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
              and n.value.id == "self" and n.attr.startswith("_") and not n.attr.startswith("__")}
    return names


def reaches(source: str, names: set[str]) -> list[int]:
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute) and n.attr in names
            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]


def test_nothing_outside_the_ledger_touches_its_private_attributes() -> None:
    names = private_names()
    assert {"_selected", "_slots", "_free", "_changing"} <= names
    found = {str(p.relative_to(PACKAGE)): lines for p in sorted(PACKAGE.rglob("*.py")) if p != LEDGER
             if (lines := reaches(p.read_text(), names))}
    assert found == {}


def test_the_scan_catches_a_reach() -> None:
    assert reaches("def f(ledger):\n    return ledger._slots[k]\n", private_names()) == [2]
