"""Pictures of plans and estimates, one module per output format over one layout model:

  layout    what each bar is (segments: owner, bytes, colour, label), the palette, the summary,
            node titles and refusal lines; no format, no rich
  terminal  rich tables and character bars (`vllmfit plan`, `vllmfit estimate`)
  svg       one standalone SVG image of a plan; the per-node bars the HTML report inlines
  html      one self-contained HTML report of a plan

A new format is a new module that draws `layout`'s segments; what a bar shows is decided only there.
"""

from vllmfit.cli.render.html import plan_html
from vllmfit.cli.render.svg import plan_svg
from vllmfit.cli.render.terminal import print_estimate, print_plan

__all__ = ["plan_html", "plan_svg", "print_estimate", "print_plan"]
