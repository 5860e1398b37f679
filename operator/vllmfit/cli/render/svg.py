"""SVG: one standalone image of a plan (title, legend, a bar per GPU, the refused), and the
per-node bars the HTML report inlines, drawn from `layout`."""

from __future__ import annotations

import html
from collections.abc import Sequence

from vllmfit.cli.render.layout import (
    COMPONENTS,
    FOREIGN,
    FREE,
    LEGEND_INK,
    RESERVE,
    Look,
    Segment,
    gib,
    gpu_segments,
    looks,
    node_title,
    refusal_lines,
    refused,
    summary,
)
from vllmfit.core.placement import GpuSlot, Plan

SVG_BAR = 520
ROW = 22
MARGIN = 10
CHAR_PX = 7.3
"""Advance of one character of the 12 px monospace font labels are set in (0.6 em), for widths."""
FONT = "font-family=\"DejaVu Sans, Arial, sans-serif\""
MONO = "font-family=\"DejaVu Sans Mono, Menlo, Consolas, monospace\""


BAR_FONT_PX = 11
BAR_CHAR_PX = 6.7
"""Advance of one character of the 11 px monospace font bar labels are set in, for what fits."""


HATCH_STEP = 5
HATCH_INK = RESERVE[1]


def hatch(x0: float, x1: float, y: float, height: float) -> str:
    """The reserve's hatching: diagonal lines over white from x0 to x1, drawn as lines (no pattern
    reference, so every SVG and the HTML report stay self-contained)."""
    out = [f'<rect x="{x0:.1f}" y="{y}" width="{x1 - x0:.1f}" height="{height}" fill="#ffffff"/>']
    start = x0 - height
    while start < x1:
        ax, ay, bx, by = start, y + height, start + height, y
        if ax < x0:
            ay, ax = ay - (x0 - ax), x0
        if bx > x1:
            by, bx = by + (bx - x1), x1
        if bx > ax:
            out.append(f'<line x1="{ax:.1f}" y1="{ay:.1f}" x2="{bx:.1f}" y2="{by:.1f}" stroke="{HATCH_INK}" '
                       'stroke-width="1.2"/>')
        start += HATCH_STEP
    return "".join(out)


def svg_bar(segments: Sequence[Segment], x: int, y: int, width: int = SVG_BAR, height: int = 16,
            palette: dict[str, Look] | None = None) -> str:
    """The segments as rectangles (a tooltip each), then on each deployment's run the longest of
    its short name or letter that fits, in its ink on a chip of its colour (legible on every tint)."""
    total = sum(s.bytes for s in segments) or 1
    out, labels, pos = [], [], 0.0
    run_owner, run_x, run_w = "", 0.0, 0.0

    def close_run() -> None:
        look = palette.get(run_owner) if palette and run_owner else None
        label = look.label_for(int((run_w - 4) / BAR_CHAR_PX)) if look else ""
        if label:
            chip = len(label) * BAR_CHAR_PX + 4
            labels.append(
                f'<rect class="bar-chip" x="{x + run_x + 1:.1f}" y="{y + 2}" width="{chip:.1f}" height="{height - 4}" '
                f'rx="2" fill="{look.color}"/>'
                f'<text class="bar-label" data-owner="{html.escape(run_owner)}" x="{x + run_x + 3:.1f}" '
                f'y="{y + height - 4.5}" font-size="{BAR_FONT_PX}" fill="{look.ink}" {MONO}>{html.escape(label)}</text>')

    for seg in segments:
        w = seg.bytes * width / total
        if seg.owner != run_owner or not seg.owner:
            close_run()
            run_owner, run_x, run_w = seg.owner, pos, 0.0
        run_w += w
        tip = html.escape(f"{seg.label}: {gib(seg.bytes)} GiB")
        owner = f' data-owner="{html.escape(seg.owner)}"' if seg.owner else ""
        if seg.pattern == "hatch":
            out.append(f'<g class="{html.escape(seg.label)}"><title>{tip}</title>{hatch(x + pos, x + pos + w, y, height)}</g>')
        else:
            out.append(
                f'<rect x="{x + pos:.1f}" y="{y}" width="{w:.1f}" height="{height}" fill="{seg.color}" '
                f'fill-opacity="{seg.opacity}" stroke="#ffffff" stroke-width="0.5"{owner}><title>{tip}</title></rect>'
            )
        pos += w
    close_run()
    out.append(f'<rect x="{x}" y="{y}" width="{width}" height="{height}" fill="none" stroke="#555555"/>')
    return "".join(out + labels)


def gpu_label_text(sl: GpuSlot) -> str:
    """'GPU 1 MIG 0 NVIDIA-A100-SXM4-80GB-MIG-3g.40gb': the slot and its whole product name."""
    return f"{sl.label} {sl.gpu.product}"


def text_px(text: str) -> int:
    return int(len(text) * CHAR_PX) + 1


def label_px(p: Plan, indent: int = 0) -> int:
    """Width of the label column: the longest GPU label, whole."""
    return max((text_px(gpu_label_text(sl)) for sl in p.ledger.slots()), default=80) + indent + 12


def gpu_row_svg(p: Plan, sl: GpuSlot, palette: dict[str, Look], y: int, indent: int = 0,
                label_w: int | None = None) -> str:
    """One GPU as SVG: its whole label, its bar, and used/budget and free GiB."""
    used, head = p.ledger.used_bytes(sl.node, sl.index), p.ledger.headroom_bytes(sl.node, sl.index)
    x = label_w if label_w is not None else label_px(p, indent)
    return (
        f'<text x="{indent}" y="{y + 13}" font-size="12" {MONO}>{html.escape(gpu_label_text(sl))}</text>'
        + svg_bar(gpu_segments(p, sl, palette), x, y, palette=palette)
        + f'<text x="{x + SVG_BAR + 8}" y="{y + 13}" font-size="12" {FONT}>'
        f"{gib(used)}/{gib(sl.budget_bytes)} GiB, {gib(head)} left</text>"
    )


def node_svg(p: Plan, node: str, palette: dict[str, Look]) -> str:
    """One node's GPUs as an SVG for the HTML report."""
    slots = sorted(p.ledger.nodes[node].gpus, key=lambda s: s.index)
    height = ROW * max(len(slots), 1) + 6
    label_w = label_px(p)
    rows = [gpu_row_svg(p, sl, palette, 3 + i * ROW, label_w=label_w) for i, sl in enumerate(slots)]
    width = label_w + SVG_BAR + 200
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" {FONT}>{"".join(rows)}</svg>'
    )



def plan_svg(p: Plan, title: str = "vllmfit plan") -> str:
    """One standalone SVG image: a title with the cluster summary, a legend (components and a
    colour per deployment), every GPU of every node as a bar with its whole product name, and the
    refused deployments with their grouped reasons."""
    palette = looks(p)
    label_w = label_px(p, indent=10)
    out: list[str] = []
    texts: list[str] = []  # every line of text, for the image's width
    y = 4

    def line(text: str, size: int = 12, bold: bool = False, x: int = 0, mono: bool = False, cls: str = "") -> None:
        nonlocal y
        weight = ' font-weight="bold"' if bold else ""
        klass = f' class="{cls}"' if cls else ""
        out.append(f'<text x="{x}" y="{y + size + 2}" font-size="{size}"{weight}{klass} {MONO if mono else FONT}>'
                   f"{html.escape(text)}</text>")
        texts.append(" " * (x // 7) + text)
        y += size + 8

    line(title, 16, bold=True, cls="title")
    line(summary(p).text(), cls="summary")
    y += 4
    # legend: the components (a neutral ink: each deployment is one colour, lighter to the right),
    # foreign use, free and reserve; then the key: one swatch, letter and name per deployment
    x = 0
    items = [(label, LEGEND_INK, op) for _, label, _, op in COMPONENTS]
    items += [("foreign use", FOREIGN[1], 1.0), ("budget left", FREE[1], 1.0), ("held back", "", 1.0)]
    out.append('<g class="legend">')
    for label, color, opacity in items:
        swatch = (hatch(x, x + 12, y, 12) + f'<rect x="{x}" y="{y}" width="12" height="12" fill="none" ' if not color
                  else f'<rect x="{x}" y="{y}" width="12" height="12" fill="{color}" fill-opacity="{opacity}" ')
        out.append(f'{swatch}stroke="#555555" stroke-width="0.5"/><text x="{x + 16}" y="{y + 11}" font-size="12" '
                   f"{FONT}>{html.escape(label)}</text>")
        x += 16 + text_px(label) + 14
    y += ROW
    names = list(palette)
    col_w = max((text_px(f"{palette[n].letter} {n}") for n in names), default=0) + 34
    width = max(label_w + SVG_BAR + 200, x)
    per_row = max(1, width // max(col_w, 1))
    for k, name in enumerate(names):
        look = palette[name]
        cx, cy = (k % per_row) * col_w, y + (k // per_row) * ROW
        box = max(16, text_px(look.letter) + 6)
        out.append(f'<g class="key" data-owner="{html.escape(name)}">'
                   f'<rect x="{cx}" y="{cy - 2}" width="{box}" height="16" fill="{look.color}"/>'
                   f'<text x="{cx + box / 2:.1f}" y="{cy + 10}" font-size="12" font-weight="bold" '
                   f'text-anchor="middle" fill="{look.ink}" {MONO}>{html.escape(look.letter)}</text>'
                   f'<text x="{cx + box + 5}" y="{cy + 10}" font-size="12" {MONO}>{html.escape(name)}</text></g>')
    y += ROW * ((len(names) + per_row - 1) // per_row) + 8
    out.append("</g>")
    for node in sorted(p.ledger.nodes):
        line(node_title(p, node, full=True), 14, bold=True)
        for sl in sorted(p.ledger.nodes[node].gpus, key=lambda s: s.index):
            out.append(gpu_row_svg(p, sl, palette, y, indent=10, label_w=label_w))
            y += ROW
        y += 6
    gone = refused(p)
    if gone:
        out.append('<g class="refused">')
        line(f"Refused ({len(gone)})", 14, bold=True)
        for key, d in gone:
            line(key, 12, bold=True, mono=True)
            for text in refusal_lines(d):
                line(text, 12, x=10, mono=True)
        out.append("</g>")
    width = max([width] + [text_px(t) + 10 for t in texts]) + 2 * MARGIN
    height = y + 8 + 2 * MARGIN
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} '
        f'{height}" {FONT}><title>{html.escape(title + ": " + summary(p).text())}</title>'
        f'<rect width="100%" height="100%" fill="#ffffff"/><g transform="translate({MARGIN},{MARGIN})">'
        f'{"".join(out)}</g></svg>\n'
    )
