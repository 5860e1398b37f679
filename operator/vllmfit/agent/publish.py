"""Publishing the inventory as the node annotation `vllmfit.dev/gpu-inventory`, only when it
changed beyond jitter or got old."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vllmfit.core import defaults
from vllmfit.core.observe.inventory import GpuInventory

log = logging.getLogger("vllmfit.agent")


PUBLISH_EVERY_S = float(defaults.AGENT_PUBLISH_SECONDS)
"""Publish at least this often, even when nothing changed, so that sampled_at shows staleness."""
USED_JITTER_BYTES = defaults.FOOTPRINT_STABLE_BYTES
"""Changes of used bytes smaller than this do not trigger a publish on their own."""
MERGE_PATCH = "application/merge-patch+json"
def to_json(inventory: GpuInventory) -> str:
    return inventory.model_dump_json(by_alias=True, exclude_none=True)


def annotation_patch(inventory: GpuInventory) -> dict[str, Any]:
    """The merge patch that sets the inventory annotation and touches nothing else."""
    return {"metadata": {"annotations": {defaults.INVENTORY_ANNOTATION: to_json(inventory)}}}


def publish(inventory: GpuInventory, node_name: str, core_v1_api: Any) -> None:
    """Write the inventory annotation on the Node (kubernetes.client.CoreV1Api.patch_node).

    The content type is given explicitly: kubernetes>=35's generated client would otherwise send a
    dict body as a JSON Patch (its first choice), which the API server refuses.
    """
    core_v1_api.patch_node(
        node_name, annotation_patch(inventory), _content_type=MERGE_PATCH, _request_timeout=15
    )


def _same(a: Any, b: Any, jitter: int, key: str = "") -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], jitter, k) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y, jitter) for x, y in zip(a, b, strict=True))
    if key == "used_bytes" and isinstance(a, int) and isinstance(b, int):
        return abs(a - b) < jitter
    return bool(a == b)


def changed(old: GpuInventory | None, new: GpuInventory, jitter_bytes: int = USED_JITTER_BYTES) -> bool:
    """Whether `new` differs from `old` in anything but sampled_at and used-bytes jitter."""
    if old is None:
        return True
    a = old.model_dump(exclude={"sampled_at"})
    b = new.model_dump(exclude={"sampled_at"})
    return not _same(a, b, jitter_bytes)


class Publisher:
    """Publishes an inventory when it changed since the last publish, or when the last publish is
    `refresh_s` old. A failed publish is logged and retried at the next offer."""

    def __init__(
        self,
        core_v1_api: Any,
        node_name: str,
        *,
        refresh_s: float = PUBLISH_EVERY_S,
        jitter_bytes: int = USED_JITTER_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = core_v1_api
        self.node_name = node_name
        self.refresh_s = refresh_s
        self.jitter_bytes = jitter_bytes
        self.clock = clock
        self.last: GpuInventory | None = None
        self.last_at: float | None = None
        self.failures = 0

    def due(self, inventory: GpuInventory) -> bool:
        if self.last_at is None or self.clock() - self.last_at >= self.refresh_s:
            return True
        return changed(self.last, inventory, self.jitter_bytes)

    def offer(self, inventory: GpuInventory) -> bool:
        """Publish if due; True when it published."""
        if not self.due(inventory):
            return False
        try:
            publish(inventory, self.node_name, self.api)
        except Exception as e:  # noqa: BLE001 - API/network errors: retry at the next sample
            self.failures += 1
            lines = str(e).strip().splitlines()
            log.warning("cannot patch node %s: %s", self.node_name, lines[0] if lines else type(e).__name__)
            return False
        self.last, self.last_at = inventory, self.clock()
        return True


