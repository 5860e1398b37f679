"""The SVG image and the HTML report explain themselves: a title with the cluster summary, a legend,
whole product and MIG labels, a colour per deployment for any count, and the refused deployments
with their grouped reasons. Parsed with xml.etree (SVG) and html.parser (HTML), not matched as text."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

from placement_fakes import H100, L4, LLAMA_8B, MIG, QWEN_05B, node, request

from vllmfit.cli import render
from vllmfit.cli.render import layout
from vllmfit.core import placement

SVG = "{http://www.w3.org/2000/svg}"


def cluster() -> placement.Plan:
    nodes = [node("gpu-a", H100, 2), node("gpu-b", L4, 1),
             placement.NodeInfo("gpu-m", {}, (placement.GpuSlot("gpu-m", 2000, MIG, mig=True),
                                               placement.GpuSlot("gpu-m", 2001, MIG, mig=True)))]
    reqs = [request("team-a/chat", LLAMA_8B, "1", maxModelLen=8192, kvCache={"concurrency": 4}),
            request("team-a/tiny", QWEN_05B, "2", maxModelLen=4096, kvCache={"concurrency": 4}),
            request("team-b/tiny", QWEN_05B, "3", maxModelLen=4096, kvCache={"concurrency": 4}),
            request("team-b/huge", LLAMA_8B, "4", maxModelLen=131072, kvCache={"concurrency": 64}, maxNumBatchedTokens=8192)]
    return placement.plan(nodes, reqs)


def texts(root: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]


def test_svg_has_a_title_with_the_summary_a_legend_whole_labels_and_the_refused() -> None:
    p = cluster()
    root = ET.fromstring(render.plan_svg(p, "my cluster"))
    assert root.tag == f"{SVG}svg"
    lines = texts(root)
    # title and summary: 3 nodes; 2 H100 + 1 L4 + 2 MIG slices = 5 GPUs; 3 admitted, 1 refused
    assert root.find(f"{SVG}title").text.startswith("my cluster: 3 nodes, 5 GPUs (")
    assert lines[0] == "my cluster"
    summary = lines[1]
    assert re.fullmatch(r"3 nodes, 5 GPUs \(\d in use\): used [\d.]+ GiB, budget left [\d.]+ GiB of [\d.]+ GiB; "
                        r"3 admitted, 1 refused", summary), summary
    budget = sum(sl.budget_bytes for sl in p.ledger.slots())
    assert f"of {layout.gib(budget)} GiB;" in summary
    # legend: the components, then every deployment that holds GPUs, with its colour
    legend = root.find(f".//{SVG}g[@class='legend']")
    names = texts(legend)
    assert names[:6] == ["weights", "KV cache", "activation + overhead", "foreign use", "budget left", "held back"]
    assert names[6:] == ["C", "team-a/chat", "T", "team-a/tiny", "I", "team-b/tiny"]  # mark (from the name), name
    swatches = [g.find(f"{SVG}rect").get("fill") for g in legend.iter(f"{SVG}g") if g.get("class") == "key"]
    assert len(set(swatches)) == 3
    # labels: whole product names, MIG profiles included (no "NVIDIA-A100-SXM4-80GB-MI" cut)
    assert "GPU 0 NVIDIA-H100-80GB-HBM3" in lines and "GPU 0 NVIDIA-L4" in lines
    assert f"GPU 1 MIG 0 {MIG.product}" in lines and MIG.product.endswith("3g.40gb")
    # refused: the deployment and its grouped reason
    refused = texts(root.find(f".//{SVG}g[@class='refused']"))
    assert refused[0] == "Refused (1)" and refused[1] == "team-b/huge"
    assert refused[2] == "Unschedulable: 0/3 nodes are available"
    assert all(r in " ".join(refused) for r in p.decisions["team-b/huge"].reasons)
    # the image is wide enough for its longest line (12 px monospace: 7.3 px a character)
    longest = max(len(t) for t in refused)
    assert int(root.get("width")) >= longest * 7


class _Html(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, dict]] = []
        self.found: list[tuple[str, dict, str]] = []  # (tag, attrs, text)

    def handle_starttag(self, tag, attrs):  # type: ignore[no-untyped-def]
        self.stack.append((tag, dict(attrs)))
        self.found.append((tag, dict(attrs), ""))

    def handle_endtag(self, tag):  # type: ignore[no-untyped-def]
        while self.stack and self.stack.pop()[0] != tag:
            pass

    def handle_data(self, data):  # type: ignore[no-untyped-def]
        if self.stack:
            tag, attrs = self.stack[-1]
            self.found.append((tag, attrs, data))


def test_html_has_the_summary_legend_labels_and_refused_list() -> None:
    p = cluster()
    doc = render.plan_html(p, "my cluster")
    h = _Html()
    h.feed(doc)
    text = [(t, a, d) for t, a, d in h.found if d.strip()]
    assert ("title", {}, "my cluster") in text and ("h1", {}, "my cluster") in text
    summary = next(d for t, a, d in text if a.get("class") == "summary")
    assert summary.startswith("3 nodes, 5 GPUs (") and summary.endswith("3 admitted, 1 refused")
    legends = [a.get("title") for t, a, d in h.found if not d and a.get("class") == "legend"]  # start tags
    assert legends == ["legend", "deployments"]
    h2 = [d for t, a, d in text if t == "h2"]
    assert "Refused" in h2
    refused_items = [d for t, a, d in text if t in ("li", "b") and d]
    assert "team-b/huge" in refused_items
    assert any(d.startswith("Unschedulable: 0/3 nodes are available") for d in refused_items)
    for svg in re.findall(r"<svg.*?</svg>", doc, re.DOTALL):  # each node's bars, labels whole
        root = ET.fromstring(svg)
        plain = ["".join(t.itertext()) for t in root.iter(f"{SVG}text") if t.get("class") != "bar-label"]
        for label in plain[::2]:
            assert not label.endswith("-MI") and "GPU" in label
    assert f"{MIG.product}" in doc


def test_colours_stay_distinct_for_any_count() -> None:
    keys = [f"ns{i % 7}/d{i:03d}" for i in range(300)]
    colours = layout.palette_colors(keys)
    assert len(set(colours.values())) == len(keys)  # 300 deployments, 300 colours
    assert set(layout.PALETTE) <= set(colours.values())  # the palette first, each colour once
    assert layout.palette_colors(list(reversed(keys))) == colours  # deterministic, whatever the order
