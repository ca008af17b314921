"""A fault-injecting HTTP proxy for S3 tests: real sockets between the loader and moto.

    with FaultProxy(s3_server.endpoint_url) as proxy:
        proxy.inject("slowdown", every=3)                  # every 3rd object GET gets a 503
        proxy.inject("stall", first=1, limit=2)            # first GET of a key hangs (2 keys)
        Loader(..., storage_options={"endpoint_url": proxy.url})
        proxy.injected                                     # Counter: kind -> how many

The proxy listens on 127.0.0.1 (an ephemeral port) and runs its own asyncio loop in a
background thread. It speaks plain HTTP/1.1 with keep-alive towards the client, as S3 does, and
forwards each request on a fresh connection to the upstream server (only 127.0.0.1 is allowed).

Fault kinds (`KINDS`):
* ``slowdown``        503 with S3's XML error body, code SlowDown
* ``internal_error``  500 with S3's XML error body, code InternalError
* ``reset``           the connection is reset (RST) before any byte of the response. aiohttp
                      itself resends an idempotent request (GET) once, at once, when that happens
                      (RFC 9112 section 9.3.1), so a client's own retry counter may not see it
* ``reset_mid_body``  status line, headers and half the body, then a reset
* ``truncate``        headers with the full Content-Length, half the body, then a clean close
* ``slow_first_byte`` the response is held back `slow_s` seconds, then sent whole
* ``stall``           nothing is sent for `stall_s` seconds (or until the client gives up)

A rule decides which requests get a fault. By default it considers GET requests for an object
(ranged reads): not listings, not HEAD. `every=N` fires on every Nth request it considers,
`first=K` on the first K requests to each key (`per="range"`: to each key and byte range),
`when=predicate(request)` on whatever the predicate says; `limit` caps how many faults the rule
injects. The first rule that fires wins. Rules can be added and cleared while the proxy runs.
"""
from __future__ import annotations

import asyncio
import itertools
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

KINDS = ("slowdown", "internal_error", "reset", "reset_mid_body", "truncate", "slow_first_byte",
         "stall")
# Kinds after which the client must retry (a slow first byte within the timeout must not be).
FAILING_KINDS = frozenset(KINDS) - {"slow_first_byte"}

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding",
                         "te", "trailer", "upgrade", "content-length", "expect"})
_ERRORS = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "internal_error": (500, "Internal Server Error", "InternalError",
                       "We encountered an internal error. Please try again."),
}


@dataclass(frozen=True)
class Request:
    """One request as the proxy saw it."""
    number: int                  # 1-based, over every request the proxy received
    method: str
    target: str                  # path and query, as sent
    headers: tuple[tuple[str, str], ...]
    body: bytes

    @property
    def path(self) -> str:
        return unquote(self.target.split("?", 1)[0])

    @property
    def query(self) -> str:
        return self.target.split("?", 1)[1] if "?" in self.target else ""

    @property
    def bucket(self) -> str:
        return self.path.lstrip("/").split("/", 1)[0]

    @property
    def key(self) -> str:
        parts = self.path.lstrip("/").split("/", 1)
        return parts[1] if len(parts) == 2 else ""

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    @property
    def is_object_get(self) -> bool:
        """A GET for an object's bytes (path-style: /bucket/key), not a listing."""
        return self.method == "GET" and bool(self.key)


@dataclass
class Rule:
    kinds: tuple[str, ...]               # cycled through, one per injection
    every: int | None = None
    first: int | None = None
    per: str = "key"                     # what `first` counts per: "key" or "range"
    when: Callable[[Request], bool] | None = None
    match: Callable[[Request], bool] = lambda r: r.is_object_get
    limit: int | None = None
    considered: int = 0
    seen: Counter = field(default_factory=Counter)
    fired: int = 0

    def decide(self, request: Request) -> str | None:
        if not self.match(request) or (self.limit is not None and self.fired >= self.limit):
            return None
        self.considered += 1
        target = (request.bucket, request.key) + \
            ((request.header("Range"),) if self.per == "range" else ())
        self.seen[target] += 1
        if self.every is not None and self.considered % self.every != 0:
            return None
        if self.first is not None and self.seen[target] > self.first:
            return None
        if self.when is not None and not self.when(request):
            return None
        kind = self.kinds[self.fired % len(self.kinds)]
        self.fired += 1
        return kind


@dataclass
class Response:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes


class FaultProxy:
    def __init__(self, upstream_url: str, *, slow_s: float = 0.3, stall_s: float = 30.0):
        parts = urlsplit(upstream_url)
        if parts.hostname != "127.0.0.1":
            raise ValueError(f"the fault proxy only forwards to 127.0.0.1, not {upstream_url!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.slow_s, self.stall_s = slow_s, stall_s
        self.injected: Counter = Counter()          # kind -> faults injected
        self.log: list[tuple[str, str, str | None]] = []   # (kind, key, Range header)
        self.requests = 0                           # every request received
        self.object_gets = 0                        # of which GETs of an object
        self.history: list[Request] = []            # every request, in order of arrival
        self.faulted: dict[int, str] = {}           # request number -> the fault it got
        self.port: int | None = None
        self._rules: list[Rule] = []
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._handlers: set[asyncio.Task] = set()

    # -- the test's side ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inject(self, kinds: str | Sequence[str], *, every: int | None = None,
               first: int | None = None, per: str = "key",
               when: Callable[[Request], bool] | None = None, limit: int | None = None,
               match: Callable[[Request], bool] | None = None) -> Rule:
        """Add a rule. `kinds` is one kind or several, cycled through one per injection."""
        kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
        unknown = sorted(set(kinds) - set(KINDS))
        if not kinds or unknown:
            raise ValueError(f"unknown fault kind(s) {unknown}; known: {', '.join(KINDS)}")
        if per not in ("key", "range"):
            raise ValueError(f"per must be 'key' or 'range', got {per!r}")
        rule = Rule(kinds, every=every, first=first, per=per, when=when, limit=limit)
        if match is not None:
            rule.match = match
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule (the counts stay)."""
        with self._lock:
            self._rules.clear()

    @property
    def total_injected(self) -> int:
        with self._lock:
            return sum(self.injected.values())

    def failing_injected(self) -> int:
        """Injected faults that make the attempt fail (everything but a slow first byte)."""
        with self._lock:
            return sum(n for kind, n in self.injected.items() if kind in FAILING_KINDS)

    def unfaulted_resent(self) -> int:
        """Object GETs answered without a fault that the client sent again later (the same key
        and byte range): it had given up on them at its request timeout, as a client on a
        loaded machine may. Tests that count retries exactly add these."""
        with self._lock:
            gets = [r for r in self.history if r.is_object_get]
        later: Counter = Counter((r.key, r.header("Range")) for r in gets)
        resent = 0
        for r in gets:
            later[(r.key, r.header("Range"))] -= 1
            resent += r.number not in self.faulted and later[(r.key, r.header("Range"))] > 0
        return resent

    def start(self) -> FaultProxy:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy",
                                        daemon=True)
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
            self._loop = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- the proxy's loop --------------------------------------------------------------------
    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)

    def _decide(self, request: Request) -> str | None:
        with self._lock:
            self.requests += 1
            self.object_gets += request.is_object_get
            self.history.append(request)
            for rule in self._rules:
                kind = rule.decide(request)
                if kind is not None:
                    self.injected[kind] += 1
                    self.faulted[request.number] = kind
                    self.log.append((kind, request.key, request.header("Range")))
                    return kind
        return None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)
        keep_alive = True
        try:
            while keep_alive:
                request = await _read_request(reader, writer, next(self._numbers))
                if request is None:
                    break
                keep_alive = await self._serve(request, self._decide(request), reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError, OSError):
            keep_alive = False
        finally:
            self._handlers.discard(task)
            if not writer.transport.is_closing():
                writer.transport.abort() if not keep_alive else writer.close()

    async def _serve(self, request: Request, kind: str | None, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> bool:
        """Answer one request, with `kind`'s fault if any. True: keep the connection."""
        if kind in _ERRORS:
            status, reason, code, message = _ERRORS[kind]
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                    f"<Message>{message}</Message><Resource>{request.path}</Resource>"
                    f"<RequestId>fault-{request.number}</RequestId></Error>").encode()
            headers = [("Content-Type", "application/xml"),
                       ("x-amz-request-id", f"fault-{request.number}")]
            await _send(writer, Response(status, reason, headers, body), request.method)
            return True
        if kind == "reset":
            _reset(writer)
            return False
        if kind == "stall":
            try:  # hold the request until the client gives up (closes) or stall_s passes
                await asyncio.wait_for(reader.read(), self.stall_s)
            except asyncio.TimeoutError:
                pass
            _reset(writer)
            return False
        if kind == "slow_first_byte":
            await asyncio.sleep(self.slow_s)
        response = await self._forward(request)
        if kind in ("reset_mid_body", "truncate") and len(response.body) >= 2:
            head = _head(response, len(response.body))
            writer.write(head + response.body[: len(response.body) // 2])
            await writer.drain()
            if kind == "reset_mid_body":
                _reset(writer)
            else:
                writer.close()
            return False
        await _send(writer, response, request.method)
        return True

    async def _forward(self, request: Request) -> Response:
        reader, writer = await asyncio.open_connection(*self.upstream)
        try:
            lines = [f"{request.method} {request.target} HTTP/1.1"]
            lines += [f"{k}: {v}" for k, v in request.headers if k.lower() not in _HOP_BY_HOP]
            if request.body or request.method in ("PUT", "POST"):
                lines.append(f"Content-Length: {len(request.body)}")
            lines.append("Connection: close")
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + request.body)
            await writer.drain()
            return await _read_response(reader, request.method)
        finally:
            writer.close()


# -- HTTP/1.1 framing ----------------------------------------------------------------------------

async def _read_headers(reader: asyncio.StreamReader) -> list[tuple[str, str]]:
    headers = []
    while True:
        line = await reader.readline()
        if not line:
            raise asyncio.IncompleteReadError(b"", None)
        if line in (b"\r\n", b"\n"):
            return headers
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))


def _get(headers, name: str) -> str | None:
    return next((v for k, v in headers if k.lower() == name), None)


async def _read_body(reader: asyncio.StreamReader, headers, *, to_eof: bool) -> bytes:
    if "chunked" in (_get(headers, "transfer-encoding") or "").lower():
        parts = []
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await _read_headers(reader)   # trailers, up to the blank line
                return b"".join(parts)
            parts.append(await reader.readexactly(size))
            await reader.readline()
    length = _get(headers, "content-length")
    if length is not None:
        return await reader.readexactly(int(length))
    return await reader.read() if to_eof else b""


async def _read_request(reader, writer, number: int) -> Request | None:
    line = await reader.readline()
    while line in (b"\r\n", b"\n"):
        line = await reader.readline()
    if not line:
        return None
    method, target, _version = line.decode("latin-1").split(" ", 2)
    headers = await _read_headers(reader)
    if (_get(headers, "expect") or "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    body = await _read_body(reader, headers, to_eof=False)
    return Request(number, method, target, tuple(headers), body)


async def _read_response(reader: asyncio.StreamReader, method: str) -> Response:
    line = await reader.readline()
    _version, status, *reason = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    headers = await _read_headers(reader)
    status = int(status)
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        body = b""
    else:
        body = await _read_body(reader, headers, to_eof=True)
    return Response(status, reason[0] if reason else "", headers, body)


def _head(response: Response, content_length: int) -> bytes:
    lines = [f"HTTP/1.1 {response.status} {response.reason}"]
    lines += [f"{k}: {v}" for k, v in response.headers if k.lower() not in _HOP_BY_HOP]
    lines += [f"Content-Length: {content_length}", "Connection: keep-alive"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _send(writer: asyncio.StreamWriter, response: Response, method: str) -> None:
    if method == "HEAD":   # a HEAD answer keeps the object's length and carries no body
        length = int(_get(response.headers, "content-length") or 0)
        writer.write(_head(response, length))
    else:
        writer.write(_head(response, len(response.body)) + response.body)
    await writer.drain()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (RST), not a clean FIN: SO_LINGER with a zero timeout."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()
