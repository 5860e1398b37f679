"""`vllmfit reserve`, the reservation container: exactly one visible GPU, its UUID written once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vllmfit.agent import reserve
from vllmfit.backends import reservation as rsv


class FakeNvml:
    def __init__(self, uuids: list[str], fail: bool = False) -> None:
        self.uuids, self.fail, self.shut = uuids, fail, False

    def nvmlInit(self) -> None:
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return self.uuids[h].encode()  # older nvidia-ml-py returns bytes

    def nvmlShutdown(self) -> None:
        self.shut = True


def test_the_one_visible_gpu_is_reported() -> None:
    nvml = FakeNvml(["GPU-aaaa"])
    assert reserve.visible_uuid(nvml) == "GPU-aaaa" and nvml.shut  # type: ignore[arg-type]


@pytest.mark.parametrize("uuids", [[], ["GPU-a", "GPU-b"]])
def test_anything_but_one_gpu_fails(uuids: list[str]) -> None:
    with pytest.raises(RuntimeError, match=f"found {len(uuids)} GPUs, 1 was expected"):
        reserve.visible_uuid(FakeNvml(uuids))  # type: ignore[arg-type]


def test_no_nvml_says_what_to_check() -> None:
    with pytest.raises(RuntimeError, match="runtimeClassName: nvidia"):
        reserve.visible_uuid(FakeNvml([], fail=True))  # type: ignore[arg-type]


class FakeCore:
    def __init__(self, annotations: dict[str, str]) -> None:
        self.annotations, self.patches = annotations, []

    def read_namespaced_pod(self, name: str, ns: str) -> Any:
        return SimpleNamespace(metadata=SimpleNamespace(annotations=dict(self.annotations)))

    def patch_namespaced_pod(self, name: str, ns: str, body: Any, **kw: Any) -> None:
        self.patches.append((name, ns, body, kw.get("_content_type")))


def test_the_uuid_is_patched_on_the_own_pod_once() -> None:
    assert reserve.ANNOTATION_UUID == rsv.ANNOTATION_UUID and reserve.READY_FILE == rsv.READY_FILE
    core = FakeCore({})
    reserve.report(core, "r", "vllmfit", "GPU-aaaa")
    assert core.patches == [("r", "vllmfit", {"metadata": {"annotations": {rsv.ANNOTATION_UUID: "GPU-aaaa"}}},
                             "application/merge-patch+json")]
    again = FakeCore({rsv.ANNOTATION_UUID: "GPU-aaaa"})  # a restarted container: nothing to write
    reserve.report(again, "r", "vllmfit", "GPU-aaaa")
    assert again.patches == []
    with pytest.raises(RuntimeError, match="already reports GPU-aaaa, NVML sees GPU-bbbb"):
        reserve.report(again, "r", "vllmfit", "GPU-bbbb")
