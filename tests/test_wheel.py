"""The built wheel works on its own (issue 14, item 12): the catalog ships inside the package as
package data, found through importlib.resources, and VLLMFIT_CATALOG still overrides it.

The wheel is built from a copy of the source tree (so the test never writes into the checkout),
without build isolation (no network), and installed with --no-index --no-deps into a fresh venv
whose dependencies come from the test environment's site-packages through a .pth file (a site
directory's own .pth files, such as an editable install of vllmfit, are not read from there)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _have_bdist_wheel() -> bool:
    try:
        import setuptools

        return tuple(int(x) for x in setuptools.__version__.split(".")[:2]) >= (70, 1)
    except ImportError:
        return False


pytestmark = pytest.mark.skipif(not _have_bdist_wheel(), reason="needs setuptools >= 70.1 (bdist_wheel built in)")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "catalog", src / "catalog")
    shutil.copytree(ROOT / "operator", src / "operator", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(dist), str(src)], check=True, capture_output=True, cwd=tmp)
    [wheel] = dist.glob("vllmfit-*.whl")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLMFIT_CATALOG")}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-index", "--no-deps",
                    "--ignore-installed", str(wheel)], check=True, capture_output=True, env=clean)
    Path(site, "test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after: pip sees a bare venv
    work = tmp / "elsewhere"  # not the checkout: nothing may be found next to the source tree
    work.mkdir()
    shutil.copy(ROOT / "examples" / "cluster.yaml", work / "cluster.yaml")
    return {"wheel": wheel, "bin": env_dir / "bin" / "vllmfit", "python": py, "work": work}


def _run(installed: dict[str, Path], *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLMFIT_CATALOG")}
    return subprocess.run([str(installed["bin"]), *args], check=False, capture_output=True, text=True,
                          cwd=installed["work"],
                          env={**clean, **env}, timeout=120)


def test_the_wheel_holds_the_catalog(installed: dict[str, Path]) -> None:
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    assert "vllmfit/catalog/gpus.yaml" in names and "vllmfit/catalog/models.yaml" in names
    # the packaged copies are the top-level catalog/, byte for byte
    with zipfile.ZipFile(installed["wheel"]) as z:
        assert z.read("vllmfit/catalog/gpus.yaml") == (ROOT / "catalog" / "gpus.yaml").read_bytes()


def test_estimate_from_the_installed_wheel(installed: dict[str, Path]) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLMFIT_CATALOG")}
    where = subprocess.run([str(installed["python"]), "-c", "import vllmfit; print(vllmfit.__file__)"],
                           capture_output=True, text=True, cwd=installed["work"], check=True, env=clean).stdout
    assert str(installed["python"].parents[1]) in where  # the wheel, not the checkout
    p = _run(installed, "estimate", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--max-model-len", "8192",
             "--output", "json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["kv_bytes_per_token"] == 131_072  # 2 x 32 layers x 8 KV heads x 128 x 2 bytes


def test_plan_from_the_installed_wheel(installed: dict[str, Path]) -> None:
    p = _run(installed, "plan", "-f", "cluster.yaml", "--output", "json")
    assert p.returncode == 1, p.stderr  # the example's research/llama-70b-128k fits nowhere (exit 1, issue 24)
    assert json.loads(p.stdout)["errors"] == []


def test_vllmfit_catalog_still_overrides(installed: dict[str, Path], tmp_path: Path) -> None:
    shutil.copy(ROOT / "catalog" / "models.yaml", tmp_path / "models.yaml")
    (tmp_path / "gpus.yaml").write_text("- product: ACME-TEST-1\n  name: ACME Test 1\n  memory_mib: 4096\n")
    p = _run(installed, "gpus", "--output", "json", VLLMFIT_CATALOG=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert [g["product"] for g in json.loads(p.stdout)] == ["ACME-TEST-1"]
