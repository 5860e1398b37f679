"""docs/architecture.md matches the tree, and every room stays small enough to read (issue 20).

- every `vllmfit.x.y` the page names is a module or package that exists;
- every package in the tree is named on the page, so a new room cannot land undocumented;
- no operator or CLI module is over 500 lines, no core module over 450.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "operator" / "vllmfit"
SHELL_MAX_LINES = 500
CORE_MAX_LINES = 450


def named_modules() -> set[str]:
    return set(re.findall(r"`(vllmfit(?:\.[a-z_]+)+)`", DOC.read_text()))


def tree_packages() -> set[str]:
    return {
        "vllmfit." + ".".join(init.parent.relative_to(PACKAGE).parts)
        for init in PACKAGE.rglob("__init__.py")
        if init.parent != PACKAGE
    }


def test_the_page_names_something() -> None:
    # The check below is vacuous if the regular expression stops matching the page.
    assert len(named_modules()) >= 10


@pytest.mark.parametrize("name", sorted(named_modules()))
def test_every_named_module_exists(name: str) -> None:
    assert importlib.util.find_spec(name) is not None, f"docs/architecture.md names {name}, which does not exist"


def test_every_package_is_on_the_page() -> None:
    text = DOC.read_text()
    missing = sorted(p for p in tree_packages() if f"`{p}`" not in text)
    assert not missing, f"packages not described in docs/architecture.md: {missing}"


def module_lines() -> list[tuple[str, int, int]]:
    out = []
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE)
        room = rel.parts[0]
        limit = CORE_MAX_LINES if room == "core" else SHELL_MAX_LINES if room in {"operator", "cli"} else None
        if limit is not None:
            out.append((str(rel), len(f.read_text().splitlines()), limit))
    return out


def test_rooms_stay_small() -> None:
    assert module_lines(), "no module found: the walk is broken"
    over = [f"{name}: {n} lines (at most {limit})" for name, n, limit in module_lines() if n > limit]
    assert not over, "split these modules: " + "; ".join(over)
