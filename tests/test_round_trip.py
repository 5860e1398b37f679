"""Round-trip (issue 31): any KV figure `estimate` or `plan` prints as granted (the tokens of "KV
cache: N tokens", `kv_cache.granted_tokens` in JSON, the KV bytes of `--kv-cache-memory-bytes`)
can be given back as the request and is admitted with the same grant. The reported case: an L4,
Llama-3.1-8B at 8k, showed 12,928 tokens (vLLM's own log figure, the null block included) and
then refused `--kv-cache-tokens 12928` ("fits with 12912"): the figure shown is now the grant."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllmfit import main as cli
from vllmfit.core import memory
from vllmfit.core.memory import Settings
from vllmfit.sources import catalog

GPUS = sorted(g for g, t in catalog.gpus().items() if "MIG" not in g and t.cuda_total_bytes >= 15 << 30)
MODELS = sorted(n for n, m in catalog.models().items() if not m.pooling and m.params < 20e9)


def grant(model: str, gpu: str, s: Settings) -> memory.Estimate:
    return memory.estimate(catalog.model(model), memory.default_grant(s), catalog.gpu(gpu))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODELS), gpu=st.sampled_from(GPUS),
       length=st.sampled_from([1024, 4096, 8192, 32768]),
       ask=st.one_of(st.none(), st.integers(1, 64).map(lambda n: ("concurrency", n)),
                     st.integers(1, 200_000).map(lambda n: ("tokens", n))))
@example(model="google/gemma-2-2b-it", gpu="NVIDIA-A10", length=1024, ask=("concurrency", 1))  # a window group's
# extra block: 1,024 tokens granted, then refused as "cannot hold one request of 1024 tokens"
@example(model="google/gemma-3-4b-it", gpu="NVIDIA-A10", length=8192, ask=("concurrency", 1))  # 5 window groups
# need fewer blocks than the full one: 5,552 tokens in every group were a few blocks short of one request
def test_every_granted_figure_given_back_is_admitted_with_the_same_grant(
        model: str, gpu: str, length: int, ask: tuple[str, int] | None) -> None:
    m = catalog.model(model)
    length = min(length, m.max_model_len)
    kw = {} if ask is None else {"kv_concurrency": ask[1]} if ask[0] == "concurrency" else {"kv_tokens": ask[1]}
    try:
        first = grant(model, gpu, Settings(max_model_len=length, **kw))
    except memory.SpecError:
        return
    z = first.sizing
    if not z.fits or not z.granted_tokens:
        return
    by_tokens = grant(model, gpu, Settings(max_model_len=length, kv_tokens=z.granted_tokens)).sizing
    assert by_tokens.fits, by_tokens.reasons
    assert by_tokens.granted_tokens == z.granted_tokens
    by_bytes = grant(model, gpu, Settings(max_model_len=length, kv_bytes=z.footprint.kv_cache)).sizing
    assert by_bytes.fits, by_bytes.reasons
    assert by_bytes.granted_tokens == z.granted_tokens


def test_the_reported_l4_case_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "NVIDIA-L4", "--max-model-len", "8192"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    shown = int(next(ln for ln in out.splitlines() if ln.startswith("KV cache: ")).split()[2])
    assert cli.main([*args, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_cache"]["granted_tokens"] == shown
    assert cli.main([*args, "--kv-cache-tokens", str(shown)]) == 0
    back = capsys.readouterr().out
    assert f"KV cache: {shown} tokens" in back


def test_plan_shows_the_grant_and_it_round_trips(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    node = ("apiVersion: v1\nkind: Node\nmetadata:\n  name: gpu-l4\n  labels: {nvidia.com/gpu.product: NVIDIA-L4, "
            "nvidia.com/gpu.count: \"1\"}\n")
    spec = "apiVersion: vllmfit.dev/v1alpha1\nkind: VLLMDeployment\nmetadata: {{name: l}}\nspec: {{model: " \
           "meta-llama/Llama-3.1-8B-Instruct, maxModelLen: 8192{kv}}}\n"
    f = tmp_path / "c.yaml"
    f.write_text(node + "---\n" + spec.format(kv=""))
    assert cli.main(["plan", "-f", str(f), "-o", "json"]) == 0
    granted = json.loads(capsys.readouterr().out)["deployments"][0]["kv_cache"]["granted_tokens"]
    assert cli.main(["plan", "-f", str(f)]) == 0
    assert f"= {granted} tokens" in capsys.readouterr().out
    f.write_text(node + "---\n" + spec.format(kv=f", kvCache: {{tokens: {granted}}}"))
    assert cli.main(["plan", "-f", str(f), "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["deployments"][0]["kv_cache"]["granted_tokens"] == granted
