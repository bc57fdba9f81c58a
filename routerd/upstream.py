"""The call to the engine: timeouts, failover before the first byte, circuit breaker, SSE passthrough.

One request's life here:

1. the router picks an instance; its ``inflight`` goes up *before* anything is awaited (so the next
   pick already sees it) and down in ``finally`` on every path — success, failure, cancellation;
2. the request is sent with connect and read timeouts, and the response's first byte must arrive
   within ``first_byte_timeout_s``. For a stream "first byte" means the first SSE chunk, so an engine
   that answers 200 and then dies (or sends an error event first) is still retried;
3. until the first byte goes to the :class:`ResponseSink` every failure — connect error, timeout,
   5xx/503, an empty body, a leading ``data: {"error"`` event — is retried on another instance
   (at most ``max_attempts``, jittered exponential backoff); 4xx answers are the client's problem and
   are passed through (in OpenAI's error shape: an engine answer in another shape, such as FastAPI's
   ``{"detail": …}``, is rewrapped);
4. after the first byte nothing is retried: the chunks go to the sink as raw bytes, and if the engine
   fails (connection dropped, read timeout, closed without ``[DONE]``) the sink gets routerd's terminal
   ``data: {"error": …}`` + ``data: [DONE]``. An error event the engine sent itself passes through as
   is (it already ends with ``[DONE]``); either way the result says ``ok=False``.

What the circuit breaker is charged with: a failure only the instance can be blamed for — no
connection, a timeout, a stream that broke or came back empty — counts at once. An *answer* that says
the request failed (a 5xx, an error event before any token) may be the request's own doing: a body
that crashes every engine the same way would otherwise be retried on each instance and open every
circuit after ``circuit_failure_threshold`` such requests, and one client would take the fleet out.
So an answered failure counts against its instance only once another instance has served the very
same request (2xx): then the instance, not the request, was at fault. A request that no instance
served charges nobody, nor does an error event the engine sends after the first byte (nothing can be
retried then to tell); an engine that is down in earnest is still caught by the failures above and
by the health monitor.

An instance whose heartbeats fail (``Instance.lose``) ends what runs on it at once: a hung engine never
closes its sockets, so nothing else would before ``read_timeout_s`` (see :class:`_LostWatch`).

The HTTP itself is :mod:`routerd._engine_http`: keep-alive connections per engine, one write per
request. Cancelling ``forward`` (the client went away) closes the upstream connection, which is what
makes vLLM abort the request. Exceptions raised by the sink (the client's socket is gone) propagate the same
way and do not count against the engine.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import msgspec

from . import log
from ._engine_http import ConnectError, EnginePool, Response
from .config import RoutingConfig
from .errors import NoReadyInstance, UpstreamError, error_json, error_type, quote, sse_error_event
from .registry import Instance
from .routing import Router
from .telemetry import Telemetry

_log = log.get("routerd.upstream")

_ERROR_MARK = b'data: {"error"'
_DONE = b"data: [DONE]"
_MAX_ID_CHARS = 256
_SAFE_ID = re.compile(rf"[\x21-\x7e]{{1,{_MAX_ID_CHARS}}}")
_TAIL = 32  # bytes of the previous chunk kept to find marks split across chunk boundaries
# What the engine may fail with before or during a response (routerd._engine_http raises only these).
_NET_ERRORS = (TimeoutError, OSError)


class ResponseSink(Protocol):
    """Where an engine response goes: the client's HTTP response, or a queue job's result."""

    async def start(self, status: int, headers: Mapping[str, str]) -> None: ...  # once, before any byte

    async def write(self, chunk: bytes) -> None: ...  # raw bytes, in order


@dataclass
class ForwardResult:
    """How a forwarded request ended once bytes reached the sink."""

    instance: str
    attempts: int
    status: int
    ok: bool  # 2xx and, for streams, ended with [DONE] and no error event
    error: str | None
    ttfb_s: float = 0.0  # from forward() being called to the first byte going to the sink


class _Retry(Exception):
    """An attempt failed before any byte reached the sink: try another instance.

    ``answered``: the engine answered that the request failed (a 5xx, an error event) — possibly the
    request's fault, so the breaker is charged only if another instance then serves it."""

    def __init__(self, reason: str, message: str, status: int | None = None, *,
                 answered: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.status = status
        self.answered = answered


class InstanceLost(ConnectionError):
    """The instance was declared failed (``Instance.lose``) while a response from it was being read."""


class _Deadline:
    """``asyncio.timeout(delay)`` for a task and loop already known: the same cancel-then-uncancel
    semantics (a cancellation from outside arriving as well is not swallowed), without the two
    ``get_running_loop()`` lookups per use — each a ``getpid()`` syscall on Python 3.11."""

    __slots__ = ("_cancelling", "_expired", "_handle", "_task")

    def __init__(self, task: asyncio.Task[object], loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        self._handle = loop.call_later(delay, self._expire)

    def _expire(self) -> None:
        self._expired = True
        self._task.cancel()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        self._handle.cancel()
        if self._expired and self._task.uncancel() <= self._cancelling \
                and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc


class _LostWatch:
    """Ends one engine call when its instance is declared lost: a hung engine never closes its socket.

    Before the response came back (nothing sent to the sink) the call is cancelled and retried
    elsewhere — cancelled the way ``asyncio.timeout`` does it, so a cancellation from outside (the
    client went away) arriving as well is not swallowed. Once a response is being read, its body
    stream fails with :class:`InstanceLost`, which ends a stream with the terminal error event.
    """

    def __init__(self, inst: Instance, task: asyncio.Task[object]) -> None:
        self._task = task
        self._cancelling = task.cancelling()
        self.reason = ""
        self.resp: Response | None = None
        self._cancelled = False  # our cancel() is not undone yet
        self._unwatch = inst.watch_lost(self._fire)

    def _fire(self, reason: str) -> None:
        self.reason = reason
        if self.resp is None:
            self._cancelled = True
            self._task.cancel()
        else:
            self.resp.set_exception(InstanceLost(reason))

    def absorbed(self) -> bool:
        """After a CancelledError: True if the cancellation was this watch's alone (it is undone)."""
        if not self._cancelled:
            return False
        self._cancelled = False
        return self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        self._unwatch()
        if self._cancelled:  # delivered, but turned into another error on the way: undo it anyway
            self._cancelled = False
            self._task.uncancel()


def _error_doc(body: bytes) -> object:
    try:
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None


def _error_message(body: bytes, status: int) -> str:
    """The engine's error message — vLLM's nested shape (≥0.10.1), its flat one (before), FastAPI's
    ``{"detail": …}`` — quoted: engines echo client input in their messages (a model name, a value)."""
    doc = _error_doc(body)
    if doc is None:
        return quote(body[:1000].decode(errors="replace")) or f"HTTP {status}"
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return quote(err["message"])
        if isinstance(err, str):
            return quote(err)
        if isinstance(doc.get("detail"), str):
            return quote(doc["detail"])
    return f"HTTP {status}"


def _openai_error_body(body: bytes, status: int) -> bytes:
    """``body`` when it is already OpenAI's ``{"error": {…}}``, else that shape with its message."""
    doc = _error_doc(body)
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        return body
    return error_json(_error_message(body, status), error_type(status), status)


def make_session(cfg: RoutingConfig) -> aiohttp.ClientSession:
    """The pooled client session of a process: scrapes and health checks (the engine call itself has
    the leaner connections of :class:`~routerd._engine_http.EnginePool`).

    Idle connections are dropped after 4 s, below uvicorn's (vLLM's) 5 s keep-alive, so routerd never
    writes a request onto a connection the engine is closing. No pool limit: admission bounds
    concurrency, and a pool wait would be an unbounded, untimed queue.
    """
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4.0,
                                     enable_cleanup_closed=False)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s,
                                                               sock_read=cfg.read_timeout_s),
                                 skip_auto_headers=("User-Agent",))


class Upstream:
    """Forwards requests to a fleet's instances; shared by the HTTP ingress and the queue consumer."""

    def __init__(self, router: Router, cfg: RoutingConfig,
                 telemetry: Telemetry | None = None, *, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # Idle connections are dropped after 4 s, below uvicorn's (vLLM's) 5 s keep-alive.
        self.pool = EnginePool(connect_timeout_s=cfg.connect_timeout_s, read_timeout_s=cfg.read_timeout_s,
                               keepalive_s=4.0)
        self.router = router
        self.cfg = cfg
        self.telemetry = telemetry or Telemetry()
        self.rng = rng or random.Random()
        self.clock = clock
        self.active = 0  # forward() calls in progress (drain waits on this)
        self._loop: asyncio.AbstractEventLoop | None = None

    def update_config(self, cfg: RoutingConfig) -> None:
        self.cfg = cfg
        self.pool.configure(connect_timeout_s=cfg.connect_timeout_s, read_timeout_s=cfg.read_timeout_s)

    async def run(self) -> None:
        """Keep the engine connections tidy until cancelled (after the last request), then close them."""
        await self.pool.run()

    def backoff_s(self, attempt: int) -> float:
        """Pause before attempt ``attempt`` (2, 3, …): exponential from ``retry_backoff_ms``, ±50% jitter."""
        base: float = self.cfg.retry_backoff_ms / 1000.0 * (2 ** max(0, attempt - 2))
        return base * self.rng.uniform(0.5, 1.5)

    async def forward(self, fleet: str, endpoint: str, body: bytes, sink: ResponseSink, *,
                      stream: bool, request_id: str) -> ForwardResult:
        """Send ``body`` (an OpenAI request, bytes as received) to ``endpoint`` of an instance of ``fleet``.

        Returns once the response has gone to ``sink`` (see :class:`ForwardResult`). Raises
        :class:`NoReadyInstance` or :class:`UpstreamError` when no byte could be sent.
        """
        started = self.clock()
        task = asyncio.current_task()
        assert task is not None
        if self._loop is None:
            self._loop = task.get_loop()
        tried: list[str] = []
        last: _Retry | None = None
        unexplained: list[Instance] = []  # answered failures, charged if another instance serves it
        tel = self.telemetry
        self.active += 1
        try:
            for attempt in range(1, self.cfg.max_attempts + 1):
                if attempt > 1:
                    tel.retries.labels(fleet).inc()
                    await asyncio.sleep(self.backoff_s(attempt))
                try:
                    inst = self.router.pick(fleet, tried)
                except NoReadyInstance:
                    if last is None:
                        tel.count_request(fleet, "", NoReadyInstance.status)
                        raise
                    break
                tried.append(inst.id)
                try:
                    result = await self._attempt(inst, endpoint, body, sink, stream, request_id, started,
                                                 unexplained, task)
                except _Retry as e:
                    last = e
                    if e.answered:
                        unexplained.append(inst)
                    tel.upstream_failures.labels(fleet, inst.id, e.reason).inc()
                    _log.debug("upstream_attempt_failed", request_id=request_id, instance=inst.id,
                               attempt=attempt, reason=e.reason, error=e.message)
                    continue
                result.attempts = attempt
                tel.count_request(fleet, inst.id, result.status)
                tel.observe_ttfb(fleet, result.ttfb_s)
                return result
            assert last is not None
            err = UpstreamError(f"{len(tried)} attempt(s) failed; last on {tried[-1]}: {last.message}",
                                upstream_status=last.status, instance=tried[-1])
            err.data["attempts"] = len(tried)
            if last.status == 503:  # every engine said "queue full" (--max-num-queued-reqs): keep the 503
                err.status, err.type = 503, "ServiceUnavailableError"
            elif last.reason == "timeout":  # no engine answered in first_byte_timeout_s
                err.status, err.type = 504, "GatewayTimeoutError"
            tel.count_request(fleet, tried[-1], err.status)
            raise err
        finally:
            self.active -= 1

    async def _attempt(self, inst: Instance, endpoint: str, body: bytes, sink: ResponseSink,
                       stream: bool, request_id: str, started: float,
                       unexplained: list[Instance], task: asyncio.Task[object]) -> ForwardResult:
        breaker = self.router.breaker
        inst.inflight += 1
        breaker.begin(inst)
        resp: Response | None = None
        clean = False
        lost = _LostWatch(inst, task)
        try:
            try:
                resp, first = await self._first_byte(inst, endpoint, body, stream, request_id, task)
            except asyncio.CancelledError:
                if not lost.absorbed():
                    raise
                raise _Retry("instance_lost", lost.reason) from None
            lost.resp = resp
            headers = {"Content-Type": resp.headers.get("content-type", "application/json"),
                       "X-Routerd-Instance": inst.id}
            if 200 <= resp.status < 300:
                for failed in unexplained:  # this request can be served: their failures were theirs
                    self._failed(failed)
                unexplained.clear()
            elif resp.status >= 400:
                first = _openai_error_body(first, resp.status)
                headers["Content-Type"] = "application/json"
            if not stream or not 200 <= resp.status < 300:
                headers["Content-Length"] = str(len(first))
            await sink.start(resp.status, headers)
            ttfb = self.clock() - started
            await sink.write(first)
            if stream and 200 <= resp.status < 300:
                sse = headers["Content-Type"].startswith("text/event-stream")
                ok, error = await self._pump(inst, resp, sink, first, sse)
            else:
                ok = 200 <= resp.status < 300
                error = None if ok else _error_message(first, resp.status)
            clean = True
            return ForwardResult(instance=inst.id, attempts=1, status=resp.status, ok=ok, error=error,
                                 ttfb_s=ttfb)
        finally:
            lost.close()
            inst.inflight -= 1
            breaker.end(inst)
            if resp is not None:
                if clean:
                    resp.release()
                else:
                    resp.close()  # drop the connection: the engine sees the disconnect and aborts

    async def _first_byte(self, inst: Instance, endpoint: str, body: bytes, stream: bool,
                          request_id: str, task: asyncio.Task[object]) -> tuple[Response, bytes]:
        """Send the request and read up to the first byte the client may see; raise _Retry on failure."""
        breaker = self.router.breaker
        resp: Response | None = None
        assert self._loop is not None
        try:
            with _Deadline(task, self._loop, self.cfg.first_byte_timeout_s):
                resp = await self.pool.post(
                    inst.url + endpoint, body,
                    {"Content-Type": "application/json", "X-Request-Id": _header_safe(request_id),
                     "Accept": "*/*", "Accept-Encoding": "identity"})
                first = await _first_chunk(resp, stream)
            if first is None:
                # Non-streaming (or an error answer): the whole body is the first byte. Its read is
                # bounded by the socket read timeout, not the first-byte one (headers came; the body
                # is flowing).
                first = await resp.read()
            breaker.success(inst)
            return resp, first
        except BaseException as e:
            if resp is not None:
                resp.close()
            if isinstance(e, _Retry):
                retry = e
            elif isinstance(e, TimeoutError):
                retry = _Retry("timeout", f"no first byte from {inst.id} in time")
            elif isinstance(e, _NET_ERRORS):
                reason = "connect" if isinstance(e, ConnectError) else "disconnect"
                retry = _Retry(reason, f"{type(e).__name__}: {e}")
            else:
                raise
            if not retry.answered:
                self._failed(inst)
            if retry is e:
                raise
            raise retry from e

    async def _pump(self, inst: Instance, resp: Response, sink: ResponseSink,
                    first: bytes, sse: bool) -> tuple[bool, str | None]:
        """Copy the rest of a stream to the sink as raw bytes; make sure an SSE stream ends in a
        terminal event (``[DONE]``, or an error event and ``[DONE]``)."""
        tail = first[-_TAIL:]
        saw_error = _ERROR_MARK in first
        read = resp.readany
        failure: str | None = None
        while True:
            try:
                chunk = await read()
            except _NET_ERRORS as e:
                failure = f"the engine failed mid-stream ({type(e).__name__}: {e})"
                break
            if not chunk:
                break
            await sink.write(chunk)
            if not saw_error and (_ERROR_MARK in chunk or _ERROR_MARK in tail + chunk[:_TAIL]):
                saw_error = True
            tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else (tail + chunk)[-_TAIL:]
        if failure is None and saw_error:
            # Counted, not charged to the breaker: an engine that says a stream failed is alive, and
            # the failure may be the request's (nothing can be retried after the first byte to tell).
            # An engine that died sends this too, but then /health fails and the health monitor acts.
            self.telemetry.upstream_failures.labels(inst.fleet, inst.id, "error_event").inc()
            if _DONE not in tail:
                await sink.write(b"data: [DONE]\n\n")
            return False, "the engine sent an error event mid-stream"
        if failure is None and sse and _DONE not in tail:
            failure = "the engine closed the stream before [DONE]"
        if failure is not None:
            self._failed(inst, "stream_broken")
            if sse:
                await sink.write(sse_error_event(failure, "UpstreamError", 502))
            return False, failure
        return True, None

    def _failed(self, inst: Instance, reason: str | None = None) -> None:
        if reason is not None:
            self.telemetry.upstream_failures.labels(inst.fleet, inst.id, reason).inc()
        if self.router.breaker.failure(inst):
            self.telemetry.circuit_opened.labels(inst.fleet, inst.id).inc()
            _log.warning("circuit_opened", instance=inst.id, failures=inst.consecutive_failures,
                         cooldown_s=self.cfg.circuit_cooldown_s)


async def _first_chunk(resp: Response, stream: bool) -> bytes | None:
    """A stream's first chunk (``None`` for a non-stream or a 4xx: the caller reads the whole body);
    raises :class:`_Retry` for a 5xx answer, an empty stream or an error event before any token."""
    if resp.status >= 500:
        msg = _error_message(await resp.read(), resp.status)
        raise _Retry(f"status_{resp.status}", f"HTTP {resp.status}: {msg}", resp.status, answered=True)
    if not stream or not 200 <= resp.status < 300:
        return None
    first = await resp.readany()
    if not first:
        raise _Retry("empty", "the engine closed the stream before sending anything")
    if first.startswith(_ERROR_MARK):
        raise _Retry("error_event", "error event before any token: " + _event_message(first),
                     answered=True)
    return first


def _header_safe(request_id: str) -> str:
    """The request id as an ``X-Request-Id`` value: a queue job's id may hold characters no header may
    (a newline would end the header: the client refuses to send it), so those are percent-encoded."""
    if _SAFE_ID.fullmatch(request_id):
        return request_id
    return urllib.parse.quote(request_id, safe="")[:_MAX_ID_CHARS] or "-"


def _event_message(chunk: bytes) -> str:
    line = chunk.split(b"\n", 1)[0][len(b"data: "):]
    return _error_message(line, 500)
