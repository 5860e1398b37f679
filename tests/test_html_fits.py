"""The HTML report fits a 1,400 px window with every reason readable: no sideways scrolling (the
pictures scale down, the table is the page's width, its cells wrap), checked in a real browser
(headless Chromium, with a screenshot) where one is installed."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from vllmfit.cli import plan as plancmd
from vllmfit.cli import render

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 1400
BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def report() -> str:
    files = [str(ROOT / "examples" / f) for f in ("cluster.yaml", "llama-70b-too-big.yaml")]
    return render.plan_html(plancmd.build_plan(plancmd.read_objects(plancmd.read_files(files))))


def test_the_report_is_laid_out_to_fit_the_window() -> None:
    doc = report()
    css = re.search(r"<style>(.*?)</style>", doc, re.DOTALL)
    assert css is not None
    assert "svg{max-width:100%;height:auto}" in css.group(1)  # the pictures scale down (they have a viewBox)
    assert re.search(r"table\{[^}]*width:100%", css.group(1))
    assert re.search(r"td,th\{[^}]*overflow-wrap:break-word", css.group(1))
    assert all("viewBox=" in svg for svg in re.findall(r"<svg[^>]*>", doc))
    assert "RedHatAI/<wbr>Meta-Llama-3.1-8B-Instruct-FP8-dynamic" in doc  # a long model name breaks after '/'


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (apt-get install chromium) to render the report")
def test_a_real_browser_shows_the_report_at_1400_px_without_scrolling_sideways(tmp_path: Path) -> None:
    assert BROWSER is not None
    doc = report()
    page = tmp_path / "plan.html"
    page.write_text(doc)
    # the report has no script; a copy with one measures it: the page's scroll width against the window's
    probe = tmp_path / "probe.html"
    probe.write_text(doc.replace("</body>", "<script>document.title = 'scroll ' + document.documentElement.scrollWidth"
                                 " + ' client ' + document.documentElement.clientWidth;</script></body>"))
    args = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={WIDTH},900"]
    dom = subprocess.run([*args, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120, check=False)
    found = re.search(r"<title>scroll (\d+) client (\d+)</title>", dom.stdout)
    if found is None:
        pytest.skip(f"{BROWSER} did not render the page here: {dom.stderr.strip()[-200:]}")
    scroll, client = int(found.group(1)), int(found.group(2))
    assert 0 < client <= WIDTH and scroll <= client, f"the page is {scroll} px wide in a {client} px window"
    shot = tmp_path / "plan.png"
    subprocess.run([*args, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120, check=False)
    assert shot.exists() and _png_size(shot)[0] == WIDTH
