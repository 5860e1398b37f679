"""HTML: one self-contained report of a plan (inline CSS and SVG, no scripts), drawn from `layout`."""

from __future__ import annotations

import html

from vllmfit.cli.render.layout import (
    COMPONENTS,
    FOREIGN,
    FREE,
    RESERVE,
    colors,
    gib,
    node_title,
    placement_text,
    refusal_lines,
    refused,
    summary,
)
from vllmfit.cli.render.svg import node_svg
from vllmfit.core.placement import Plan


def legend_html(palette: dict[str, tuple[str, str]]) -> str:
    items = [
        f'<span class="item"><span class="sw" style="background:{c};opacity:{o}"></span>{html.escape(lbl)}</span>'
        for c, o, lbl in [("#555555", op, label) for _, label, _, op in COMPONENTS]
    ]
    items += [
        f'<span class="item"><span class="sw" style="background:{c}"></span>{lbl}</span>'
        for c, lbl in ((FOREIGN[1], "foreign use"), (FREE[1], "free"), (RESERVE[1], "reserve"))
    ]
    deps = [
        f'<span class="item"><span class="sw" style="background:{c}"></span>{html.escape(n)}</span>'
        for n, (_, c) in palette.items()
    ]
    return (f'<p class="legend" title="legend">{" ".join(items)}</p>'
            f'<p class="legend" title="deployments">{" ".join(deps)}</p>')


def plan_html(p: Plan, title: str = "vllmfit plan") -> str:
    """One self-contained HTML file: inline CSS and SVG, no scripts, no external assets."""
    palette = colors(p)
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
        "<h2>Deployments</h2><table><tr><th>deployment</th><th>model</th><th>phase</th><th>placement</th>"
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
        "body{font-family:sans-serif;margin:2em;color:#222}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}"
        ".sw{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;border:1px solid #555}"
        ".item{white-space:nowrap}"
        ".Admitted{color:#1b5e20}.Unschedulable{color:#b26a00}.Rejected{color:#b71c1c}"
        ".warn{color:#b26a00}.err{color:#b71c1c}.fix{color:#1b5e20}ul{margin:0;padding-left:1.2em}"
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{css}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n"
    )


def deployment_row_html(p: Plan, key: str, palette: dict[str, tuple[str, str]]) -> str:
    d = p.decisions[key]
    req = p.requests.get(key)
    fp = d.replicas[0].sizing.footprint if d.replicas else None
    sizing = d.replicas[0].sizing if d.replicas else None
    kv = ""
    if fp is not None and sizing is not None:
        kv = f"{gib(fp.kv_cache)} GiB" + (
            f", {sizing.kv_cache_tokens} tokens" if sizing.kv_cache_tokens else ""
        )
    notes = [f"<li>{html.escape(r)}</li>" for r in d.reasons]
    notes += [f'<li class="fix">fits with: {html.escape(s)}</li>' for s in d.suggestions]
    notes += [f'<li class="warn">{html.escape(w)}</li>' for w in d.warnings]
    color = palette.get(key, ("", "#ffffff"))[1]
    cells_ = [
        f'<span class="sw" style="background:{color}"></span>{html.escape(key)}',
        html.escape(req.model.name if req else ""),
        f'<span class="{d.phase}">{d.phase}{" (kept)" if d.restored else ""}</span>',
        html.escape(placement_text(d)),
        html.escape(" ".join(d.flags.args()) if d.flags else ""),
        gib(fp.total) if fp else "",
        html.escape(kv),
        f"<ul>{''.join(notes)}</ul>" if notes else "",
    ]
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells_) + "</tr>"

