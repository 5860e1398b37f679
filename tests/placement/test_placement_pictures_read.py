"""Pictures read without a legend hunt (issue 24 item 4): one distinct colour per deployment, far
apart by CIEDE2000 (implemented here from Sharma, Wu & Dalal 2005, checked on their test data); the
same colour for a deployment in the terminal, the SVG image and the HTML report; every plain-text,
80-column bar names the deployments it shows; bar labels in the SVG fit their runs."""

from __future__ import annotations

import io
import itertools
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from rich.console import Console

from vllmfit.cli import plan as plancmd
from vllmfit.cli import render
from vllmfit.cli.render import layout, svg

SVG = "{http://www.w3.org/2000/svg}"
ROOT = Path(__file__).resolve().parents[2]
BAR_CHARS = "".join({c for _, _, c, _ in layout.COMPONENTS} | {layout.FOREIGN[2], layout.FREE[2], layout.RESERVE[2]})


def srgb_to_lab(color: str) -> tuple[float, float, float]:
    """'#rrggbb' (sRGB, D65) -> CIE L*a*b*."""

    def lin(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(int(color[i:i + 2], 16) / 255) for i in (1, 3, 5))
    x = (0.4124564 * r + 0.3575761 * g + 0.1804375 * b) / 0.95047
    y = 0.2126729 * r + 0.7151522 * g + 0.0721750 * b
    z = (0.0193339 * r + 0.1191920 * g + 0.9503041 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > (6 / 29) ** 3 else t / (3 * (6 / 29) ** 2) + 4 / 29

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def ciede2000(lab1: tuple[float, float, float], lab2: tuple[float, float, float]) -> float:
    (l1, a1, b1), (l2, a2, b2) = lab1, lab2
    cbar = (math.hypot(a1, b1) + math.hypot(a2, b2)) / 2
    g = 0.5 * (1 - math.sqrt(cbar**7 / (cbar**7 + 25**7)))
    a1p, a2p = (1 + g) * a1, (1 + g) * a2
    c1p, c2p = math.hypot(a1p, b1), math.hypot(a2p, b2)
    h1p = math.degrees(math.atan2(b1, a1p)) % 360 if c1p else 0.0
    h2p = math.degrees(math.atan2(b2, a2p)) % 360 if c2p else 0.0
    dlp, dcp = l2 - l1, c2p - c1p
    dhp = 0.0
    if c1p * c2p:
        dhp = h2p - h1p
        dhp -= 360 if dhp > 180 else 0
        dhp += 360 if dhp < -180 else 0
    dhhp = 2 * math.sqrt(c1p * c2p) * math.sin(math.radians(dhp / 2))
    lbp, cbp = (l1 + l2) / 2, (c1p + c2p) / 2
    if not c1p * c2p:
        hbp = h1p + h2p
    elif abs(h1p - h2p) <= 180:
        hbp = (h1p + h2p) / 2
    else:
        hbp = (h1p + h2p + 360) / 2 if h1p + h2p < 360 else (h1p + h2p - 360) / 2
    t = (1 - 0.17 * math.cos(math.radians(hbp - 30)) + 0.24 * math.cos(math.radians(2 * hbp))
         + 0.32 * math.cos(math.radians(3 * hbp + 6)) - 0.20 * math.cos(math.radians(4 * hbp - 63)))
    dtheta = 30 * math.exp(-(((hbp - 275) / 25) ** 2))
    rc = 2 * math.sqrt(cbp**7 / (cbp**7 + 25**7))
    sl = 1 + 0.015 * (lbp - 50) ** 2 / math.sqrt(20 + (lbp - 50) ** 2)
    sc, sh = 1 + 0.045 * cbp, 1 + 0.015 * cbp * t
    rt = -math.sin(math.radians(2 * dtheta)) * rc
    return math.sqrt((dlp / sl) ** 2 + (dcp / sc) ** 2 + (dhhp / sh) ** 2 + rt * (dcp / sc) * (dhhp / sh))


@pytest.mark.parametrize(("lab1", "lab2", "expected"), [  # Sharma, Wu & Dalal (2005), table 1: pairs 1, 7, 17, 25
    ((50.0, 2.6772, -79.7751), (50.0, 0.0, -82.7485), 2.0425),
    ((50.0, 0.0, 0.0), (50.0, -1.0, 2.0), 2.3669),
    ((50.0, 2.5, 0.0), (73.0, 25.0, -18.0), 27.1492),
    ((60.2574, -34.0099, 36.2677), (60.4626, -34.1751, 39.4387), 1.2644),
])
def test_the_colour_difference_used_here_is_ciede2000(lab1, lab2, expected) -> None:  # type: ignore[no-untyped-def]
    assert ciede2000(lab1, lab2) == pytest.approx(expected, abs=1e-4)


MIN_DELTA_E = 17.0
"""Two deployment colours differ by at least this CIEDE2000 (about 10 is "clearly different")."""


def test_palette_colours_are_far_apart_and_far_from_foreign_free_and_reserve() -> None:
    labs = {c: srgb_to_lab(c) for c in layout.PALETTE}
    assert len(layout.PALETTE) >= 16
    pairs = sorted((ciede2000(labs[a], labs[b]), a, b) for a, b in itertools.combinations(layout.PALETTE, 2))
    assert pairs[0][0] >= MIN_DELTA_E, pairs[:3]
    for fixed in (layout.FOREIGN[1], layout.FREE[1], layout.RESERVE[1]):
        near = min(ciede2000(labs[c], srgb_to_lab(fixed)) for c in layout.PALETTE)
        assert near >= MIN_DELTA_E, fixed


def example_plan():  # type: ignore[no-untyped-def]
    return plancmd.build_plan(plancmd.read_objects(plancmd.read_files([str(ROOT / "examples" / "cluster.yaml")])))


def test_every_deployment_of_the_example_gets_its_own_colour_and_letter() -> None:
    p = example_plan()
    looks = layout.looks(p)
    holding = {b.deployment for sl in p.ledger.slots() for b in p.ledger.bookings_on(sl.node, sl.index)}
    assert set(looks) == holding and len(holding) >= 10
    namespaces = {k.split("/")[0] for k in holding}
    assert len(holding) > len(namespaces)  # several deployments share a namespace (once near-identical hues)
    colours = [lk.color for lk in looks.values()]
    assert len(set(colours)) == len(colours) and len({lk.letter for lk in looks.values()}) == len(looks)
    for a, b in itertools.combinations(colours, 2):
        assert ciede2000(srgb_to_lab(a), srgb_to_lab(b)) >= MIN_DELTA_E, (a, b)


def _tokens(bar: str, labels: dict[str, tuple[str, str]]) -> list[str]:
    """The deployments a plain bar names: the text between bar characters, read as labels (short
    name or letter) one after another."""
    found = []
    for token in re.split(f"[{re.escape(BAR_CHARS)}]+", bar):
        while token:
            match = next(((k, t) for k, (short, letter) in labels.items() for t in (short, letter)
                          if token.startswith(t)), None)
            assert match is not None, (bar, token)
            found.append(match[0])
            token = token[len(match[1]):]
    return found


@pytest.mark.parametrize("width", [80, 160])
def test_each_plain_text_bar_names_its_deployments(width: int) -> None:
    p = example_plan()
    console = Console(width=width, record=True, color_system=None)
    render.print_plan(console, p)
    out = console.export_text()
    looks = layout.looks(p)
    # the key: every letter with its deployment's name
    assert dict(re.findall(r" ([A-Za-z0-9]+)  ([^\s/]+/[^\s,]+)", out)) == {lk.letter: k for k, lk in looks.items()}
    labels = {k: (lk.short, lk.letter) for k, lk in looks.items()}
    lines = [ln.rstrip() for ln in out.splitlines()]
    rows = 0
    for node in sorted(p.ledger.nodes):  # the node's title, then one row per GPU in index order
        at = lines.index(layout.node_title(p, node))
        for i, sl in enumerate(sorted(p.ledger.nodes[node].gpus, key=lambda s: s.index)):
            line = lines[at + 1 + i]
            assert line.startswith(layout.gpu_row_label(p, sl) + " "), line
            bar = max(line.split(" "), key=len)  # the bar is the longest run without a space
            assert len(bar) >= 16 and bar[-1] in BAR_CHARS, line
            on_gpu = {b.deployment for b in p.ledger.bookings_on(sl.node, sl.index)}
            assert set(_tokens(bar, labels)) == on_gpu, (node, sl.index, bar)
            rows += 1
    assert rows == len(p.ledger.slots())


def test_a_deployment_has_one_colour_in_terminal_svg_and_html() -> None:
    p = example_plan()
    looks = layout.looks(p)
    expected = {k: lk.color for k, lk in looks.items()}
    # SVG: every segment of a deployment, and its key swatch
    root = ET.fromstring(render.plan_svg(p))
    seen: dict[str, set[str]] = {}
    for rect in root.iter(f"{SVG}rect"):
        if rect.get("data-owner"):
            seen.setdefault(rect.get("data-owner"), set()).add(rect.get("fill"))
    for g in root.iter(f"{SVG}g"):
        if g.get("class") == "key":
            seen.setdefault(g.get("data-owner"), set()).add(g.find(f"{SVG}rect").get("fill"))
    assert seen == {k: {c} for k, c in expected.items()}
    # HTML: the bars of each node's SVG, and the key letters
    doc = render.plan_html(p)
    html_seen: dict[str, set[str]] = {}
    for fill, owner in re.findall(r'<rect [^>]*fill="(#[0-9a-f]{6})"[^>]*data-owner="([^"]+)"', doc):
        html_seen.setdefault(owner, set()).add(fill)
    for owner, colour in re.findall(r'class="key" data-owner="([^"]+)" style="background:(#[0-9a-f]{6})', doc):
        html_seen.setdefault(owner, set()).add(colour)
    assert html_seen == {k: {c} for k, c in expected.items()}
    # terminal (truecolor): the key's letters on the deployment's colour
    buf = io.StringIO()
    render.print_plan(Console(file=buf, force_terminal=True, color_system="truecolor", width=160), p)
    term: dict[str, set[str]] = {}
    for r, g, b, letter, name in re.findall(
            r"\x1b\[1;38;2;\d+;\d+;\d+;48;2;(\d+);(\d+);(\d+)m ([A-Za-z0-9]+) \x1b\[0m ([^\s,]+)", buf.getvalue()):
        assert looks[name].letter == letter
        term.setdefault(name, set()).add(f"#{int(r):02x}{int(g):02x}{int(b):02x}")
    assert term == {k: {c} for k, c in expected.items()}


def test_svg_bar_labels_fit_their_runs_and_wide_runs_carry_the_name() -> None:
    p = example_plan()
    looks = layout.looks(p)
    root = ET.fromstring(render.plan_svg(p))
    rects = [r for r in root.iter(f"{SVG}rect") if r.get("data-owner")]
    labels = [t for t in root.iter(f"{SVG}text") if t.get("class") == "bar-label"]
    assert labels
    named = 0
    for t in labels:
        owner, text, x = t.get("data-owner"), t.text or "", float(t.get("x"))
        assert text in (looks[owner].short, looks[owner].letter)
        # the run the label starts in: this owner's rects on the same bar, touching each other
        bar_y = float(t.get("y")) - 16 + 4.5  # the text's baseline sits 4.5 px above the bar's bottom
        run = sorted((float(r.get("x")), float(r.get("width"))) for r in rects
                     if r.get("data-owner") == owner and abs(float(r.get("y")) - bar_y) < 0.01)
        start = max(rx for rx, _ in run if rx <= x)
        width = sum(w for rx, w in run if rx >= start and rx < start + 10_000)
        assert len(text) * svg.BAR_CHAR_PX + 4 + 1 <= width, (owner, text, width)  # its chip, inside the run
        named += text == looks[owner].short
    assert named >= len(labels) // 2  # most runs are wide enough for the name


def test_palette_stays_distinct_in_a_256_colour_terminal() -> None:
    """rich prints "#rrggbb" as the nearest of xterm's 256 colours where the terminal has no
    truecolor: the palette's colours must not merge there either."""
    from rich.color import Color, ColorSystem

    numbers = [Color.parse(c).downgrade(ColorSystem.EIGHT_BIT).number for c in layout.PALETTE]
    assert len(set(numbers)) == len(layout.PALETTE), numbers
