"""HTML: one self-contained report of a plan (inline CSS and SVG, no scripts), drawn from `layout`."""

from __future__ import annotations

import html

from vllmfit.cli.render.layout import (
    COMPONENTS,
    FOREIGN,
    FREE,
    LEGEND_INK,
    Look,
    gib,
    looks,
    node_title,
    placement_text,
    refusal_lines,
    refused,
    summary,
)
from vllmfit.cli.render.svg import HATCH_INK, node_svg
from vllmfit.core.placement import Plan

HATCH_CSS = f"repeating-linear-gradient(-45deg,{HATCH_INK} 0 1.2px,#ffffff 1.2px 3.5px)"
"""The reserve's hatching, as the SVG pattern draws it."""


def swatch(look: Look) -> str:
    """The deployment's letter on its colour: the same mark as in the bars' labels and the terminal."""
    return (f'<span class="key" data-owner="{html.escape(look.key)}" '
            f'style="background:{look.color};color:{look.ink}">{html.escape(look.letter)}</span>')


def legend_html(palette: dict[str, Look]) -> str:
    items = [
        f'<span class="item"><span class="sw" style="background:{LEGEND_INK};opacity:{op}"></span>{html.escape(label)}</span>'
        for _, label, _, op in COMPONENTS
    ]
    items += [
        f'<span class="item"><span class="sw" style="background:{c}"></span>{lbl}</span>'
        for c, lbl in ((FOREIGN[1], "foreign use"), (FREE[1], "budget left"), (HATCH_CSS, "held back"))
    ]
    deps = [f'<span class="item">{swatch(look)} {html.escape(n)}</span>' for n, look in palette.items()]
    return (f'<p class="legend" title="legend">each deployment in its colour, lighter to the right: {" ".join(items)}</p>'
            f'<p class="legend" title="deployments">{" ".join(deps)}</p>')


def plan_html(p: Plan, title: str = "vllmfit plan") -> str:
    """One self-contained HTML file: inline CSS and SVG, no scripts, no external assets."""
    palette = looks(p)
    parts = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="summary">{html.escape(summary(p).text())}</p>',
        legend_html(palette),
    ]
    gone = refused(p)
    if gone:
        parts.append('<h2>Refused</h2><ul class="refused">' + "".join(
            f'<li><b>{html.escape(k)}</b><ul>' + "".join(f"<li>{html.escape(x.strip())}</li>" for x in refusal_lines(d))
            + "</ul></li>" for k, d in gone) + "</ul>")
    for node in sorted(p.ledger.nodes):
        parts.append(f"<h2>{html.escape(node_title(p, node, full=True))}</h2>{node_svg(p, node, palette)}")
    parts.append(
        '<h2>Deployments</h2><table class="deployments"><colgroup><col><col><col><col><col class="flags"><col><col>'
        '<col class="notes"></colgroup><tr><th>deployment</th><th>model</th><th>phase</th><th>placement</th>'
        "<th>flags</th><th>per GPU (GiB)</th><th>KV cache</th><th>notes</th></tr>"
    )
    for key in sorted(p.decisions):
        parts.append(deployment_row_html(p, key, palette))
    parts.append("</table>")
    for title_, lines, cls in (("Warnings", p.warnings, "warn"), ("Input errors", p.errors, "err")):
        if lines:
            parts.append(
                f"<h2>{title_}</h2><ul>"
                + "".join(f'<li class="{cls}">{html.escape(x)}</li>' for x in lines)
                + "</ul>"
            )
    css = (
        # fits the window (1,400 px and less): the pictures scale down, the table is as wide as the page
        # and every cell wraps (a long word anywhere), so no reason is cut off and nothing scrolls sideways
        "body{font-family:sans-serif;margin:2em;color:#222;max-width:100%}svg{max-width:100%;height:auto}"
        "table{border-collapse:collapse;width:100%}col.notes{width:28%}col.flags{width:22%}"
        "td,th{border:1px solid #ccc;padding:4px 6px;vertical-align:top;text-align:left;overflow-wrap:break-word}"
        ".sw{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;border:1px solid #555}"
        ".item{white-space:nowrap;margin-right:10px}"
        # a vLLM flag or a name is never broken (browsers break at hyphens): flags wrap between each other
        ".flag,.name{white-space:nowrap}.flag{font-size:85%}"
        ".key{display:inline-block;min-width:1.3em;padding:0 3px;text-align:center;font:bold 12px monospace;"
        "border-radius:2px;margin-left:12px}"
        ".Admitted{color:#1b5e20}.Unschedulable{color:#b26a00}.Rejected{color:#b71c1c}"
        ".warn{color:#b26a00}.err{color:#b71c1c}.fix{color:#1b5e20}ul{margin:0;padding-left:1.2em}"
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{css}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n"
    )


def breakable(name: str) -> str:
    """A name that may break after its '/' only ('org/<wbr>model'), never at a hyphen."""
    return "/<wbr>".join(html.escape(part) for part in name.split("/"))


def deployment_row_html(p: Plan, key: str, palette: dict[str, Look]) -> str:
    d = p.decisions[key]
    req = p.requests.get(key)
    fp = d.replicas[0].sizing.footprint if d.replicas else None
    sizing = d.replicas[0].sizing if d.replicas else None
    kv = ""
    if fp is not None and sizing is not None:
        kv = f"{gib(fp.kv_cache)} GiB" + (
            f", {sizing.granted_tokens} tokens" if sizing.granted_tokens else ""
        ) + (f" ({sizing.grant})" if sizing.granted_tokens and sizing.grant else "") + (  # which rule granted it
            f"; request {sizing.request_tokens}, limit {sizing.limit_tokens} tokens" if sizing.request_tokens else "")
    notes = [f"<li>{html.escape(r)}</li>" for r in d.reasons]
    notes += [f'<li class="fix">fits with: {html.escape(s)}</li>' for s in d.suggestions]
    notes += [f'<li class="warn">{html.escape(w)}</li>' for w in d.warnings]
    look = palette.get(key)
    cells_ = [
        f'<span class="name">{(swatch(look) + " " if look else "") + breakable(key)}</span>',
        f'<span class="name">{breakable(req.model.name if req else "")}</span>',
        f'<span class="{d.phase}">{d.phase}{" (kept)" if d.restored else ""}</span>',
        html.escape(placement_text(d)),
        " ".join(f'<code class="flag">{html.escape(a)}</code>' for a in d.flags.args()) if d.flags else "",
        gib(fp.total) if fp else "",
        html.escape(kv),
        f"<ul>{''.join(notes)}</ul>" if notes else "",
    ]
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells_) + "</tr>"

