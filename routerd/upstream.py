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
4. after the first byte a stream is not retried but *resumed* (:mod:`routerd.resume`): when its
   engine fails — connection dropped, read timeout, the instance declared lost, closed without
   ``[DONE]``, an error event with a 5xx code — the generation is continued on another instance and
   the client's stream goes on as one stream, at most ``max_resumes`` times (a queue job's deadline
   bounds its whole engine call, resumes included). A stream that cannot be continued
   (``resume.NOT_CONTINUABLE``: ``n > 1``, grammars, ``echo``…) ends as before: the sink gets
   routerd's terminal ``data: {"error": …}`` + ``data: [DONE]``, or the engine's own error event when
   it blamed the request (4xx code). Either way the result says ``ok=False``. A non-streamed request
   shows nothing before it completes, so one whose engine dies mid-generation is simply retried from
   the start (step 3).

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

from . import log, relay, resume
from ._engine_http import ConnectError, EnginePool, Response
from .config import RoutingConfig
from .errors import NoReadyInstance, UpstreamError, error_json, error_type, quote, sse_error_event
from .plugins import RequestView
from .registry import Instance
from .relay import ERROR_MARK, NET_ERRORS, InstanceLost
from .resume import ResumableStream
from .routing import Decision, Router
from .speed import PRIOR_PREFILL_S
from .telemetry import Telemetry
from .tracing import Tracing

_log = log.get("routerd.upstream")

_MAX_ID_CHARS = 256
_SAFE_ID = re.compile(rf"[\x21-\x7e]{{1,{_MAX_ID_CHARS}}}")


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
    decision: Decision | None = None  # why its first instance was chosen (for the request's log line)
    resumes: int = 0  # times the stream was continued on another instance after its engine failed
    # A stream's usage as the engine counted it (prompt, completion tokens; a continued stream's whole
    # generation), whether or not the client asked for it, as far as it was read — a stream that
    # did not end well included: its engine generated them; None for a non-stream (its body holds it)
    # and for a stream whose events carried no count.
    usage: tuple[int, int] | None = None


# UsageTap.meter: given a function returning the engine's count (prompt, completion tokens) or None.
_Meter = Callable[[Callable[[], tuple[int, int] | None]], None]


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


class _Resume(Exception):
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
                 clock: Callable[[], float] = time.monotonic, tracing: Tracing | None = None) -> None:
        # Idle connections are dropped after 4 s, below uvicorn's (vLLM's) 5 s keep-alive.
        self.pool = EnginePool(connect_timeout_s=cfg.connect_timeout_s, read_timeout_s=cfg.read_timeout_s,
                               keepalive_s=4.0)
        self.router = router
        self.cfg = cfg
        self.telemetry = telemetry or Telemetry()
        self.rng = rng or random.Random()
        self.clock = clock
        self.tracing = tracing or Tracing.off()  # spans per attempt and resume; the engine gets the context
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
                      stream: bool, request_id: str,
                      request: RequestView | None = None) -> ForwardResult:
        """Send ``body`` (an OpenAI request, bytes as received) to ``endpoint`` of an instance of ``fleet``.

        ``request`` is what routing knows of it (its prompt's blocks, session, …: built where the body
        was parsed, :meth:`routerd.routing.request.RequestViews.build`); without it the policy sees only
        the fleet.

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
        plan = self._plan(endpoint, body, sink) if stream else None  # how a stream is read and resumed
        if isinstance(plan, ResumableStream):
            body = plan.engine_body
        self.active += 1
        try:
            for attempt in range(1, self.cfg.max_attempts + 1):
                if attempt > 1:
                    tel.retries.labels(fleet).inc()
                    await asyncio.sleep(self.backoff_s(attempt))
                try:
                    decision = self.router.choose(fleet, tried, request)
                except NoReadyInstance:
                    if last is None:
                        tel.count_request(fleet, "", NoReadyInstance.status)
                        raise
                    break
                inst = decision.instance
                tried.append(inst.id)
                sent = self.clock()
                try:
                    with self.tracing.attempt("routerd.attempt", attempt, inst.id, inst.url,
                                              decision.log_fields() if self.tracing.on else None):
                        result = await self._attempt(inst, endpoint, body, sink, stream, request_id,
                                                     started, unexplained, task, plan)
                        self.tracing.outcome(result.ok, result.error, result.status)
                except asyncio.CancelledError:
                    self._abandoned(sink, plan, inst, sent, request)
                    raise
                except _Resume as failure:
                    assert isinstance(plan, ResumableStream)
                    result = await self._resume(fleet, endpoint, sink, request_id, task, plan, failure,
                                                tried, request)
                    result.attempts += attempt
                    result.usage = plan.usage()
                    result.ttfb_s = failure.ttfb_s
                    result.decision = decision
                    tel.count_request(fleet, result.instance, result.status)
                    tel.observe_ttfb(fleet, failure.ttfb_s, self.tracing.trace_id())
                    return result
                except _Retry as e:
                    last = e
                    if e.answered:
                        unexplained.append(inst)
                    tel.upstream_failures.labels(fleet, inst.id, e.reason).inc()
                    _log.debug("upstream_attempt_failed", request_id=request_id, instance=inst.id,
                               attempt=attempt, reason=e.reason, error=e.message)
                    continue
                result.attempts = attempt
                result.decision = decision
                tel.count_request(fleet, inst.id, result.status)
                tel.observe_ttfb(fleet, result.ttfb_s, self.tracing.trace_id())
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

    def _plan(self, endpoint: str, body: bytes, sink: ResponseSink) -> ResumableStream | str:
        """How a stream is read: continued after a failure, or only read for its usage (``fixed``), or
        passed through byte for byte (the string: why it is not continued). A sink that meters (a
        :class:`~routerd.tenants.UsageTap`) is given the reader's count, read however the call ends."""
        plan = resume.reader(endpoint, body, resumable=bool(self.cfg.max_resumes))
        meter: _Meter | None = getattr(sink, "meter", None)
        if meter is not None and isinstance(plan, ResumableStream):
            meter(plan.usage)
        return plan

    def _abandoned(self, sink: ResponseSink, plan: ResumableStream | str | None, inst: Instance,
                   sent: float, request: RequestView | None) -> None:
        """The call was cancelled during an attempt on ``inst`` (sent at ``sent``). The engine worked on
        it unread — a non-streamed request, or a stream no count of which was read yet (its client left
        during the prefill, say): a metering sink is given what it likely generated."""
        if isinstance(plan, ResumableStream) and plan.counted:
            return  # the engine's own count stands
        meter: _Meter | None = getattr(sink, "meter", None)
        if meter is not None:
            counts = _abandoned_usage(inst, self.clock() - sent, request)
            meter(lambda: counts)

    async def _attempt(self, inst: Instance, endpoint: str, body: bytes, sink: ResponseSink,
                       stream: bool, request_id: str, started: float,
                       unexplained: list[Instance], task: asyncio.Task[object],
                       plan: ResumableStream | str | None = None) -> ForwardResult:
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
            if isinstance(plan, ResumableStream) and plan.started:  # a continuation of a client's stream
                ok, error = await self._continued(inst, resp, sink, first, plan)
                clean = True
                return ForwardResult(instance=inst.id, attempts=1, status=200, ok=ok, error=error)
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
            sse = headers["Content-Type"].startswith("text/event-stream")
            if isinstance(plan, ResumableStream) and 200 <= resp.status < 300 and sse:
                plan.started = True
                try:
                    ok, error = await self._continued(inst, resp, sink, first, plan)
                except _Resume as e:
                    e.ttfb_s = ttfb
                    raise
            elif stream and 200 <= resp.status < 300:
                await sink.write(first)
                ending = await relay.passthrough(resp, sink, first, sse)
                ok, error = await self._passed(inst, sink, ending, sse, plan if isinstance(plan, str) else "")
            else:
                await sink.write(first)
                ok = 200 <= resp.status < 300
                error = None if ok else _error_message(first, resp.status)
            clean = True
            return ForwardResult(instance=inst.id, attempts=1, status=resp.status, ok=ok, error=error,
                                 ttfb_s=ttfb,
                                 usage=plan.usage() if isinstance(plan, ResumableStream) else None)
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
            headers = {"Content-Type": "application/json", "X-Request-Id": _header_safe(request_id),
                       "Accept": "*/*", "Accept-Encoding": "identity"}
            if self.tracing.on:  # the attempt's span: the engine's own span joins the trace
                self.tracing.inject(headers)
            with _Deadline(task, self._loop, self.cfg.first_byte_timeout_s):
                resp = await self.pool.post(inst.url + endpoint, body, headers)
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
            elif isinstance(e, NET_ERRORS):
                reason = "connect" if isinstance(e, ConnectError) else "disconnect"
                retry = _Retry(reason, f"{type(e).__name__}: {e}")
            else:
                raise
            if not retry.answered:
                self._failed(inst)
            if retry is e:
                raise
            raise retry from e

    async def _passed(self, inst: Instance, sink: ResponseSink, ending: relay.Ending, sse: bool,
                      why: str) -> tuple[bool, str | None]:
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
        self._failed(inst, "stream_broken")
        tel.streams_cut.labels(inst.fleet, "disabled" if why == "disabled" else "not_continuable").inc()
        message = ending.message
        if why in resume.NOT_CONTINUABLE:
            message += f"; not continued elsewhere: {resume.NOT_CONTINUABLE[why]}"
        if sse:
            await sink.write(sse_error_event(message, "UpstreamError", 502))
        return False, message

    async def _continued(self, inst: Instance, resp: Response, sink: ResponseSink, first: bytes,
                         rs: ResumableStream) -> tuple[bool, str | None]:
        """Relay a continuable stream (a first attempt's or a continuation's) event by event; raise
        :class:`_Resume` when its engine fails. An engine that refuses a continuation (4xx: it does not
        know ``continue_final_message``, say) ends the stream: another would refuse it too."""
        tel = self.telemetry
        if not 200 <= resp.status < 300:
            message = f"{inst.id} refused to continue the stream: {_error_message(first, resp.status)}"
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
                self._failed(inst, "stream_broken")
            raise _Resume(ending.failure, ending.message, inst.id)
        return True, None

    async def _resume(self, fleet: str, endpoint: str, sink: ResponseSink, request_id: str,
                      task: asyncio.Task[object], rs: ResumableStream, failure: _Resume, tried: list[str],
                      request: RequestView | None) -> ForwardResult:
        """Continue a stream whose engine failed after its first byte on other instances — never one
        it failed on — until it completes, or ``max_resumes`` continuations failed, or it cannot be
        continued (then it ends with the terminal error event)."""
        if rs.fixed:
            return await self._not_continued(fleet, sink, rs, failure)
        tel = self.telemetry
        failed = {failure.instance}
        rs.gap_from = rs.wrote_at or self.clock()
        resumes = 0
        while True:
            if rs.finished:  # only the tail (usage chunk, [DONE]) was lost: nothing to generate
                await sink.write(rs.complete())
                return ForwardResult(instance=failure.instance, attempts=resumes, status=200, ok=True,
                                     error=None, resumes=resumes)
            why, key = self._why_not_resume(rs, resumes)
            inst = None
            if not why:
                if resumes:
                    await asyncio.sleep(self.backoff_s(resumes + 1))
                try:
                    inst = self.router.pick(fleet, tried, request)
                except NoReadyInstance:
                    inst = None
                if inst is None or inst.id in failed:
                    why, key = "no other instance is ready", "no_instance"
            if why or inst is None:
                message = f"{failure.message}; not continued elsewhere: {why}"
                tel.streams_cut.labels(fleet, key).inc()
                _log.warning("stream_cut", request_id=request_id, instance=failure.instance,
                             reason=failure.reason, why=why, tokens_sent=rs.tokens, resumes=resumes)
                await sink.write(rs.cut(message))
                return ForwardResult(instance=failure.instance, attempts=resumes, status=200, ok=False,
                                     error=message, resumes=resumes)
            resumes += 1
            tel.resumes.labels(fleet, failure.reason).inc()
            tried.append(inst.id)
            _log.info("stream_resumed", request_id=request_id, failed=failure.instance, to=inst.id,
                      reason=failure.reason, tokens_sent=rs.tokens, resume=resumes)
            try:
                with self.tracing.attempt("routerd.resume", resumes, inst.id, inst.url):
                    self.tracing.note(**{"routerd.resume.reason": failure.reason,
                                         "routerd.resume.failed_instance": failure.instance,
                                         "routerd.resume.tokens_sent": rs.tokens})
                    result = await self._attempt(inst, endpoint, rs.continuation(), sink, True,
                                                 request_id, 0.0, [], task, rs)
                    self.tracing.outcome(result.ok, result.error, result.status)
            except _Retry as e:  # the continuation failed before any event of it reached the client
                failure = _Resume(e.reason, e.message, inst.id)
            except _Resume as e:
                failure = e
            else:
                result.attempts = result.resumes = resumes
                if result.ok:
                    tel.resumed_completed.labels(fleet).inc()
                return result
            failed.add(inst.id)
            rs.gap_from = rs.gap_from or rs.wrote_at or self.clock()

    async def _not_continued(self, fleet: str, sink: ResponseSink, rs: ResumableStream,
                             failure: _Resume) -> ForwardResult:
        """End a stream read only for its usage (:func:`resume.meter`) whose engine failed, as
        :meth:`_passed` ends one relayed byte for byte: with routerd's terminal error event."""
        why = rs.fixed
        self.telemetry.streams_cut.labels(fleet, "disabled" if why == "disabled" else "not_continuable").inc()
        message = failure.message
        if why in resume.NOT_CONTINUABLE:
            message += f"; not continued elsewhere: {resume.NOT_CONTINUABLE[why]}"
        await sink.write(rs.cut(message))
        return ForwardResult(instance=failure.instance, attempts=0, status=200, ok=False, error=message)

    def _why_not_resume(self, rs: ResumableStream, resumes: int) -> tuple[str, str]:
        """Why the stream is not continued now (text, ``routerd_streams_cut_total`` reason), or empty."""
        if resumes >= self.cfg.max_resumes:
            return f"routing.max_resumes ({self.cfg.max_resumes}) reached", "max_resumes"
        key = rs.why_not()
        if key:
            return resume.NOT_CONTINUABLE[key], "not_continuable"
        return "", ""

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
    if first.startswith(ERROR_MARK):
        raise _Retry("error_event", "error event before any token: " + _event_message(first),
                     answered=True)
    return first


def _abandoned_usage(inst: Instance, elapsed_s: float,
                     request: RequestView | None) -> tuple[int, int] | None:
    """What an engine likely made of a non-streamed request abandoned after ``elapsed_s`` on it (its
    client went away, a deadline or a drain cancelled it; closing the connection aborted it). Nobody
    reads its answer, so this is an estimate: the prompt as routing estimated it, and the tokens one
    sequence of the instance decodes per second (learned from its scrapes) over the time after its
    prefill, at most ``max_tokens`` — none before the instance has shown its speed."""
    if request is None:
        return None
    learned = inst.learned
    decode = learned.decode_tokens_per_s
    prefill = learned.prefill_s if learned.prefill_s is not None else PRIOR_PREFILL_S
    completion = 0
    if decode is not None and elapsed_s > prefill:
        completion = 1 + int((elapsed_s - prefill) * decode)
        if request.max_tokens is not None:
            completion = min(completion, request.max_tokens)
    return request.prompt_tokens, completion


def _header_safe(request_id: str) -> str:
    """The request id as an ``X-Request-Id`` value: a queue job's id may hold characters no header may
    (a newline would end the header: the client refuses to send it), so those are percent-encoded."""
    if _SAFE_ID.fullmatch(request_id):
        return request_id
    return urllib.parse.quote(request_id, safe="")[:_MAX_ID_CHARS] or "-"


def _event_message(chunk: bytes) -> str:
    line = chunk.split(b"\n", 1)[0][len(b"data: "):]
    return _error_message(line, 500)
