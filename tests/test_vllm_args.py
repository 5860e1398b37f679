"""Issue 30: every `vllm serve` option of every vLLM version vllmfit models is classified (computed by
vllmfit, modelled, allowed because it cannot change GPU memory, or refused), and docs/webhook.md
shows the table. The option lists (vllmfit.core.spec.vllmargs) are generated from vLLM's own parser
source by tests/oracle/vllm_args.py; a version added to the memory model without regenerating them,
or an option a new vLLM adds without a class, fails here."""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

from vllmfit.core.memory import versions
from vllmfit.core.spec import extraargs, vllmargs

ROOT = Path(__file__).resolve().parents[1]


def test_every_modelled_version_has_its_options() -> None:
    have = {tuple(int(p) for p in v.split(".")[:2]) for v in vllmargs.VERSIONS}
    assert set(versions.MODELLED_VERSIONS) <= have


@pytest.mark.parametrize("version", vllmargs.VERSIONS)
def test_every_option_is_classified(version: str) -> None:
    options = [o for o, vs in vllmargs.OPTIONS.items() if version in vs]
    assert len(options) > 150  # the parser was read, not an empty file
    assert [o for o in options if extraargs.classify(o)[0] == "unclassified"] == []


def test_the_classes_mean_what_they_say() -> None:
    # computed and modelled flags are refused in extraArgs (a spec field sets them); allowed ones pass
    for option in sorted(extraargs.KNOWN):
        kind, why = extraargs.classify(option)
        assert why, option
        refused = {p.option for p in extraargs.problems([option, "1"])}
        if kind in ("computed", "modelled", "refused"):
            assert option in refused, option
        elif kind == "allowed":
            assert refused == set(), option
    assert {extraargs.classify(o)[0] for o in ("--mm-processor-kwargs", "--enable-eplb",
                                               "--num-redundant-experts", "--trust-remote-code")} == {"refused"}


def test_an_option_no_supported_vllm_has_is_refused() -> None:
    [p] = extraargs.problems(["--made-up-flag", "1"])
    assert p.message == "extraArgs --made-up-flag is not an option of `vllm serve` 0.11.0-0.33.0; remove it"


def test_docs_show_the_table() -> None:
    assert extraargs.table_markdown() in (ROOT / "docs" / "webhook.md").read_text()


def _generator():  # tests/oracle/vllm_args.py, loaded as a module
    spec = importlib.util.spec_from_file_location("vllm_args", ROOT / "tests" / "oracle" / "vllm_args.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm_args"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_generator_reads_add_argument_calls_and_frontend_dataclass_fields(tmp_path: Path) -> None:
    wheel = tmp_path / "vllm-9.9.0-cp38-abi3-manylinux1_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm/engine/arg_utils.py", (
            "class EngineArgs:\n"
            "    def add_cli_args(parser):\n"
            "        g = parser.add_argument_group('x')\n"
            "        g.add_argument('--tensor-parallel-size', '-tp', **kw['tensor_parallel_size'])\n"
            "        g.add_argument('--enable-eplb', action='store_true')\n"
            "        g.add_argument(name_from_a_loop)\n"))
        z.writestr("vllm/entrypoints/openai/cli_args.py", (
            "from dataclasses import dataclass\n"
            "@dataclass\n"
            "class FrontendArgs:\n"
            "    host: str | None = None\n"
            "    lora_modules: list[str] | None = None\n"
            "    _private: int = 0\n"
            "def make_arg_parser(parser):\n"
            "    parser.add_argument('model_tag', nargs='?')\n"
            "    parser.add_argument('--api-server-count', '-asc', type=int)\n"))
    gen = _generator()
    text = gen.render(dict([gen.options(str(wheel))]))
    ns: dict[str, object] = {}
    exec(compile(text, "vllmargs", "exec"), ns)  # noqa: S102 - the generated module, as committed
    assert ns["VERSIONS"] == ("9.9.0",)
    assert set(ns["OPTIONS"]) == {"--tensor-parallel-size", "--enable-eplb", "--host", "--lora-modules",  # type: ignore[arg-type]
                                  "--api-server-count"}
    assert ns["ALIASES"] == {"-tp": "--tensor-parallel-size", "-asc": "--api-server-count"}


WHEELS = Path("/tmp/vllm-wheels")


@pytest.mark.skipif(not WHEELS.is_dir(), reason="needs the vLLM wheels in /tmp/vllm-wheels (pip download --no-deps)")
def test_the_committed_table_is_what_the_wheels_say() -> None:  # pragma: no cover - needs the wheels
    gen = _generator()
    wheels = sorted(str(p) for p in WHEELS.glob("vllm-*.whl"))
    text = gen.render(dict(gen.options(w) for w in wheels))
    assert text == (ROOT / "operator" / "vllmfit" / "core" / "spec" / "vllmargs.py").read_text()
