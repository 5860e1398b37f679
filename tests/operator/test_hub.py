"""vllmfit.sources.hub against a local Hub (http.server on 127.0.0.1, HF_ENDPOINT pointed at it)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from hubserver import HubServer
from huggingface_hub import constants

from vllmfit.core.model import config as modelconfig
from vllmfit.core.spec import api
from vllmfit.operator.booking.state import Store
from vllmfit.sources import hub
from vllmfit.sources.resolve import ModelResolutionError

CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896,
    "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
    "max_position_embeddings": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
TOTAL_SIZE = 988_065_536  # bytes of bf16 tensors in the checkpoint
REPOS = {
    "acme/tiny-chat": {"config.json": json.dumps(CONFIG).encode(),
                       "model.safetensors.index.json": json.dumps({"metadata": {"total_size": TOTAL_SIZE},
                                                                   "weight_map": {}}).encode()},
    "acme/single-file": {"config.json": json.dumps({**CONFIG, "num_hidden_layers": 2}).encode()},
    "acme/broken": {"config.json": b"{not json"},
    "acme/gated": {"config.json": json.dumps(CONFIG).encode()},
}


@pytest.fixture(autouse=True)
def isolated(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.setenv("VLLMFIT_HUB_TIMEOUT", "2")
    hub._cache.clear()
    yield
    hub._cache.clear()


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    with HubServer(REPOS, gated={"acme/gated"}) as s:
        monkeypatch.setenv("HF_ENDPOINT", s.url)
        yield s


def test_resolves_config_and_exact_parameters_from_the_index(server: HubServer) -> None:
    arch = hub.resolve_model("acme/tiny-chat")
    assert arch.name == "acme/tiny-chat"
    assert (arch.num_layers, arch.hidden_size, arch.num_kv_heads) == (24, 896, 2)
    assert arch.params == TOTAL_SIZE // 2  # bf16: 2 bytes per parameter
    assert arch.params_source == "safetensors-index"
    paths = {p for _, p, _ in server.requests}
    assert "/acme/tiny-chat/resolve/main/config.json" in paths
    from hubserver import COMMIT  # the index at the commit the config was read at, not a branch that moved
    assert f"/acme/tiny-chat/resolve/{COMMIT}/model.safetensors.index.json" in paths


def test_total_parameters_in_the_index_wins() -> None:
    assert modelconfig.params_from_index({"metadata": {"total_parameters": 123, "total_size": 10}}, CONFIG) == 123
    assert modelconfig.params_from_index({"metadata": {"total_size": 400}}, {**CONFIG, "torch_dtype": "float32"}) == 100
    assert modelconfig.params_from_index({"metadata": {"total_size": 400}}, {**CONFIG, "quantization_config": {"quant_method": "fp8"}}) is None


def test_single_file_checkpoints_count_parameters_from_the_config(server: HubServer) -> None:
    arch = hub.resolve_model("acme/single-file")
    assert arch.num_layers == 2 and arch.params_source == "computed" and arch.params > 0


def test_second_resolution_is_served_from_memory(server: HubServer) -> None:
    hub.resolve_model("acme/tiny-chat")
    n = len(server.requests)
    hub.resolve_model("acme/tiny-chat")
    assert len(server.requests) == n


def test_the_hf_cache_serves_files_when_the_hub_goes_away(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with HubServer(REPOS) as s:
        monkeypatch.setenv("HF_ENDPOINT", s.url)
        first = hub.resolve_model("acme/tiny-chat")
    hub._cache.clear()
    assert hub.resolve_model("acme/tiny-chat") == first  # same endpoint, now closed: from disk


def test_unknown_repo_is_a_permanent_one_line_error(server: HubServer) -> None:
    with pytest.raises(hub.HubError) as e:
        hub.resolve_model("acme/nope")
    assert not e.value.transient
    assert "\n" not in str(e.value) and "no such model" in str(e.value) and server.url in str(e.value)


def test_gated_model_without_a_token_says_how_to_fix_it(server: HubServer) -> None:
    with pytest.raises(hub.HubError) as e:
        hub.resolve_model("acme/gated")
    assert not e.value.transient and "gated" in str(e.value) and "HF_TOKEN" in str(e.value)


def test_gated_model_with_the_token(server: HubServer) -> None:
    assert hub.resolve_model("acme/gated", token=server.token).num_layers == 24
    assert (f"Bearer {server.token}") in {a for _, _, a in server.requests}


def test_not_json_is_a_clear_error(server: HubServer) -> None:
    with pytest.raises(hub.HubError, match="not valid JSON"):
        hub.resolve_model("acme/broken")


def never_hangs(fn, *args):
    """Run fn in a thread; a call still running after 30 s is a hang (raises TimeoutError)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result(timeout=30)


def test_unreachable_hub_fails_fast_and_transiently(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(hub.HubError) as e:
        never_hangs(hub.resolve_model, "acme/tiny-chat")
    assert e.value.transient and "cannot reach" in str(e.value) and "\n" not in str(e.value)


def test_silent_hub_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # accepts connections (backlog) but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
        monkeypatch.setenv("VLLMFIT_HUB_TIMEOUT", "0.5")
        with pytest.raises(hub.HubError) as e:
            never_hangs(hub.resolve_model, "acme/tiny-chat")
        assert e.value.transient


async def test_store_resolves_hub_models_and_maps_errors(server: HubServer) -> None:
    store = Store()

    def obj(model: str) -> api.VLLMDeployment:
        return api.VLLMDeployment.model_validate({"metadata": {"name": "x"}, "spec": {"model": model}})

    req = await store.request_for(obj("acme/tiny-chat"))
    assert req.model.params == TOTAL_SIZE // 2 and req.key == "default/x"
    with pytest.raises(ModelResolutionError) as e:
        await store.request_for(obj("acme/gated"))
    assert not e.value.transient


def test_the_pod_loads_the_commit_whose_config_was_sized(server: HubServer) -> None:
    # the Hub's default branch moves after admission; the pod pins the commit its config was read at
    from hubserver import COMMIT

    from vllmfit.operator.rendering import builders
    arch = hub.resolve_model("acme/tiny-chat")
    assert arch.revision == COMMIT
    spec = api.VLLMDeploymentSpec.model_validate({"model": "acme/tiny-chat"})
    flags = api.Flags(max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.5)
    assert f"--revision={COMMIT}" in builders.vllm_args(spec, arch.name, flags, arch.revision)
    # a tenant's own pinned commit is read at that commit, and rendered as the tenant wrote it
    other = "f" * 40
    pinned = hub.resolve_model("acme/tiny-chat", revision=other)
    assert any(f"/resolve/{other}/config.json" in p for _, p, _ in server.requests)
    spec = api.VLLMDeploymentSpec.model_validate({"model": "acme/tiny-chat", "extraArgs": ["--revision", other]})
    args = builders.vllm_args(spec, pinned.name, flags, pinned.revision)
    assert args.count("--revision") == 1 and not any(a.startswith("--revision=") for a in args)


def test_the_models_it_remembers_are_bounded(server: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub.limits, "MAX_HUB_MODELS", 1)  # spec.model is tenant input: the least recent goes
    hub.resolve_model("acme/tiny-chat")
    hub.resolve_model("acme/single-file")
    assert list(hub._cache) == [("acme/single-file", server.url, "")]
    assert hub.resolve_model("acme/tiny-chat").name == "acme/tiny-chat"  # read again (from the HF cache)
