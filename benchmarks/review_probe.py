"""Admission reviews while the operator is busy: operator_scale.py --reviews.

The operator serves its admission webhook in its own process (vllmfit.operator.admission), so a
review shares the event loop, the decision workers and the garbage collector with everything the
operator does. webhook_latency.py measures reviews of an idle operator; this measures them while
the operator settles a burst of creates. The real webhook (webhook.setup, as `vllmfit-operator`
starts it, with certificates from certs.py in a --cert-dir) is served by the benchmark's operator;
a client in a child process (as kube-apiserver is another process) sends one validating review of
a new VLLMDeployment every `interval` seconds over one keep-alive TLS connection, from the first
POST until every child is written, and reports each review's latency and answer.

Paced, not as fast as it can: a client that never rests would take a core from the operator and
the emulator on two cores, and a real apiserver sends the reviews of the applies themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

INTERVAL_S = 0.02
"""One review every 20 ms (50 a second): about 1 % of a core for the client and the server each."""


def webhook_args(port: int, cert_dir: str) -> argparse.Namespace:
    """The operator's own webhook flags (webhook.add_arguments), with certificates in `cert_dir`
    (the --cert-dir a cert-manager install uses) and the server on 127.0.0.1:`port`."""
    from vllmfit.operator.admission import webhook

    p = argparse.ArgumentParser()
    webhook.add_arguments(p)
    return p.parse_args(["--cert-dir", cert_dir, "--webhook-host", "127.0.0.1", "--webhook-port", str(port)])


class Probe:
    """The webhook on the operator's settings (`serve`), then the paced client (`start`/`stop`)."""

    def __init__(self, port: int, interval: float = INTERVAL_S) -> None:
        from vllmfit.operator.admission import certs, webhook

        self.port, self.interval = port, interval
        self.dir = tempfile.TemporaryDirectory(prefix="review-probe-")
        certs.write(certs.generate("vllmfit-webhook", "default"), self.dir.name)
        self.url = f"https://127.0.0.1:{port}/{webhook.VALIDATE_ID}"
        ctx = mp.get_context("spawn")
        self.go, self.halt = ctx.Event(), ctx.Event()
        self.receiver, sender = ctx.Pipe(duplex=False)
        self.child = ctx.Process(target=client, args=(self.url, str(Path(self.dir.name) / certs.CA_KEY),
                                                      self.interval, self.go, self.halt, sender), daemon=True)

    def serve(self, settings: Any, store: Any) -> None:
        from vllmfit.operator.admission import webhook

        webhook.setup(settings, webhook_args(self.port, self.dir.name), store)

    def start(self) -> None:
        """Start the client (it connects and warms up), then let it send; returns once it sends."""
        self.child.start()
        if not self.receiver.poll(60):
            raise RuntimeError("the review client did not connect")
        self.receiver.recv()  # "warm"
        self.go.set()

    def stop(self) -> dict[str, Any]:
        """Stop sending; the reviews' figures (latencies in ms)."""
        self.halt.set()
        got: dict[str, Any] = self.receiver.recv() if self.receiver.poll(60) else {"latencies": [], "denied": 0}
        self.child.join(10)
        self.dir.cleanup()
        return summary(got)


def summary(got: dict[str, Any]) -> dict[str, Any]:
    """The figures of a run: how many reviews were answered, their latency p50 / p99 / max (ms),
    how many were denied and how many got no answer (None for the latencies of fewer than two)."""
    lat = sorted(1000 * x for x in got["latencies"])
    q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) >= 2 else None
    return {"count": len(lat), "p50_ms": round(q[49], 2) if q else None, "p99_ms": round(q[98], 2) if q else None,
            "max_ms": round(lat[-1], 2) if q else None, "denied_count": got["denied"],
            "failed_count": got.get("failed", 0)}


def bodies(n: int) -> list[bytes]:
    """`n` AdmissionReviews (CREATE) of new VLLMDeployments drawn from the benchmark's own mix."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "webhook"))
    from operator_scale import deployments
    from webhook_harness import admission_review

    objs = deployments(n, random.Random(1))
    for i, o in enumerate(objs):
        o["metadata"]["name"] = f"probe-{i:05d}"
    return [json.dumps(admission_review(o, namespace=o["metadata"]["namespace"])).encode() for o in objs]


def client(url: str, cafile: str, interval: float, go: Any, halt: Any, out: Any) -> None:
    """The child process: warm up, say so, wait for `go`, then one review every `interval` s until
    `halt`; sends back the latencies (s), the denials and the failures (no answer, not 200)."""
    asyncio.run(_client(url, cafile, interval, go, halt, out))


async def _client(url: str, cafile: str, interval: float, go: Any, halt: Any, out: Any) -> None:
    import ssl

    import aiohttp

    work = bodies(4000)
    latencies: list[float] = []
    denied = failed = 0
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=cafile),
                                                                    limit=1)) as s:
        deadline = time.monotonic() + 30
        for body in work[:20]:  # the connection, TLS and the server's first answers
            while True:
                try:
                    async with s.post(url, data=body, headers=headers) as r:
                        await r.read()
                    break
                except aiohttp.ClientConnectorError:  # Kopf starts the server with the operator
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)
        out.send("warm")
        while not go.is_set():
            await asyncio.sleep(0.005)
        i, t_next = 20, time.perf_counter()
        while not halt.is_set():
            t = time.perf_counter()
            try:
                async with s.post(url, data=work[i % len(work)], headers=headers,
                                  timeout=aiohttp.ClientTimeout(total=30)) as r:
                    answer = await r.json()
                latencies.append(time.perf_counter() - t)
                denied += not answer["response"]["allowed"]
            except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                failed += 1
            i += 1
            t_next = max(t_next + interval, time.perf_counter())  # late: the next one now, not a catch-up burst
            await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
    out.send({"latencies": latencies, "denied": denied, "failed": failed})
