"""The docs speak to users: no internal issue numbers in README.md or docs/, an index of docs/ by
task that links every page, and the paths a user is pointed at exist in a clone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TASKS = ("Install", "Your first deployment", "Sharing", "Tenants", "Operations", "Troubleshooting", "Reference")


def test_no_doc_names_an_internal_issue_number() -> None:
    # the count `grep -ci "issue [0-9]" README.md docs/*.md` gives
    found = {str(p.relative_to(ROOT)): n for p in DOCS
             if (n := sum(1 for ln in p.read_text().splitlines() if re.search(r"issue [0-9]", ln, re.IGNORECASE)))}
    assert found == {}, f"lines naming an issue number: {found}"


def test_the_index_is_by_task_and_links_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    headings = re.findall(r"^## (.+)$", index, re.MULTILINE)
    assert [next((t for t in TASKS if h.startswith(t)), h) for h in headings] == list(TASKS)
    linked = set(re.findall(r"\]\(([\w-]+\.md)(?:#[^)]*)?\)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= linked, f"not in docs/README.md: {sorted(pages - linked)}"


def test_the_readme_points_at_the_index() -> None:
    assert "docs/README.md" in (ROOT / "README.md").read_text()


def test_the_calibration_record_is_documented_with_its_example_and_command() -> None:
    doc = (ROOT / "docs" / "calibration.md").read_text()
    example = (ROOT / "examples" / "calibration" / "record.yaml").read_text()
    assert example.strip() in doc  # the format shown is the example file, verbatim
    assert "vllmfit calibration --from-log" in doc and "--calibration examples/calibration/record.yaml" in doc


def test_a_module_path_names_its_package() -> None:
    # `core/memory/kv.py` is no path in a clone; `operator/vllmfit/core/memory/kv.py` is
    short = re.compile(r"`(?!operator/vllmfit/)((?:core|cli|agent|backends|sources|operator)/[a-z_/]*\.py)`")
    found = {str(p.relative_to(ROOT)): short.findall(p.read_text()) for p in DOCS}
    assert not {k: v for k, v in found.items() if v}
