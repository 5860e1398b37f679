"""The admission webhooks' HTTPS server: Kopf's aiohttp server with limits, client
authentication and a guard that answers every request with an AdmissionReview or a plain 4xx
(never a 500), served from its own thread and event loop so that a review never queues behind the
operator's work. What a review decides is `vllmfit.operator.admission.webhook`; this is the
transport. docs/webhook.md ("Who can reach the webhook", "Client authentication", "A review while
the operator is busy") says why each limit is there and what was measured.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf

from vllmfit.core import defaults
from vllmfit.operator.admission.ownloop import HOME, OwnLoop, at_home

logger = logging.getLogger(__name__)

VALIDATE_ID = "validate-vllmdeployment"
"""The validating webhook's path (= its Kopf handler id)."""
MUTATE_ID = "default-vllmdeployment"
"""The mutating webhook's path (= its Kopf handler id)."""
MAX_MESSAGE = 2000
REASONS = {400: "BadRequest", 403: "Forbidden", 409: "Conflict", 422: "Invalid"}


def clip(message: str) -> str:
    message = " ".join(str(message).split())
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."


# --- The server ---------------------------------------------------------------------------------


def denial(data: Any, message: str, code: int = 400) -> dict[str, Any]:
    """A denied AdmissionReview v1 response (the uid copied when there is one)."""
    req = data.get("request") if isinstance(data, dict) else None
    uid = req.get("uid") if isinstance(req, dict) and isinstance(req.get("uid"), str) else ""
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {
        "uid": uid, "allowed": False,
        "status": {"code": code, "reason": REASONS.get(code, "BadRequest"), "message": clip(message)}}}


def review_problem(data: Any) -> str | None:
    """What makes `data` not an AdmissionReview request Kopf can serve, or None."""
    req = data.get("request") if isinstance(data, dict) else None
    if not isinstance(req, dict):
        return "not an AdmissionReview: request is missing"
    for key, kind in (("uid", str), ("operation", str), ("resource", dict), ("userInfo", dict)):
        if not isinstance(req.get(key), kind):
            return f"request.{key} is missing or not a{'n object' if kind is dict else ' string'}"
    if not all(isinstance(req["resource"].get(k), str) for k in ("group", "version", "resource")):
        return "request.resource needs group, version and resource strings"
    obj, old = req.get("object"), req.get("oldObject")
    if not isinstance(obj, dict) and not isinstance(old, dict):
        return "request.object is missing or not an object"
    for key in ("object", "oldObject"):
        if req.get(key) is not None and not isinstance(req[key], dict):
            return f"request.{key} is not an object"
        if isinstance(req.get(key), dict) and not isinstance(req[key].get("metadata", {}), dict):
            return f"request.{key}.metadata is not an object"
    if not isinstance(req.get("dryRun", False), bool | None):
        return "request.dryRun is not a boolean"
    return None


def _finish(response: dict[str, Any]) -> dict[str, Any]:
    """Every denial gets a 4xx code, a reason (kubectl prints it) and a message."""
    r = response.get("response", {})
    if not r.get("allowed"):
        status = r.setdefault("status", {})
        code = status.get("code") or 403
        status["code"] = 400 if code >= 500 or code < 400 else code
        status.setdefault("reason", REASONS.get(status["code"], "BadRequest"))
        status["message"] = clip(status.get("message") or "denied by vllmfit without a reason")
    return response


def client_name_problem(peercert: Mapping[str, Any] | None, allowed: Collection[str]) -> str | None:
    """Why a verified client certificate is not one the webhook serves, or None: its subject CN or
    one of its DNS SANs must be in `allowed` (--webhook-client-name; empty: any name). `peercert`
    is what ssl.SSLSocket.getpeercert() returns."""
    if not allowed:
        return None
    if not peercert:
        return "no client certificate; --webhook-client-name needs --webhook-client-ca"
    cns = [v for rdn in peercert.get("subject", ()) for k, v in rdn if k == "commonName"]
    dns = [v for k, v in peercert.get("subjectAltName", ()) if k == "DNS"]
    if set(cns + dns) & set(allowed):
        return None
    names = " ".join(", ".join([f"CN={c}" for c in cns] + [f"DNS:{d}" for d in dns]).split()) or "no CN or DNS name"
    names = names if len(names) <= 200 else names[:197] + "..."
    return f"client certificate ({names}) is not an allowed API server name (--webhook-client-name)"


class _Connection(asyncio.Protocol):
    """One client connection from accept to close, in front of aiohttp's request handler. Kopf's
    server gives aiohttp a TLS listener with no limits on connections; this adds them:

    - a slot from accept, before any TLS work: beyond `server.max_connections` open connections a
      new one is closed at once (asyncio allocates a 256 KiB TLS buffer per connection, and each
      holds a file descriptor);
    - TLS must be up within `server.handshake_timeout` (asyncio's start_tls; its default is 60 s);
    - a request's line and headers must arrive within `server.header_timeout` of its first byte,
      or, for the first request, of TLS being up (aiohttp's only timer is the idle keep-alive);

    and the slot is released when the connection closes, whichever way."""

    def __init__(self, server: Server, make_handler: Callable[[], asyncio.Protocol], context: ssl.SSLContext | None):
        self.server, self.make_handler, self.context = server, make_handler, context
        self.transport: Any = None  # the TCP transport, then the TLS one
        self.handler: Any = None  # aiohttp's RequestHandler, once TLS is up
        self.deadline: asyncio.TimerHandle | None = None
        self.in_request = False
        self.closed = False
        self.early: list[bytes] = []  # what arrived between the handshake and _ready (one read at most)

    def connection_made(self, transport: Any) -> None:  # TCP accepted
        self.transport = transport
        if len(self.server.connections) >= self.server.max_connections:
            self.server.refused += 1
            self.closed = True
            transport.abort()
            return
        self.server.connections.add(self)
        if self.context is None:
            self._ready(transport)
            return
        transport.pause_reading()  # the ClientHello waits in the socket for start_tls
        asyncio.get_running_loop().create_task(self._handshake(transport))

    async def _handshake(self, tcp: Any) -> None:
        try:
            tls = await asyncio.get_running_loop().start_tls(
                tcp, self, self.context, server_side=True, ssl_handshake_timeout=self.server.handshake_timeout)
        except Exception as e:  # noqa: BLE001 - no or a refused client certificate, a timeout, a reset
            logger.debug("webhook TLS handshake failed: %s", e)
            # Its traceback holds start_tls's frame, whose waiter holds it: a cycle that would keep
            # the connection's 256 KiB TLS buffer until a full GC (measured: 4x the cap alive).
            e.__traceback__ = None
            self.close()
            return
        if tls is None or self.closed:  # the client left right after the handshake
            self.close()
            return
        self._ready(tls)

    def _ready(self, transport: Any) -> None:
        """TLS is up: aiohttp's handler takes the connection, and the first request is due."""
        self.transport = transport
        self.handler = self.make_handler()
        self.handler.connection_made(transport)
        self._arm()
        for data in self.early:
            self.data_received(data)
        self.early.clear()

    def _arm(self) -> None:
        self.deadline = asyncio.get_running_loop().call_later(self.server.header_timeout, self._expired)

    def _expired(self) -> None:
        self.deadline = None
        self.server.header_timeouts += 1
        self.close()

    def headers_complete(self) -> None:
        """A request reached the application (aiohttp parsed its line and headers)."""
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self.in_request = True

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        self._release()

    def _release(self) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    # asyncio.Protocol, forwarded to aiohttp once TLS is up
    def data_received(self, data: bytes) -> None:
        if self.handler is None:  # asyncio reads on as soon as TLS is up, before start_tls returns
            self.early.append(data)
            return
        if self.deadline is None and not self.in_request:  # the first bytes of the next request
            self._arm()
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        if self.handler is not None:
            self.handler.connection_lost(exc)


class Server(kopf.WebhookServer):
    """Kopf's aiohttp HTTPS server (its TLS context, URL and client-config helpers), with its own
    `__call__`: Kopf's starts an aiohttp TCPSite with no hook for connection limits, and watches
    the certificate files but not verify_cafile. What it adds:
    - `tls`, an async callable run when serving starts, returns (cafile, certfile, pkeyfile);
      it is retried with back-off, so a missing RBAC rule or a slow apiserver delays the webhook
      but never stops the operator;
    - a guard: a body that is not JSON gets HTTP 400, a malformed AdmissionReview or any exception
      a denied review with a message; unknown paths get 404. Never an HTTP 500.
    - limits (core/defaults.py WEBHOOK_*): a body over `max_body` bytes gets 413; a body not
      complete within `read_timeout` seconds gets 408 and the connection is closed; beyond
      `max_concurrent` requests in flight (reading or deciding) the next gets 429 at once;
      connections: see _Connection (a cap, a handshake and a header timeout) and `idle_timeout`;
    - client authentication (`client_ca`, Kopf's verify_cafile): the API server must present a
      certificate the CA signed (ssl.CERT_REQUIRED), else the handshake fails; with
      `client_names`, its CN or a DNS SAN must be one of them, else HTTP 403 before anything is
      read or routed.
    - `answer(hook, review)`, when given, answers each checked AdmissionReview instead of Kopf's
      dispatch `fn` (webhook.Reviewer.answer: the same handlers, without Kopf's per-request cost).
    The certificate, key and CA files are re-read every `file_check_interval` seconds and the
    listener restarts when one changes (cert-manager renews in place; a ConfigMap changes in place).
    """

    def __init__(self, *, tls: Callable[[], Awaitable[tuple[Any, Any, Any]]] | None = None,
                 client_ca: str | os.PathLike[str] | None = None, client_names: Collection[str] = (),
                 max_body: int = defaults.WEBHOOK_MAX_BODY_BYTES,
                 read_timeout: float = defaults.WEBHOOK_READ_TIMEOUT_S,
                 max_concurrent: int = defaults.WEBHOOK_MAX_CONCURRENT,
                 max_connections: int = defaults.WEBHOOK_MAX_CONNECTIONS,
                 handshake_timeout: float = defaults.WEBHOOK_HANDSHAKE_TIMEOUT_S,
                 header_timeout: float = defaults.WEBHOOK_HEADER_TIMEOUT_S,
                 idle_timeout: float = defaults.WEBHOOK_IDLE_TIMEOUT_S,
                 answer: Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]] | None = None, **kwargs: Any):
        if client_ca is not None:
            kwargs.update(verify_cafile=client_ca, verify_mode=ssl.CERT_REQUIRED)
        super().__init__(**kwargs)
        self.tls, self.answer = tls, answer
        self.client_names = tuple(client_names)
        self.max_body, self.read_timeout, self.max_concurrent = max_body, read_timeout, max_concurrent
        self.max_connections, self.handshake_timeout = max_connections, handshake_timeout
        self.header_timeout, self.idle_timeout = header_timeout, idle_timeout
        self.home: asyncio.AbstractEventLoop | None = None  # the operator's loop (__call__; ownloop.at_home)
        self.own = OwnLoop("vllmfit-webhook")  # the listener and the reviews run on its loop
        # only touched from the webhook's own loop:
        self.in_flight = 0
        self.connections: set[_Connection] = set()
        self.refused = self.header_timeouts = 0  # connections closed at accept / for slow headers

    async def __call__(self, fn: Any) -> AsyncIterator[kopf.WebhookClientConfig]:
        """Kopf's server protocol: yields the client config whenever the listener (re)starts.
        The certificates are prepared here, on the operator's loop (they may need its API); the
        listener and every review then run on a loop of their own (`_serve` on `self.own`,
        vllmfit.operator.admission.ownloop says why)."""
        delay = 1.0
        while self.tls is not None:
            try:
                self.cafile, self.certfile, self.pkeyfile = await self.tls()
                break
            except Exception:
                logger.exception("webhook TLS setup failed; retrying in %.0f s", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60.0)
        self.home = asyncio.get_running_loop()
        configs: asyncio.Queue[Any] = asyncio.Queue()  # from the thread: a config, or the error that ended it

        def told(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the operator's loop is closed: nobody to tell
                self.home.call_soon_threadsafe(configs.put_nowait, item)

        self.own.start(lambda: self._serve(fn, told), told)
        try:
            while True:
                item = await configs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.own.stop()  # the listener and its connections close on the thread's loop

    async def _serve(self, fn: Any, told: Callable[[Any], None]) -> None:
        """The listener, restarted when the TLS files change, on this thread's loop."""

        async def handle(request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
            return await self._handle(fn, request)

        loop = asyncio.get_running_loop()
        cadata, context = await self._usable_ssl(wait_for_change=False)
        while True:
            # aiohttp's low-level server: one handler, no router, middlewares or application
            # signals (two paths; measured: a tenth of a review's server CPU, docs/webhook.md)
            runner = aiohttp.web.ServerRunner(aiohttp.web.Server(
                handle, keepalive_timeout=self.idle_timeout, max_headers=defaults.WEBHOOK_MAX_HEADERS))
            await runner.setup()
            try:
                port = self.port or self._allocate_free_port()
                listener = await loop.create_server(functools.partial(_Connection, self, runner.server, context),
                                                    self.addr or None, port, reuse_address=True, reuse_port=True)
                try:
                    told(self._client_config(cadata, context is not None, port))
                    cadata, context = await self._usable_ssl(wait_for_change=True)
                    logger.info("webhook TLS files changed; restarting the listener")
                finally:
                    listener.close()
                    for conn in list(self.connections):
                        conn.close()
            finally:
                await runner.cleanup()

    def _client_config(self, cadata: bytes | None, tls: bool, port: int) -> kopf.WebhookClientConfig:
        """What Kopf's own configuration manager would write (only used with settings.admission.managed)."""
        host = self.host or self.DEFAULT_HOST or self._get_accessible_addr(self.addr)
        config = kopf.WebhookClientConfig(url=self._build_url("https" if tls else "http", host, port, self.path or ""))
        if cadata is not None:
            config["caBundle"] = base64.b64encode(cadata).decode("ascii")
        return config

    def _files_digest(self) -> bytes:
        digest = hashlib.sha256()
        for path in (self.certfile, self.pkeyfile, self.cafile, self.verify_cafile):
            if path is not None:
                try:
                    digest.update(Path(path).read_bytes())
                except OSError:  # mid-rotation; the next look decides
                    digest.update(b"unreadable")
        return digest.digest()

    async def _usable_ssl(self, *, wait_for_change: bool) -> tuple[bytes | None, ssl.SSLContext | None]:
        """Kopf's TLS context from the files (`_build_ssl`: the certificate; with verify_cafile,
        ssl.CERT_REQUIRED and that CA only) and the CA bundle for the client config. With
        `wait_for_change`, first waits until one of the files changes. Files that make no context
        (half-written, a CA that is not PEM) are logged and looked at again every
        file_check_interval; meanwhile the listener keeps serving with the context it has."""
        seen = self._files_digest() if wait_for_change else None
        while True:
            if seen is None or self._files_digest() != seen:
                try:
                    return self._build_ssl()
                except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
                    logger.error("webhook TLS files unusable: %s; looking again in %g s", e, self.file_check_interval)
                    seen = self._files_digest()
            await asyncio.sleep(self.file_check_interval)

    async def _handle(self, fn: Any, request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """Every request, once aiohttp has its line and headers: ends the connection's header
        deadline, refuses a client certificate with a name not allowed (403, before routing),
        routes POST /validate-vllmdeployment and /default-vllmdeployment (else 404 or 405) and caps
        the requests in flight (429)."""
        conn = request.transport.get_protocol() if request.transport is not None else None
        if isinstance(conn, _Connection):
            conn.headers_complete()
        try:
            if self.client_names:
                peer = request.transport.get_extra_info("peercert") if request.transport is not None else None
                problem = client_name_problem(peer, self.client_names)
                if problem:
                    logger.warning("webhook request refused: %s", problem)
                    return _closing(aiohttp.web.Response(status=403, text=problem))
            prefix, _, hook = request.path.rpartition("/")
            if prefix != (self.path or "").rstrip("/") or hook not in (VALIDATE_ID, MUTATE_ID):
                return aiohttp.web.Response(
                    status=404, text=f"no webhook at {request.path}; the paths are /{VALIDATE_ID}, /{MUTATE_ID}")
            if request.method != "POST":
                return aiohttp.web.Response(status=405, text=f"{request.method} is not allowed; POST a review",
                                            headers={"Allow": "POST"})
            if self.in_flight >= self.max_concurrent:
                return _closing(aiohttp.web.Response(
                    status=429, text=f"more than {self.max_concurrent} admission reviews in flight; retry"))
            self.in_flight += 1
            try:
                return await self._limited(fn, request, hook)
            finally:
                self.in_flight -= 1
        finally:
            if isinstance(conn, _Connection):
                conn.in_request = False

    async def _read(self, request: aiohttp.web.BaseRequest) -> bytes | aiohttp.web.Response:
        """The body, or the 413/408 response; never more than max_body bytes buffered."""
        too_big = _closing(aiohttp.web.Response(status=413, text=f"the body is over {self.max_body} bytes"))
        if (request.content_length or 0) > self.max_body:
            return too_big
        if request.content.is_eof():  # all of it arrived with the headers (aiohttp's parser ended it)
            body = request.content.read_nowait()
            return too_big if len(body) > self.max_body else body
        body = bytearray()
        try:
            async with asyncio.timeout(self.read_timeout):
                while chunk := await request.content.readany():
                    body += chunk
                    if len(body) > self.max_body:
                        return too_big
        except TimeoutError:
            return _closing(aiohttp.web.Response(
                status=408, text=f"the body was not complete within {self.read_timeout:g} s"))
        return bytes(body)

    async def _limited(self, fn: Any, request: aiohttp.web.BaseRequest, hook: str) -> aiohttp.web.Response:
        body = await self._read(request)
        if isinstance(body, aiohttp.web.Response):
            return body
        try:
            data = json.loads(body)
        except Exception as e:  # noqa: BLE001 - not UTF-8, not JSON, nested too deep
            return aiohttp.web.json_response(denial(None, f"the body is not JSON: {e}"), status=400)
        problem = review_problem(data)
        if problem:
            return aiohttp.web.json_response(denial(data, problem))
        req = data["request"]
        for key in ("object", "oldObject"):  # CREATE objects may lack the namespace; the review has it
            if isinstance(req.get(key), dict) and isinstance(req.get("namespace"), str):
                req[key].setdefault("metadata", {}).setdefault("namespace", req["namespace"])
        HOME.set(self.home)  # this request's task: what needs the operator's loop goes there (at_home)
        try:
            if self.answer is not None:
                response = await self.answer(hook, data)
            else:  # Kopf's dispatch belongs to the operator's loop
                peer = request.transport.get_extra_info("peercert") if request.transport else None
                response = await at_home(lambda: fn(data, webhook=hook, sslpeer=peer, headers=dict(request.headers)))
        except Exception as e:
            logger.exception("admission request failed")
            response = denial(data, f"vllmfit webhook error: {type(e).__name__}: {e}")
        return aiohttp.web.json_response(_finish(response))


def _closing(response: aiohttp.web.Response) -> aiohttp.web.Response:
    """The response, with the connection closed after it (the rest of the body is never read)."""
    response.force_close()
    return response


# --- Wiring -------------------------------------------------------------------------------------
