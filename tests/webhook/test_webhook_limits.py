"""The webhook's transport limits over real HTTPS on loopback (core/defaults.py WEBHOOK_*): an
oversized body gets 413, a client that stops half way through its body is dropped with 408 after
the read timeout, and connections beyond the concurrency limit get 429 at once, so a flood of
half-sent requests neither stops a normal review for longer than the read timeout nor buffers
memory without bound. Hang guards only; no timing assertions.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import time
from pathlib import Path

import httpx
import pytest
from webhook_harness import FakeStore, Harness, admission_review, gfd_node, vllmd

from vllmfit.core import defaults
from vllmfit.operator import webhook

MODEL_8B = "meta-llama/Llama-3.1-8B-Instruct"
READ_TIMEOUT_S = 1.0  # the test server's; the default (5 s) is checked below
HANG_GUARD_S = 60


@pytest.fixture(scope="module")
def server():
    with Harness(FakeStore([gfd_node("gpu-node-a", 1)])) as h:
        h.server.read_timeout = READ_TIMEOUT_S
        h.ctx = h.ssl_context()  # one client context for all connections (each costs ~0.5 MB)
        yield h


def review_bytes() -> bytes:
    return json.dumps(admission_review(vllmd("fits", model=MODEL_8B))).encode()


def normal_review(h) -> httpx.Response:
    with httpx.Client(base_url=h.url, verify=h.ctx, timeout=HANG_GUARD_S) as c:
        return c.post(f"/{webhook.VALIDATE_ID}", content=review_bytes(),
                      headers={"Content-Type": "application/json"})


def rss_bytes() -> int:
    m = re.search(r"^VmRSS:\s+(\d+) kB$", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert m
    return int(m.group(1)) * 1024


def half_sent(h, body: bytes = b'{"apiVersion": "admission.k8s.io/v1", ') -> ssl.SSLSocket:
    """A connection that sends its headers (Content-Length 1000) and the start of the body only.
    Blocking sockets: asyncio's TLS transport would add a 256 KiB buffer per connection to this
    process, which the server shares."""
    s = h.ctx.wrap_socket(socket.create_connection(("127.0.0.1", h.port), timeout=HANG_GUARD_S),
                          server_hostname="127.0.0.1")
    s.sendall(f"POST /{webhook.VALIDATE_ID} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: 1000\r\n\r\n".encode() + body)
    return s


def answer(s: ssl.SSLSocket) -> int:
    """The status the server sent; returns once the server has closed the connection."""
    data = b""
    while chunk := s.recv(65536):  # the socket's timeout is the hang guard
        data += chunk
    s.close()
    return int(data.split(b" ", 2)[1])


def test_the_limits_are_named_in_defaults_and_used_by_setup():
    s = webhook.Server()
    assert (s.max_body, s.read_timeout, s.max_concurrent) == (1024 * 1024, 5.0, 32)
    assert (defaults.WEBHOOK_MAX_BODY_BYTES, defaults.WEBHOOK_READ_TIMEOUT_S, defaults.WEBHOOK_MAX_CONCURRENT) \
        == (s.max_body, s.read_timeout, s.max_concurrent)


def test_an_oversized_body_is_refused_with_413(server):
    big = b" " * (defaults.WEBHOOK_MAX_BODY_BYTES + 1)  # JSON whitespace: only its size is wrong
    with httpx.Client(base_url=server.url, verify=server.ctx, timeout=HANG_GUARD_S) as c:
        r = c.post(f"/{webhook.VALIDATE_ID}", content=big)
        assert r.status_code == 413 and str(defaults.WEBHOOK_MAX_BODY_BYTES) in r.text
        # chunked, no Content-Length: counted while read
        r = c.post(f"/{webhook.VALIDATE_ID}", content=iter([big[:600_000], big[600_000:]]))
        assert r.status_code == 413
        # exactly the limit is read (and is not JSON: 400, not 413)
        r = c.post(f"/{webhook.VALIDATE_ID}", content=big[:-1])
        assert r.status_code == 400
    assert normal_review(server).json()["response"]["allowed"] is True


def test_a_client_that_stops_half_way_is_dropped_while_a_normal_review_succeeds(server):
    slow = half_sent(server)
    ok = normal_review(server)
    assert ok.status_code == 200 and ok.json()["response"]["allowed"] is True
    assert answer(slow) == 408


def test_200_half_sent_connections_get_429_or_408_and_a_normal_review_still_passes(server):
    n = 200
    before = rss_bytes()

    conns = [half_sent(server) for _ in range(n)]
    peak = rss_bytes()
    ok = normal_review(server)
    while ok.status_code == 429:  # all slots held by half-sent clients until their read timeout
        time.sleep(0.2)
        ok = normal_review(server)
    statuses = [answer(s) for s in conns]
    assert ok.status_code == 200 and ok.json()["response"]["allowed"] is True
    assert set(statuses) <= {408, 429}
    assert statuses.count(408) <= server.server.max_concurrent  # never more than N read at once
    assert statuses.count(429) >= n - 2 * server.server.max_concurrent  # most refused at once
    assert max(peak, rss_bytes()) - before < 100 * 1024 * 1024
    assert server.server.in_flight == 0
