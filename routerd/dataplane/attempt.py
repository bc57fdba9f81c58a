"""One attempt on one instance: the request sent, its first byte awaited, the answer relayed to the
sink, and what the failure of an attempt costs its instance.

1. the instance's ``inflight`` goes up *before* anything is awaited (so the next pick already sees
   it) and down in ``finally`` on every path — success, failure, cancellation;
2. the request is sent with connect and read timeouts, and the response's first byte must arrive
   within ``first_byte_timeout_s``. For a stream "first byte" means the first SSE chunk, so an engine
   that answers 200 and then dies (or sends an error event first) is still retried: every failure
   before the first byte goes to the sink raises :class:`Retry` (the caller tries another instance);
   4xx answers are the client's problem and are passed through (in OpenAI's error shape);
3. after the first byte a stream whose engine fails raises :class:`StreamFailed` when it may be
   continued elsewhere (the caller resumes it), else it ends with routerd's terminal error event.

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
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.parse
from collections.abc import Callable

from .. import log
from ..config import RoutingConfig
from ..registry import Instance
from ..routing import Router
from ..surface import ROUTES, EventReader, Route, engine_error_body, route_for, stream_error
from ..telemetry import Telemetry
from ..tracing import Tracing
from . import relay, resume
from .engine_errors import error_message, event_message
from .engine_http import ConnectError, EnginePool, Response
from .relay import ERROR_MARK, EVENT_ERROR_MARK, NET_ERRORS, InstanceLost
from .resume import ResumableStream
from .sinks import ForwardResult, ResponseSink
from .usage import usage_of

__all__ = ["Attempts", "Retry", "StreamFailed"]

_log = log.get("routerd.upstream")

_OPENAI = ROUTES["/v1/completions"]  # an endpoint the table does not have: OpenAI's error shape
_MAX_ID_CHARS = 256
_SAFE_ID = re.compile(rf"[\x21-\x7e]{{1,{_MAX_ID_CHARS}}}")


class Retry(Exception):
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


class StreamFailed(Exception):
    """A stream failed after bytes reached the sink and may be continued elsewhere (``reason`` is the
    ``routerd_resumes_total`` label)."""

    def __init__(self, reason: str, message: str, instance: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.instance = instance
        self.ttfb_s = 0.0


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
    stream fails with :class:`InstanceLost`: the stream is resumed elsewhere, or ended with the terminal
    error event when it cannot be.
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


class Attempts:
    """Attempts on single instances, for one :class:`~routerd.dataplane.upstream.Upstream`."""

    def __init__(self, pool: EnginePool, router: Router, cfg: RoutingConfig, telemetry: Telemetry,
                 tracing: Tracing, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.router = router
        self.cfg = cfg
        self.telemetry = telemetry
        self.tracing = tracing
        self.clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        # fleet → the API key its engines require (Upstream.update_fleets); a fleet without one gets none
        self.bearers: dict[str, str] = {}

    def cut(self, fleet: str, why: str, message: str) -> str:
        """A failed stream that is not continued elsewhere (``why``: its ``resume.NOT_CONTINUABLE`` key,
        or "disabled"): counted as cut, and its message says why — one rule for a stream relayed byte
        for byte and one read only for its usage."""
        self.telemetry.streams_cut.labels(fleet, "disabled" if why == "disabled" else "not_continuable").inc()
        if why in resume.NOT_CONTINUABLE:
            message += f"; not continued elsewhere: {resume.NOT_CONTINUABLE[why]}"
        return message

    async def attempt(self, inst: Instance, endpoint: str, body: bytes, sink: ResponseSink,
                       stream: bool, request_id: str, started: float,
                       unexplained: list[Instance], task: asyncio.Task[object],
                       plan: ResumableStream | EventReader | str | None = None, *, route: Route | None = None,
                       content_type: str = "application/json") -> ForwardResult:
        breaker = self.router.breaker
        inst.inflight += 1
        breaker.begin(inst)
        resp: Response | None = None
        clean = False
        lost = _LostWatch(inst, task)
        try:
            try:
                resp, first = await self._first_byte(inst, endpoint, body, stream, request_id, task,
                                                     content_type)
            except asyncio.CancelledError:
                if not lost.absorbed():
                    raise
                raise Retry("instance_lost", lost.reason) from None
            lost.resp = resp
            if isinstance(plan, ResumableStream) and plan.started:  # a continuation of a client's stream
                ok, error = await self._continued(inst, resp, sink, first, plan)
                clean = True
                return ForwardResult(instance=inst.id, attempts=1, status=200, ok=ok, error=error)
            headers = {"Content-Type": resp.headers.get("content-type", "application/json"),
                       "X-Routerd-Instance": inst.id}
            if 200 <= resp.status < 300:
                for failed in unexplained:  # this request can be served: their failures were theirs
                    self.failed(failed)
                unexplained.clear()
            elif resp.status >= 400:  # in the route's error shape (vLLM's own on /v1/messages is Anthropic's)
                first = _error_answer(route or route_for(endpoint) or _OPENAI, first, resp.status)
                headers["Content-Type"] = "application/json"
            if not stream or not 200 <= resp.status < 300:
                headers["Content-Length"] = str(len(first))
            await sink.start(resp.status, headers)
            ttfb = self.clock() - started
            sse = headers["Content-Type"].startswith("text/event-stream")
            if isinstance(plan, ResumableStream) and 200 <= resp.status < 300 and sse:
                plan.started = True
                try:
                    ok, error = await self._continued(inst, resp, sink, first, plan)
                except StreamFailed as e:
                    e.ttfb_s = ttfb
                    raise
            elif stream and 200 <= resp.status < 300:
                await sink.write(first)
                ending = await _relayed(resp, sink, first, sse, plan)
                ok, error = await self._passed(inst, sink, ending, sse, _why_not(plan), route)
            else:
                await sink.write(first)
                ok = 200 <= resp.status < 300
                error = None if ok else error_message(first, resp.status)
            clean = True
            # the count: a stream's reader's, or what a non-streamed answer's body (held here) says
            usage = plan.usage() if isinstance(plan, ResumableStream | EventReader) else \
                usage_of(first) if ok and not stream else None
            return ForwardResult(instance=inst.id, attempts=1, status=resp.status, ok=ok, error=error,
                                 ttfb_s=ttfb, usage=usage)
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
                          request_id: str, task: asyncio.Task[object],
                          content_type: str = "application/json") -> tuple[Response, bytes]:
        """Send the request and read up to the first byte the client may see; raise Retry on failure."""
        breaker = self.router.breaker
        resp: Response | None = None
        if self._loop is None:
            self._loop = task.get_loop()
        try:
            headers = {"Content-Type": content_type, "X-Request-Id": _header_safe(request_id),
                       "Accept": "*/*", "Accept-Encoding": "identity"}
            if self.tracing.on:  # the attempt's span: the engine's own span joins the trace
                self.tracing.inject(headers)
            with _Deadline(task, self._loop, self.cfg.first_byte_timeout_s):
                resp = await self.pool.post(inst.url + endpoint, body, headers,
                                            self.bearers.get(inst.fleet, ""))
                first = await _first_chunk(resp, stream, endpoint)
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
            if isinstance(e, Retry):
                retry = e
            elif isinstance(e, TimeoutError):
                retry = Retry("timeout", f"no first byte from {inst.id} in time")
            elif isinstance(e, NET_ERRORS):
                reason = "connect" if isinstance(e, ConnectError) else "disconnect"
                retry = Retry(reason, f"{type(e).__name__}: {e}")
            else:
                raise
            if not retry.answered:
                self.failed(inst)
            if retry is e:
                raise
            raise retry from e

    async def _passed(self, inst: Instance, sink: ResponseSink, ending: relay.Ending, sse: bool,
                      why: str, route: Route | None = None) -> tuple[bool, str | None]:
        """What a stream relayed byte for byte (not continued elsewhere: ``why``, the NOT_CONTINUABLE key
        or "disabled") ended with; a failed SSE stream gets routerd's terminal error event."""
        tel = self.telemetry
        if ending.engine_error:
            # Counted, not charged to the breaker: an engine that says a stream failed is alive, and
            # the failure may be the request's (nothing can be retried after the first byte to tell).
            # An engine that died sends this too, but then /health fails and the health monitor acts.
            tel.upstream_failures.labels(inst.fleet, inst.id, "error_event").inc()
            tel.streams_cut.labels(inst.fleet, "engine_error").inc()
            return False, ending.message
        if not ending.failure:
            return True, None
        self.failed(inst, "stream_broken")
        message = self.cut(inst.fleet, why, ending.message)
        if sse:
            await sink.write(stream_error(route, message))
        return False, message

    async def _continued(self, inst: Instance, resp: Response, sink: ResponseSink, first: bytes,
                         rs: ResumableStream) -> tuple[bool, str | None]:
        """Relay a continuable stream (a first attempt's or a continuation's) event by event; raise
        :class:`StreamFailed` when its engine fails. An engine that refuses a continuation (4xx: it does not
        know ``continue_final_message``, say) ends the stream: another would refuse it too."""
        tel = self.telemetry
        if not 200 <= resp.status < 300:
            message = f"{inst.id} refused to continue the stream: {error_message(first, resp.status)}"
            tel.streams_cut.labels(inst.fleet, "refused").inc()
            await sink.write(rs.cut(message))
            return False, message
        def gap(seconds: float) -> None:  # once per resume: not worth a cached label child
            tel.resume_gap_seconds.labels(inst.fleet).observe(seconds)
            self.tracing.note(**{"routerd.resume.gap_ms": round(seconds * 1000, 2)})

        ending = await relay.by_event(resp, sink, first, rs, self.clock, gap)
        if ending.failure == "error_event" and rs.fixed:  # not continued: the client gets it, as in _passed
            await sink.write(rs.pass_error())
            ending = relay.Ending(engine_error=True, message=ending.message)
        if ending.engine_error or ending.failure == "error_event":
            tel.upstream_failures.labels(inst.fleet, inst.id, "error_event").inc()  # as in _passed
        if ending.engine_error:
            tel.streams_cut.labels(inst.fleet, "engine_error").inc()
            return False, ending.message
        if ending.failure:
            if ending.failure != "error_event":
                self.failed(inst, "stream_broken")
            raise StreamFailed(ending.failure, ending.message, inst.id)
        return True, None

    def failed(self, inst: Instance, reason: str | None = None) -> None:
        if reason is not None:
            self.telemetry.upstream_failures.labels(inst.fleet, inst.id, reason).inc()
        if self.router.breaker.failure(inst):
            self.telemetry.circuit_opened.labels(inst.fleet, inst.id).inc()
            _log.warning("circuit_opened", instance=inst.id, failures=inst.consecutive_failures,
                         cooldown_s=self.cfg.circuit_cooldown_s)


async def _relayed(resp: Response, sink: ResponseSink, first: bytes, sse: bool,
                   plan: ResumableStream | EventReader | str | None) -> relay.Ending:
    """The rest of a stream that is not continued elsewhere, relayed byte for byte: a named-event
    stream read by its :class:`EventReader`, any other as OpenAI's SSE."""
    if isinstance(plan, EventReader):
        return await relay.events(resp, sink, first, plan)
    return await relay.passthrough(resp, sink, first, sse)


def _why_not(plan: ResumableStream | EventReader | str | None) -> str:
    """Why a stream relayed byte for byte is not continued: its ``NOT_CONTINUABLE`` key or "disabled"."""
    if isinstance(plan, str):
        return plan
    return "route" if isinstance(plan, EventReader) else ""


def _error_answer(route: Route, body: bytes, status: int) -> bytes:
    return engine_error_body(route.errors, body, status, error_message(body, status))


async def _first_chunk(resp: Response, stream: bool, endpoint: str) -> bytes | None:
    """A stream's first chunk (``None`` for a non-stream or a 4xx: the caller reads the whole body);
    raises :class:`Retry` for a 5xx answer, an empty stream or an error event before any token. A
    Responses stream's reaches up to its first event after the two vLLM opens it with
    (:func:`relay.first_output`)."""
    if resp.status >= 500:
        msg = error_message(await resp.read(), resp.status)
        raise Retry(f"status_{resp.status}", f"HTTP {resp.status}: {msg}", resp.status, answered=True)
    if resp.status == 401:
        # Not the client's key (routerd checked that): the engine refused routerd's. Passed through, the
        # client would be told its own key is bad; another instance may hold the right one.
        msg = error_message(await resp.read(), resp.status)
        raise Retry("unauthorized", f"the engine refused routerd's API key (HTTP 401: {msg}): a static "
                    "fleet's engines are sent its [[fleets]] api_key, launched ones the key derived from "
                    "[control] secret", 401, answered=True)
    if not stream or not 200 <= resp.status < 300:
        return None
    first = await resp.readany()
    if not first:
        raise Retry("empty", "the engine closed the stream before sending anything")
    if endpoint == "/v1/responses":
        first, kind = await relay.first_output(resp, first)
        if not kind:
            raise Retry("empty", "the engine closed the stream before its first output event")
        if kind in (b"error", b"response.failed"):
            raise Retry("error_event", f"{kind.decode()} event before any output", answered=True)
    elif first.startswith(ERROR_MARK) or first.startswith(EVENT_ERROR_MARK):
        raise Retry("error_event", "error event before any token: " + event_message(first),
                     answered=True)
    return first


def _header_safe(request_id: str) -> str:
    """The request id as an ``X-Request-Id`` value: a queue job's id may hold characters no header may
    (a newline would end the header: the client refuses to send it), so those are percent-encoded."""
    if _SAFE_ID.fullmatch(request_id):
        return request_id
    return urllib.parse.quote(request_id, safe="")[:_MAX_ID_CHARS] or "-"
