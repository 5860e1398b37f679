"""docs/glossary.md defines every term the CLI prints (issue 31): the labels of estimate's tables and
bar legend, plan's legend, the phases, and the header's policy words. A new label without a
glossary entry fails here."""

from __future__ import annotations

import re
from pathlib import Path

from vllmfit.cli.render import layout, terminal
from vllmfit.core import memory
from vllmfit.core.memory import Settings
from vllmfit.sources import catalog

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = (ROOT / "docs" / "glossary.md").read_text().lower()


def defined(term: str) -> bool:
    term = re.sub(r"\s*\(.*?\)$", "", term.strip().removeprefix("= ")).lower()  # 'budget left (budget - footprint)'
    return term in GLOSSARY


def printed_terms() -> list[str]:
    est = memory.estimate(catalog.model("meta-llama/Llama-3.1-8B-Instruct"), memory.default_grant(Settings(
        max_model_len=8192)), catalog.gpu("NVIDIA-L4"))
    terms = [s.label for s in layout.estimate_segments(est)]
    terms += [label for _, label, _, _ in layout.COMPONENTS]
    terms += [str(c) for c in terminal.estimate_table(est).columns[0]._cells]
    terms += [str(c) for c in terminal.vllm_table(est).columns[0]._cells]
    terms += [c.header for c in terminal.estimate_table(est).columns]
    terms += list(terminal.PHASE_STYLE)
    terms += ["foreign use", "budget left", "held back (capacity - budget)", "deployment: name or letter"]
    terms += [f"policy {p}" for p in ("vllm", "adr")] + [f"budget policy {n}" for n in memory.POLICIES] + [
        "budget policy custom", "fits with (each checked)", "flags (if it fit)", "input errors", "kept: from status",
        "max concurrency", "null block", "ceil(T x u)", "GPU KV cache size (null block included)"]
    return [t for t in terms if t and t not in ("GiB", "of capacity", "value", "")]


def test_every_printed_term_is_in_the_glossary() -> None:
    terms = printed_terms()
    assert len(terms) > 30
    missing = sorted({t for t in terms if not defined(t)})
    assert not missing, f"docs/glossary.md lacks: {missing}"


def test_the_readme_links_the_glossary() -> None:
    assert "(docs/glossary.md)" in (ROOT / "README.md").read_text()
