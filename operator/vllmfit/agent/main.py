"""`vllmfit agent`: the node agent's loop, its health endpoint and its command line."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import ModuleType
from typing import Any

from vllmfit.agent.nvml import NO_NVML_HINT, collect, no_nvml_reason
from vllmfit.agent.publish import PUBLISH_EVERY_S, Publisher, publish, to_json
from vllmfit.core import defaults
from vllmfit.core.errors import UserError
from vllmfit.core.observe.inventory import GpuInventory, InventoryProcess

log = logging.getLogger("vllmfit.agent")


class Health:
    """What the probes see.

    Readiness (/healthz, /readyz): 200 when NVML was read within `window_s`, else 503 "no NVML: ...".
    Liveness (/livez): 200 while the sampling loop turns (a beat within `live_window_s`), NVML or
    not, so a node without NVML keeps an unready agent that retries instead of a restarting one.
    """

    def __init__(
        self, window_s: float, clock: Callable[[], float] = time.monotonic, live_window_s: float | None = None
    ) -> None:
        self.window_s = window_s
        self.live_window_s = live_window_s if live_window_s is not None else 3 * window_s + 60
        self.clock = clock
        self.last_ok: float | None = None
        self.last_beat = clock()
        self.reason = "no NVML sample yet"

    def beat(self) -> None:
        self.last_beat = self.clock()

    def mark(self, inventory: GpuInventory) -> None:
        self.beat()
        if inventory.nvml:
            self.last_ok = self.clock()
        else:
            self.reason = no_nvml_reason(inventory)

    def status(self) -> tuple[int, str]:
        if self.last_ok is not None and self.clock() - self.last_ok <= self.window_s:
            return 200, "ok\n"
        if self.last_ok is not None:
            return 503, f"no NVML: last good read {self.clock() - self.last_ok:.0f}s ago ({self.reason})\n"
        return 503, f"no NVML: {self.reason}\n"

    def liveness(self) -> tuple[int, str]:
        age = self.clock() - self.last_beat
        if age <= self.live_window_s:
            return 200, "ok\n"
        return 503, f"sampling loop stuck for {age:.0f}s\n"


def serve_health(health: Health, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve GET /healthz and /readyz (readiness) and /livez (liveness) on a daemon thread;
    port 0 picks a free port (server.server_address[1])."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path in ("/healthz", "/readyz"):
                code, body = health.status()
            elif path == "/livez":
                code, body = health.liveness()
            else:
                code, body = 404, "not found\n"
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="vllmfit-agent-health", daemon=True
    ).start()
    return server


def core_v1_api() -> Any:
    """A CoreV1Api from the in-cluster service account, else from ~/.kube/config."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as e:

            raise UserError(f"no Kubernetes configuration (in-cluster or kubeconfig): {e}") from e
    return client.CoreV1Api()


def run(
    node_name: str,
    interval: float = 30.0,
    once: bool = False,
    *,
    nvml: ModuleType | None = None,
    proc_root: str | os.PathLike[str] = "/proc",
    api: Any = None,
    health_port: int | None = None,
    stop: threading.Event | None = None,
    refresh_s: float = PUBLISH_EVERY_S,
    mps_pipe: str | None = None,
) -> int:
    """Sample every `interval` seconds and publish (on change, at least every `refresh_s`), until
    SIGTERM/SIGINT or `stop` is set. Without NVML it keeps publishing `nvml: false`, reports 503
    on /healthz and retries. Returns the exit code (0)."""
    if interval <= 0:
        raise ValueError(f"interval must be positive, got {interval}")
    stop = stop or threading.Event()
    publisher = Publisher(api if api is not None else core_v1_api(), node_name, refresh_s=refresh_s)
    health = Health(window_s=2 * interval, live_window_s=3 * interval + 60)
    server = serve_health(health, health_port) if health_port else None
    old_handlers: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            old_handlers[sig] = signal.signal(sig, lambda *_: stop.set())
    nvml_state: bool | None = None
    try:
        while not stop.is_set():
            try:
                inv = collect(nvml, proc_root, mps_pipe=mps_pipe)
            except Exception as e:  # noqa: BLE001 - a bug must not kill the DaemonSet pod silently
                log.error("sampling failed: %s: %s", type(e).__name__, e)
                health.beat()
            else:
                health.mark(inv)
                if inv.nvml != nvml_state:
                    nvml_state = inv.nvml
                    if inv.nvml:
                        log.info("NVML OK: %d GPU(s), driver %s", len(inv.gpus), inv.driver_version)
                    else:
                        log.warning(
                            "no NVML (%s); %s Retrying every %gs.",
                            no_nvml_reason(inv),
                            NO_NVML_HINT,
                            interval,
                        )
                publisher.offer(inv)
            if once:
                break
            stop.wait(interval)
    finally:
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)
        if server is not None:
            server.shutdown()
            server.server_close()
    return 0


# --- CLI -----------------------------------------------------------------------------------------


def _gib(b: int) -> str:
    return f"{b / defaults.GIB:.1f} GiB"


def render_table(inventory: GpuInventory) -> Any:
    """A rich Table of the inventory (the JSON output has everything, UUIDs included)."""
    from rich.table import Table

    t = Table(title=f"GPUs (driver {inventory.driver_version or '?'}, sampled {inventory.sampled_at})")
    for col in ("GPU", "Product", "Used / total", "Processes: pid pod bytes", "Error"):
        t.add_column(col, overflow="fold")

    def procs(ps: list[InventoryProcess]) -> str:
        return "\n".join(f"{p.pid} {(p.pod_uid or '-')[:8]} {_gib(p.used_bytes)}" for p in ps)

    for g in inventory.gpus:
        mem = f"{_gib(g.used_bytes)} / {_gib(g.total_bytes)}"
        t.add_row(
            str(g.index),
            g.product + (" (MIG)" if g.mig_enabled else ""),
            mem,
            procs(g.processes),
            g.error or "",
        )
        for m in g.mig_devices:
            mem = f"{_gib(m.used_bytes)} / {_gib(m.total_bytes)}"
            t.add_row(f"{g.index}/{m.index}", f"MIG {m.profile}", mem, procs(m.processes), "")
    return t


def _node_name(args: argparse.Namespace) -> str:

    name = args.node_name or os.environ.get("NODE_NAME", "")
    if not name:
        raise UserError(
            "no node name: pass --node-name or set NODE_NAME (the DaemonSet sets it from spec.nodeName)"
        )
    return name


def _command(args: argparse.Namespace) -> int:

    if args.interval <= 0:
        raise UserError(f"--interval must be positive, got {args.interval}")
    if not 0 <= args.health_port <= 65535:
        raise UserError(f"--health-port must be 0..65535, got {args.health_port}")
    if not args.once:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run(_node_name(args), args.interval, health_port=args.health_port or None,
                   mps_pipe=args.mps_pipe_directory)

    inv = collect(mps_pipe=args.mps_pipe_directory)
    if args.output == "json":
        print(to_json(inv))
    elif inv.nvml:
        from rich.console import Console

        Console().print(render_table(inv))
    if args.publish:
        publish(inv, _node_name(args), core_v1_api())
    if not inv.nvml:
        print(
            f"vllmfit agent: no NVML on this machine ({no_nvml_reason(inv)}); {NO_NVML_HINT}", file=sys.stderr
        )
        return 1
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "agent",
        help="node agent: publish this node's GPU memory inventory (NVML) as a node annotation",
        description="Read every GPU through NVML, map GPU processes to pods, and publish the result "
        f"as the node annotation {defaults.INVENTORY_ANNOTATION}. With --once: print one sample and exit "
        "(exit code 1 when NVML is not available).",
    )
    p.add_argument("--node-name", default=None, help="this node's name (default: $NODE_NAME)")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between samples (default 30)")
    p.add_argument("--once", action="store_true", help="sample once, print, exit")
    p.add_argument("--publish", action="store_true", help="with --once: also patch the node annotation")
    p.add_argument("--output", "-o", choices=("json", "table"), default="table", help="output of --once")
    p.add_argument(
        "--health-port", type=int, default=8082, help="port of GET /healthz (0: none; default 8082)"
    )
    p.add_argument("--mps-pipe-directory", default=None, metavar="DIR",
                   help="the MPS control daemon's pipe directory as mounted here: its control socket there makes "
                        "the node report MPS enforcement (default: none)")
    p.set_defaults(func=_command)
    return p
