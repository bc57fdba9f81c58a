"""The engine call: where a request is routed, failover before the first byte, mid-stream resume.

One request's life here:

1. the router picks an instance (``Router.choose``: the policy over the registry, the decision kept
   for the request's log line) and one attempt runs on it (:mod:`routerd.dataplane.attempt`: timeouts,
   the first byte, the relay, what a failure costs the instance);
2. until the first byte goes to the :class:`~routerd.dataplane.sinks.ResponseSink` every failure —
   connect error, timeout, 5xx/503, an empty body, a leading ``data: {"error"`` event — is retried on
   another instance (at most ``max_attempts``, jittered exponential backoff);
3. after the first byte a stream is not retried but *resumed* (:mod:`routerd.dataplane.resume`): when
   its engine fails — connection dropped, read timeout, the instance declared lost, closed without
   ``[DONE]``, an error event with a 5xx code — the generation is continued on another instance and
   the client's stream goes on as one stream, at most ``max_resumes`` times (a queue job's deadline
   bounds its whole engine call, resumes included). A stream that cannot be continued
   (``resume.NOT_CONTINUABLE``: ``n > 1``, grammars, ``echo``…) ends as before: the sink gets
   routerd's terminal ``data: {"error": …}`` + ``data: [DONE]``, or the engine's own error event when
   it blamed the request (4xx code). Either way the result says ``ok=False``. A non-streamed request
   shows nothing before it completes, so one whose engine dies mid-generation is simply retried from
   the start (step 2).

The HTTP itself is :mod:`routerd.dataplane.engine_http`: keep-alive connections per engine, one write
per request. Cancelling ``forward`` (the client went away) closes the upstream connection, which is
what makes vLLM abort the request. Exceptions raised by the sink (the client's socket is gone)
propagate the same way and do not count against the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Sequence

import aiohttp

from .. import log
from ..config import FleetConfig, RoutingConfig
from ..errors import NoReadyInstance, UpstreamError
from ..plugins import RequestView
from ..registry import Instance
from ..routing import RouteDecision, Router
from ..routing.adapters import AdapterLoadFailed
from ..speed import PRIOR_PREFILL_S
from ..surface import EventReader, Route, StreamShape, passthrough_route, route_for
from ..telemetry import Telemetry
from ..tracing import Tracing
from . import resume
from .attempt import Attempts, Retry, StreamFailed
from .engine_http import EnginePool
from .resume import ResumableStream
from .sinks import ForwardResult, ResponseSink
from .usage import UsageTap

__all__ = ["Upstream", "engine_bearers", "make_session"]

_log = log.get("routerd.upstream")


def engine_bearers(fleets: Sequence[FleetConfig], engine_api_key: str) -> dict[str, str]:
    """The API key each fleet's engines are sent: a static fleet's own ``api_key`` (none without one:
    the launched engines' key never goes to an engine routerd did not launch), the launched engines'
    key for the others."""
    return {f.name: f.api_key if f.engine == "static" else engine_api_key for f in fleets}


def make_session(cfg: RoutingConfig) -> aiohttp.ClientSession:
    """The pooled client session of a process: warm-up, KV-event sources and the like (the engine call,
    the scrapes and static heartbeats have the leaner connections of
    :class:`~routerd.dataplane.engine_http.EnginePool`).

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

    def __init__(self, router: Router, cfg: RoutingConfig, telemetry: Telemetry, *, tracing: Tracing,
                 rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic, engine_api_key: str = "") -> None:
        """``engine_api_key``: what the engines routerd launches require (``Trust.engine_api_key``);
        which fleets' engines get it, and a static fleet's own, is :meth:`update_fleets`."""
        # Idle connections are dropped after 4 s, below uvicorn's (vLLM's) 5 s keep-alive.
        self.pool = EnginePool(connect_timeout_s=cfg.connect_timeout_s, read_timeout_s=cfg.read_timeout_s,
                               keepalive_s=4.0)
        self.router = router
        self.cfg = cfg
        self.telemetry = telemetry
        self.rng = rng or random.Random()
        self.clock = clock
        self.active = 0  # forward() calls in progress (drain waits on this)
        self.tracing = tracing  # spans per attempt and resume; the engine gets the context
        self._attempts = Attempts(self.pool, router, cfg, telemetry, tracing, clock)
        self.engine_api_key = engine_api_key

    def bearer(self, fleet: str) -> str:
        """The API key ``fleet``'s engines are sent ("" for none)."""
        return self._attempts.bearers.get(fleet, "")

    def update_fleets(self, fleets: Sequence[FleetConfig]) -> None:
        """The API key each fleet's engines are sent (at start-up and on reload): a static fleet's own
        ``api_key`` (none without one: the launched engines' key never goes to an engine routerd did
        not launch), the launched engines' key for the others."""
        self._attempts.bearers = engine_bearers(fleets, self.engine_api_key)

    def update_config(self, cfg: RoutingConfig) -> None:
        self.cfg = cfg
        self._attempts.cfg = cfg
        self.pool.configure(connect_timeout_s=cfg.connect_timeout_s, read_timeout_s=cfg.read_timeout_s)

    async def run(self) -> None:
        """Keep the engine connections tidy until cancelled (after the last request), then close them."""
        await self.pool.run()

    def backoff_s(self, attempt: int) -> float:
        """Pause before attempt ``attempt`` (2, 3, …): exponential from ``retry_backoff_ms``, ±50% jitter."""
        base: float = self.cfg.retry_backoff_ms / 1000.0 * (2 ** max(0, attempt - 2))
        return base * self.rng.uniform(0.5, 1.5)

    async def forward(self, fleet: str, endpoint: str, body: bytes, sink: ResponseSink, *,
                      stream: bool, request_id: str, request: RequestView | None = None,
                      route: Route | None = None, content_type: str = "application/json") -> ForwardResult:
        """Send ``body`` (an OpenAI request, bytes as received) to ``endpoint`` of an instance of ``fleet``.

        ``request`` is what routing knows of it (its prompt's blocks, session, …: built where the body
        was parsed, :meth:`routerd.routing.request.RequestViews.build`); without it the policy sees only
        the fleet. ``route`` (by default the endpoint's in :data:`routerd.surface.ROUTES`) says how a
        stream is read and ends and the shape of errors; ``content_type`` is what the engine is sent.

        Returns once the response has gone to ``sink`` (see :class:`ForwardResult`). Raises
        :class:`NoReadyInstance` or :class:`UpstreamError` when no byte could be sent.
        """
        started = self.clock()
        task = asyncio.current_task()
        assert task is not None
        tried: list[str] = []
        last: Retry | None = None
        unexplained: list[Instance] = []  # answered failures, charged if another instance serves it
        tel = self.telemetry
        route = route or route_for(endpoint) or passthrough_route(endpoint)
        label = route.label
        plan = self._plan(route, body, sink) if stream else None  # how a stream is read and resumed
        if isinstance(plan, ResumableStream):
            body = plan.engine_body
        self.active += 1
        try:
            if request is not None and request.session is not None \
                    and self.router.shared_sessions is not None:
                await self.router.recall(request.session)  # another process may have routed it
            slot_wait_s = await self._slot_for(fleet, request)
            for attempt in range(1, self.cfg.max_attempts + 1):
                if attempt > 1:
                    tel.retries.labels(fleet).inc()
                    await asyncio.sleep(self.backoff_s(attempt))
                try:
                    decision = self.router.choose(fleet, tried, request)
                except NoReadyInstance:
                    if last is None:
                        tel.count_request(fleet, "", NoReadyInstance.status, label)
                        raise
                    break
                inst = decision.instance
                tried.append(inst.id)
                sent = self.clock()
                try:
                    using = await self._adapter_ready(inst, decision)  # a failed load: Retry
                    with using, self.tracing.attempt("routerd.attempt", attempt, inst.id, inst.url,
                                                     decision.log_fields() if self.tracing.on else None):
                        result = await self._attempts.attempt(inst, endpoint, body, sink, stream, request_id,
                                                              started, unexplained, task, plan, route=route,
                                                              content_type=content_type)
                        self.tracing.outcome(result.ok, result.error, result.status)
                except asyncio.CancelledError:
                    self._abandoned(sink, plan, inst, sent, request)
                    raise
                except StreamFailed as failure:
                    assert isinstance(plan, ResumableStream)
                    result = await self._resume(fleet, endpoint, sink, request_id, task, plan, failure,
                                                tried, request)
                    result.attempts += attempt
                    result.usage = plan.usage()
                    result.ttfb_s = failure.ttfb_s
                    result.decision = decision
                    result.slot_wait_s = slot_wait_s
                    tel.count_request(fleet, result.instance, result.status, label)
                    tel.observe_ttfb(fleet, failure.ttfb_s, self.tracing.trace_id())
                    return result
                except Retry as e:
                    last = e
                    if e.answered:
                        unexplained.append(inst)
                    tel.upstream_failures.labels(fleet, inst.id, e.reason).inc()
                    _log.debug("upstream_attempt_failed", request_id=request_id, instance=inst.id,
                               attempt=attempt, reason=e.reason, error=e.message)
                    continue
                result.attempts = attempt
                result.decision = decision
                result.slot_wait_s = slot_wait_s
                tel.count_request(fleet, inst.id, result.status, label)
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
            tel.count_request(fleet, tried[-1], err.status, label)
            raise err
        finally:
            self.active -= 1

    async def _slot_for(self, fleet: str, request: RequestView | None) -> float:
        """A request for an adapter that would load it beyond every instance's slots waits, a bounded
        while, for one to free (:meth:`AdapterSlots.wait_for_slot`). The seconds waited (0.0: none)."""
        adapters = self.router.adapters
        if adapters is None or request is None or request.adapter is None:
            return 0.0
        adapter = adapters.catalog.get(request.adapter)
        if adapter is None or adapter.fleet != fleet:
            return 0.0
        return await adapters.wait_for_slot(adapter)

    async def _adapter_ready(self, inst: Instance, decision: RouteDecision
                             ) -> contextlib.AbstractContextManager[object]:
        """For an adapter request: what marks the adapter busy there during the attempt, after its load
        there (joined if in flight, bounded). A failed load is a :class:`Retry` (tried elsewhere next);
        a path that holds no adapter is :class:`NoReadyInstance` at once (any instance would fail alike)."""
        lora, adapters = decision.adapter, self.router.adapters
        if lora is None or adapters is None:
            return contextlib.nullcontext()
        if lora.load:
            try:
                await adapters.ensure(inst, lora)
            except AdapterLoadFailed as e:
                if e.permanent:
                    raise NoReadyInstance(e.message) from None
                raise Retry("adapter_load", e.message) from None
        ctx: contextlib.AbstractContextManager[object] = adapters.using(inst, lora.adapter.name)
        return ctx

    def _plan(self, route: Route, body: bytes, sink: ResponseSink) -> ResumableStream | EventReader | str:
        """How a stream is read: continued after a failure, or only read for its usage (``fixed``), or
        read by its route's named events (:class:`EventReader`), or passed through byte for byte (the
        string: why it is not continued). The dispatch's usage tap is given the reader's count, read
        however the call ends."""
        plan: ResumableStream | EventReader | str
        if route.stream is StreamShape.EVENTS:
            plan = EventReader(route)
        elif not route.resumable:
            return "route"
        else:
            plan = resume.reader(route.path, body, resumable=bool(self.cfg.max_resumes))
        if isinstance(sink, UsageTap) and not isinstance(plan, str):
            sink.meter(plan.usage)
        return plan

    def _abandoned(self, sink: ResponseSink, plan: ResumableStream | EventReader | str | None, inst: Instance,
                   sent: float, request: RequestView | None) -> None:
        """The call was cancelled during an attempt on ``inst`` (sent at ``sent``). The engine worked on
        it unread — a non-streamed request, or a stream no count of which was read yet (its client left
        during the prefill, say): the dispatch's usage tap is given what it likely generated."""
        if (isinstance(plan, ResumableStream) and plan.counted) or \
                (isinstance(plan, EventReader) and plan.usage() is not None):
            return  # the engine's own count stands
        if isinstance(sink, UsageTap):
            counts = _abandoned_usage(inst, self.clock() - sent, request)
            sink.meter(lambda: counts)

    async def _resume(self, fleet: str, endpoint: str, sink: ResponseSink, request_id: str,
                      task: asyncio.Task[object], rs: ResumableStream, failure: StreamFailed,
                      tried: list[str], request: RequestView | None) -> ForwardResult:
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
            inst = decision = None
            if not why:
                if resumes:
                    await asyncio.sleep(self.backoff_s(resumes + 1))
                try:
                    decision = self.router.choose(fleet, tried, request)
                    inst = decision.instance
                except NoReadyInstance:
                    inst = None
                if inst is None or inst.id in failed:
                    why, key = "no other instance is ready", "no_instance"
            if why or inst is None or decision is None:
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
                # an adapter's continuation goes where the adapter is (loaded there first if need be)
                with await self._adapter_ready(inst, decision), \
                        self.tracing.attempt("routerd.resume", resumes, inst.id, inst.url):
                    self.tracing.note(**{"routerd.resume.reason": failure.reason,
                                         "routerd.resume.failed_instance": failure.instance,
                                         "routerd.resume.tokens_sent": rs.tokens})
                    result = await self._attempts.attempt(inst, endpoint, rs.continuation(), sink, True,
                                                          request_id, 0.0, [], task, rs)
                    self.tracing.outcome(result.ok, result.error, result.status)
            except (Retry, NoReadyInstance) as e:  # failed before any event of it reached the client
                failure = StreamFailed(getattr(e, "reason", "adapter_load"), e.message, inst.id)
            except StreamFailed as e:
                failure = e
            else:
                result.attempts = result.resumes = resumes
                if result.ok:
                    tel.resumed_completed.labels(fleet).inc()
                return result
            failed.add(inst.id)
            rs.gap_from = rs.gap_from or rs.wrote_at or self.clock()

    async def _not_continued(self, fleet: str, sink: ResponseSink, rs: ResumableStream,
                             failure: StreamFailed) -> ForwardResult:
        """End a stream read only for its usage (:func:`resume.meter`) whose engine failed, as an
        attempt ends one relayed byte for byte (``Attempts.cut``): with routerd's terminal error event."""
        message = self._attempts.cut(fleet, rs.fixed, failure.message)
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
