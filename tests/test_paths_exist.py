"""Every repository path the docs and the generated files name exists (issue 31: the CRD header and
docs/install.md named operator/vllmfit/core/api.py, which did not exist; a doc cited a path of the
machine it was written on). Checked: README.md, CHANGELOG.md's unreleased part is not (it is history),
docs/*.md, and the generated CRDs. tests/data keeps snapshots of old releases (their own paths)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("operator", "tests", "benchmarks", "docs", "examples", "charts", "crds", "catalog", "e2e", "requirements", ".ci",
       "core", "cli", "agent", "backends", "sources")
PACKAGE = ROOT / "operator" / "vllmfit"
"""Docs also name modules from the package root ('operator/booking/state.py', 'core/spec/api.py')."""
PATH = re.compile(r"(?<![\w./~-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*\w)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
MACHINE = re.compile(r"(?<![\w.>-])/(?:work|home/(?!kubernetes)[a-z]|Users|mnt/data)[\w/.-]*")
"""Paths of someone's machine (a doc or generated file is read in a clone, not on that machine)."""
FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "crds").glob("*.yaml"),
                *(ROOT / "charts" / "vllmfit" / "crds").glob("*.yaml"), ROOT / "charts" / "vllmfit" / "README.md"])


def placeholder(path: str) -> bool:
    """'benchmarks/NAME.py', 'tests/data/vllm-oracle/0.35.0.json' (a version one adds): not a file."""
    return bool(re.search(r"/[A-Z]+\.|/\d+\.\d+\.\d+\.json$", path))


def exists(path: str) -> bool:
    return (ROOT / path).exists() or (PACKAGE / path).exists()


def named(path: Path) -> list[str]:
    text = path.read_text()
    out = [m.rstrip(".") for m in PATH.findall(text) if not placeholder(m)]
    for link in LINK.findall(text):
        if not re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            out.append(str((path.parent / link).resolve().relative_to(ROOT)))
    return out


def test_the_scan_finds_paths() -> None:
    assert sum(len(named(f)) for f in FILES if f.exists()) > 50


@pytest.mark.parametrize("path", [f for f in FILES if f.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_named_exists(path: Path) -> None:
    missing = sorted({p for p in named(path) if not exists(p)})
    assert not missing, f"{path.relative_to(ROOT)} names paths that do not exist: {missing}"
    machine = sorted(set(MACHINE.findall(path.read_text())))
    assert not machine, f"{path.relative_to(ROOT)} names paths of a machine: {machine}"
