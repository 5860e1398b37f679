"""The webhook's transport limits over real HTTPS on loopback (core/defaults.py WEBHOOK_*): an
oversized body gets 413, a client that stops half way through its body is dropped with 408 after
the read timeout, and connections beyond the concurrency limit get 429 at once, so a flood of
half-sent requests neither stops a normal review for longer than the read timeout nor buffers
memory without bound. Below HTTP: a client that never finishes its TLS handshake or its request
headers is disconnected, and connections beyond the cap are closed at accept while those within
it are served. Hang guards only (each below what aiohttp or asyncio would wait without the limit);
no timing assertions.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest
from webhook_harness import FakeStore, Harness, admission_review, gfd_node, vllmd

from vllmfit.core import defaults
from vllmfit.operator.admission import webhook

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
    assert (s.max_connections, s.handshake_timeout, s.header_timeout, s.idle_timeout) == (128, 5.0, 5.0, 120.0)
    assert (defaults.WEBHOOK_MAX_CONNECTIONS, defaults.WEBHOOK_HANDSHAKE_TIMEOUT_S, defaults.WEBHOOK_HEADER_TIMEOUT_S,
            defaults.WEBHOOK_IDLE_TIMEOUT_S) == (s.max_connections, s.handshake_timeout, s.header_timeout,
                                                 s.idle_timeout)
    # the idle timeout outlasts kube-apiserver's (Go's http.DefaultTransport: 90 s), so the client
    # closes an idle connection first and never sends a review on one the server is closing
    assert defaults.WEBHOOK_IDLE_TIMEOUT_S > 90


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
    server.server.max_connections = 2 * n  # this test is about reviews in flight, not connections
    before = rss_bytes()

    t0 = time.monotonic()
    conns = [half_sent(server) for _ in range(n)]
    # a slot frees after READ_TIMEOUT_S (408): on a loaded machine, where opening the 200
    # connections takes longer than that, later ones may take freed slots (and get 408 too)
    windows = 1 + int((time.monotonic() - t0) // READ_TIMEOUT_S)
    peak = rss_bytes()
    ok = normal_review(server)
    # all slots held by half-sent clients until their read timeout frees them (408): retry until
    # then, and a little after, never longer
    deadline = time.monotonic() + 2 * READ_TIMEOUT_S
    while ok.status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
        ok = normal_review(server)
    statuses = [answer(s) for s in conns]
    assert ok.status_code == 200 and ok.json()["response"]["allowed"] is True
    assert set(statuses) <= {408, 429}
    assert statuses.count(408) <= windows * server.server.max_concurrent  # never more than N read at once
    assert statuses.count(429) >= n - (windows + 1) * server.server.max_concurrent  # most refused at once
    assert max(peak, rss_bytes()) - before < 100 * 1024 * 1024
    assert server.server.in_flight == 0
    server.server.max_connections = defaults.WEBHOOK_MAX_CONNECTIONS


# --- connections --------------------------------------------------------------------------------

SHORT_S = 0.5  # the test server's handshake and header timeouts
CONN_GUARD_S = 30  # below asyncio's 60 s handshake timeout and aiohttp's 3,630 s keep-alive


@pytest.fixture
def tight(server):
    """The module's server with short handshake/header timeouts and a small connection cap."""
    s = server.server
    for _ in range(200):  # until the server has seen earlier tests' clients close
        if not s.connections:
            break
        time.sleep(0.05)
    saved = s.handshake_timeout, s.header_timeout, s.max_connections
    s.handshake_timeout, s.header_timeout, s.max_connections = SHORT_S, SHORT_S, 8
    yield server
    s.handshake_timeout, s.header_timeout, s.max_connections = saved


def closed_by_server(s: socket.socket) -> bytes:
    """What the server sent before closing the connection (the socket's timeout is the hang guard:
    socket.timeout means it was never closed)."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (ConnectionResetError, ssl.SSLEOFError):
        pass
    s.close()
    return data


def tls_connection(h) -> ssl.SSLSocket:
    return h.ctx.wrap_socket(socket.create_connection(("127.0.0.1", h.port), timeout=CONN_GUARD_S),
                             server_hostname="127.0.0.1")


def keep_alive_review(s: ssl.SSLSocket) -> int:
    """One review on an open keep-alive connection; the HTTP status."""
    body = review_bytes()
    s.sendall(f"POST /{webhook.VALIDATE_ID} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])
    while len(rest) < length:
        rest += s.recv(65536)
    return int(head.split(b" ", 2)[1])


def test_a_client_that_never_finishes_its_headers_is_disconnected(tight):
    before = tight.server.header_timeouts
    s = tls_connection(tight)
    s.sendall(f"POST /{webhook.VALIDATE_ID} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl".encode())
    assert closed_by_server(s) == b""  # no answer: the request never reached the application
    s = tls_connection(tight)  # the same after a first request on a keep-alive connection
    assert keep_alive_review(s) == 200
    s.sendall(b"POST / HTTP/1.1\r\nHo")
    assert closed_by_server(s) == b""
    s = tls_connection(tight)  # and when TLS is up and nothing is sent at all
    assert closed_by_server(s) == b""
    assert tight.server.header_timeouts == before + 3
    assert normal_review(tight).json()["response"]["allowed"] is True


@pytest.mark.parametrize("hello", [b"", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"])  # none, a partial ClientHello
def test_a_client_that_never_finishes_the_tls_handshake_is_disconnected(tight, hello):
    s = socket.create_connection(("127.0.0.1", tight.port), timeout=CONN_GUARD_S)
    s.sendall(hello)
    assert closed_by_server(s) == b""
    assert normal_review(tight).json()["response"]["allowed"] is True


def test_connections_beyond_the_cap_are_closed_at_once_while_those_within_it_are_served(tight):
    cap = tight.server.max_connections
    refused = tight.server.refused
    within = [tls_connection(tight) for _ in range(cap)]
    assert [keep_alive_review(s) for s in within] == [200] * cap
    extra = socket.create_connection(("127.0.0.1", tight.port), timeout=CONN_GUARD_S)
    assert closed_by_server(extra) == b""  # closed before TLS: not even a ServerHello
    with pytest.raises((ssl.SSLError, ConnectionError)):
        tls_connection(tight)
    assert tight.server.refused == refused + 2
    assert [keep_alive_review(s) for s in within] == [200] * cap  # still served, on the same connections
    within.pop().close()
    for _ in range(100):  # the slot is free once the server has seen the close
        if len(tight.server.connections) < cap:
            break
        time.sleep(0.05)
    late = tls_connection(tight)
    assert keep_alive_review(late) == 200
    for s in [*within, late]:
        s.close()


def test_memory_stays_bounded_under_a_flood_of_connections_that_never_speak(tight):
    """asyncio allocates a 256 KiB TLS buffer per accepted connection, before the handshake: 1,000
    such connections grew an uncapped server by 299 MiB. Capped, only `cap` are accepted."""
    tight.server.max_connections, tight.server.handshake_timeout = 32, CONN_GUARD_S  # hold them open
    n, refused = 400, tight.server.refused
    tracemalloc.start()  # Python's allocations (the TLS buffers are bytearrays): RSS would show the
    try:  # allocator reusing what earlier tests freed, not what this flood holds
        flood = [socket.create_connection(("127.0.0.1", tight.port), timeout=CONN_GUARD_S) for _ in range(n)]
        for _ in range(200):  # until the server has accepted or refused them all
            if len(tight.server.connections) + tight.server.refused - refused >= n:
                break
            time.sleep(0.05)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    open_now = len(tight.server.connections)
    for s in flood:
        s.close()
    print(f"{n} connections that never speak: {open_now} held, {tight.server.refused - refused} closed at accept, "
          f"{held / 2**20:.1f} MiB allocated")
    assert open_now == 32 and tight.server.refused - refused == n - 32
    assert held < 40 * 1024 * 1024  # uncapped: 400 x 256 KiB = 100 MiB; capped: 32 x 256 KiB = 8 MiB
    assert normal_review(tight).json()["response"]["allowed"] is True
