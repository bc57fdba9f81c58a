"""The HTTP way in: every route of :data:`routerd.surface.ROUTES` (OpenAI's, the Responses API,
pooling and scoring, Anthropic's messages, audio, tokenize), health and readiness, ``/metrics`` and
``GET /admin/fleets``; with ``[http] passthrough`` any other POST under ``/v1/``.

A request is checked just enough to route it (:mod:`routerd.surface.heads`, the check a queue job's
body gets too) and then forwarded as the very bytes the client sent. Everything the engine validates
(sampling parameters, lengths) is left to the engine, whose 4xx answer is passed through. Errors
routerd finds itself use the route's error shape (OpenAI's, or Anthropic's on ``/v1/messages*``) with
a matching status.

The app runs with ``handler_cancellation=True``: a client that disconnects cancels its handler, the
cancellation reaches the engine call (:mod:`routerd.dataplane`), and that closes the engine
connection so the engine aborts the request instead of generating into the void.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
from aiohttp import web

from .. import log
from ..config import Config, FleetConfig
from ..dataplane.admission import Admission
from ..dataplane.dispatch import Dispatch, Request
from ..elastic import Elastic
from ..errors import (
    BadRequest,
    BodyTooLarge,
    NoReadyInstance,
    NotFound,
    Overloaded,
    RateLimited,
    RouterdError,
    ShuttingDown,
    UnsupportedMediaType,
    error_type,
    quote,
)
from ..registry import InstanceState, Registry
from ..routing import Router
from ..routing.adapters import AdapterCatalog, AdapterSlots
from ..surface import (
    ROUTES,
    Body,
    ErrorShape,
    Family,
    Route,
    error_body_json,
    passthrough_route,
    read_body,
    stream_error,
)
from ..surface.multipart import boundary_of
from ..telemetry import CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE, Metrics, Telemetry
from ..tenants import Tenant
from ..tenants.service import Tenancy
from ..tracing import Tracing
from ._connections import ClientConnection, ClientConnections, http_error
from ._connections import request_id as client_request_id
from .auth import authenticate, check_admin
from .worker_pages import WorkerPages

_log = log.get("routerd.http")

ExtraRoutes = Callable[[web.Application], None]


def error_response(err: RouterdError, shape: ErrorShape = ErrorShape.OPENAI) -> web.Response:
    """routerd's own refusal ``err``, in the route's error ``shape``."""
    headers: dict[str, str] = {}
    if isinstance(err, RateLimited):  # a tenant's limit: when its bucket holds enough, to the ms
        headers.update(err.headers)
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, math.ceil(err.retry_after_s * 1000)))
    elif isinstance(err, Overloaded):
        headers["Retry-After"] = str(max(1, round(err.retry_after_s)))
    elif isinstance(err, NoReadyInstance | ShuttingDown) and err.retry_after_s is not None:  # start-up, drain
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    return web.Response(status=err.status, body=error_body_json(shape, err.message, err.type, err.status,
                                                                err.param),
                        content_type="application/json", headers=headers)


def _shape(path: str) -> ErrorShape:
    """The error shape of a path, for answers no route's handler made (aiohttp's 404/405, the boundary)."""
    return ErrorShape.ANTHROPIC if path.startswith("/v1/messages") else ErrorShape.OPENAI


def _not_served(request: web.Request) -> NotFound:
    return NotFound(f"routerd serves no {request.method} {quote(request.path)}; its routes: "
                    f"{', '.join(sorted(ROUTES))}, GET /v1/models (with [http] passthrough = true, any "
                    "other POST under /v1/ goes to the fleet its body's `model` names)")


@web.middleware
async def errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    """The request boundary: whatever escapes a handler is answered in OpenAI's error shape.

    aiohttp's own answers (unknown route, wrong method) and anything unexpected (a faulty policy plugin,
    a bug) would otherwise reach an OpenAI client as a plain-text page it cannot parse."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 404 and request.path.startswith("/v1/"):
            return error_response(_not_served(request), _shape(request.path))
        if _shape(request.path) is ErrorShape.ANTHROPIC:
            return web.Response(status=e.status, body=error_body_json(ErrorShape.ANTHROPIC, e.reason,
                                                                      error_type(e.status), e.status),
                                content_type="application/json")
        return http_error(e.status, e.reason)
    except RouterdError as e:
        return error_response(e, _shape(request.path))
    except web.RequestPayloadError as e:  # a body aiohttp cannot decode (bad chunking, compression)
        return error_response(BadRequest(f"the request body could not be read: {quote(str(e))}"),
                              _shape(request.path))
    except Exception:  # noqa: BLE001  # the request boundary: logged whole, answered, server goes on
        _log.exception("request_failed", path=request.path)
        return error_response(RouterdError("internal error in routerd"), _shape(request.path))


class _ForwardedResponse(web.StreamResponse):
    """An engine's answer on its way to the client: its headers leave in the same ``write`` as its
    first bytes — the whole body of a non-streamed answer, the first event of a stream — instead of
    a ``write`` of their own (aiohttp buffers a ``web.Response``'s headers this way; a
    ``StreamResponse`` sends them at ``prepare``). Each write is a syscall and, on loopback, the
    receiver's work as well: this halves them for a non-streamed request."""

    _send_headers_immediately = False


class _HttpSink:
    """:class:`routerd.dataplane.sinks.ResponseSink` onto the client's response."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        resp = _ForwardedResponse(status=status, headers=headers)
        self.response = resp
        await resp.prepare(self.request)

    async def write(self, chunk: bytes) -> None:
        assert self.response is not None
        await self.response.write(chunk)


class HttpIngress:
    """The aiohttp application and its handlers; one per data plane."""

    def __init__(self, cfg: Config, registry: Registry, *, dispatch: Dispatch, admission: Admission,
                 router: Router, tenancy: Tenancy, telemetry: Telemetry, metrics: Metrics, tracing: Tracing,
                 clock: Callable[[], float] = time.monotonic,
                 desired_replicas: Callable[[FleetConfig], int] | None = None,
                 elastic: Elastic | None = None,
                 view_status: Callable[[], dict[str, Any]] | None = None,
                 view_untrusted: Callable[[], str] | None = None,
                 control: Callable[[], dict[str, Any]] | None = None,
                 serves: Callable[[str], bool] | None = None,
                 orphaned: Callable[[], list[dict[str, Any]]] | None = None,
                 redis_health: Callable[[], tuple[str, bool]] | None = None) -> None:
        self.registry = registry
        self.dispatch = dispatch
        self.tenancy = tenancy  # the data plane's, shared with the queue
        self.admission = admission  # its figures in /admin/fleets, its HTTP waiters answered on drain
        self.router = router  # its policy's name in /admin/fleets
        self.telemetry = telemetry
        self.exposition = metrics  # the /metrics body
        self.pages: WorkerPages | None = None  # a worker's: its siblings' pages too (worker_pages.py)
        self.tracing = tracing  # the server span of each request
        self.clock = clock
        self.created = int(time.time())
        self.draining = False
        # Draining a socket-activated listener (routerd/ingress/listener.py): requests on open
        # connections are still served, each response closing its connection.
        self.handover = False
        # The fleet manager's run-time replica count when routerd launches fleets (admin scaling
        # overrides the file until the next reload that changes it); None: the config's.
        self.desired_replicas = desired_replicas
        # Fleets that scale to zero: ready while at zero (a request starts one); their autoscaling
        # state in /admin/fleets.
        self.elastic = elastic
        # With several routerd on one Redis: this process's view of the fleet state (routerd/peers/),
        # and who controls the fleets (routerd/peers/lease.py ControlLease.status), in /admin/fleets.
        self.view_status = view_status
        self.view_untrusted = view_untrusted  # why this follower has no fleet view it can trust ("": has)
        # Why Redis cannot be used ("": it can), and whether that keeps it unready (RedisConn.health).
        self.redis_health = redis_health
        self.control = control
        # serves(fleet): whether it is one of the fleets there are (FleetStateSync.serves; None: every fleet
        # of
        # this process's config) — while following, the controller's fleets are the fleets, so a fleet only
        # this process's file has is not served, listed or awaited for readiness here. And the engines it
        # left running unmanaged (orphaned), in /admin/fleets.
        self._serves = serves
        self.orphaned = orphaned
        self.handlers: set[asyncio.Task[Any]] = set()  # in-flight OpenAI requests (drain, close_streams)
        self.close_reason = ""
        self.idle = asyncio.Event()
        self.idle.set()
        self.connections = ClientConnections(cfg.http, telemetry)
        # batches (issue 31): the Batch API's routes and its part of /admin/fleets, set by the assembly
        self.batch_routes: ExtraRoutes | None = None
        self.conversation_routes: ExtraRoutes | None = None  # stored responses, conversations (issue 29)
        self.batch_status: Callable[[], dict[str, Any]] | None = None
        # LoRA adapters as models (routerd/routing/adapters.py), set by the assembly; None: no LoRA fleet
        self.adapters: AdapterCatalog | None = None
        self.adapter_slots: AdapterSlots | None = None  # who holds which (/admin/fleets)
        self.update_config(cfg)

    def update_config(self, cfg: Config) -> None:
        self.cfg = cfg
        self.connections.update_config(cfg.http)
        self._models = {f.model: f.name for f in cfg.fleets}

    def serves(self, fleet: str) -> bool:
        """Whether ``fleet`` is one of the fleets there are (routerd/peers/fleet_state.py's docstring)."""
        return self._serves is None or self._serves(fleet)

    def build_app(self, extra_routes: ExtraRoutes | None = None) -> web.Application:
        """The application; ``extra_routes(app)`` may add routes (the admin module) before it starts."""
        app = web.Application(client_max_size=self.cfg.http.max_body_bytes, middlewares=[errors_as_json])
        for route in ROUTES.values():  # every route the table has, one handler
            app.router.add_post(route.path, self._handler(route))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/admin/fleets", self.admin_fleets)
        if self.batch_routes is not None:  # batches (issue 31): /v1/files, /v1/batches
            self.batch_routes(app)
        if self.conversation_routes is not None:  # GET/DELETE /v1/responses/{id}…, /v1/conversations
            self.conversation_routes(app)
        app.on_response_prepare.append(_stamp_request_id)
        app.on_response_prepare.append(self._close_when_draining)
        if extra_routes is not None:
            extra_routes(app)
        # Last: aiohttp matches routes in the order they were added, so this takes only what no other
        # route matched (what answers depends on [http] passthrough, read per request: a reload applies).
        app.router.add_route("*", "/v1/{tail:.+}", self.passthrough)
        return app

    async def _close_when_draining(self, request: web.Request, response: web.StreamResponse) -> None:
        """During a drain every response says ``Connection: close``: the client's next request opens a
        new connection — refused, or after a handover, accepted by the next routerd."""
        if self.draining:
            response.force_close()
            # aiohttp writes its Connection header before this hook runs: say it here too, or the
            # client would reuse a connection this response ends.
            response.headers["Connection"] = "close"

    # the engine routes ----------------------------------------------------------------------
    def _handler(self, route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, route)
        return handle

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, ROUTES["/v1/completions"])

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, ROUTES["/v1/chat/completions"])

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """A path under ``/v1/`` no route has: a POST forwarded to the fleet its body's ``model`` names
        with ``[http] passthrough = true``, else a JSON 404 naming the routes served (405 for another
        method on a route that has one)."""
        if request.method != "POST" or not self.cfg.http.passthrough:
            if request.path in ROUTES:
                raise web.HTTPMethodNotAllowed(request.method, ["POST"])
            return error_response(_not_served(request), _shape(request.path))
        return await self._serve(request, passthrough_route(request.path))

    async def _serve(self, request: web.Request, route: Route) -> web.StreamResponse:
        endpoint = route.path
        started = self.clock()
        request_id = client_request_id(request)  # bound for every log line by ClientConnections
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        self.idle.clear()
        sink = _HttpSink(request)
        fields: dict[str, Any] = {"request_id": request_id, "endpoint": endpoint}
        # The server span (continuing the client's traceparent), current until after the log line.
        traced = self.tracing.server(request.headers, endpoint, request_id)
        try:
            return await self._dispatch(request, route, request_id, sink, fields)
        except asyncio.CancelledError:
            fields["status"] = 499
            fields["error"] = self.close_reason or _shed_reason(request) or "client disconnected"
            if self.close_reason and sink.response is not None \
                    and sink.response.content_type == "text/event-stream":
                await self._close_stream(sink, route)
            raise
        except (ConnectionResetError, RuntimeError) as e:
            # The client's socket went away under a write (before aiohttp cancelled us); aiohttp
            # says so with ConnectionResetError or, on a closing transport, RuntimeError.
            transport = request.transport
            if not isinstance(e, ConnectionResetError) and transport is not None \
                    and not transport.is_closing():
                raise
            fields["status"], fields["error"] = 499, _shed_reason(request) or f"client gone: {e}"
            return sink.response or web.Response(status=499)
        finally:
            self.handlers.discard(task)
            if not self.handlers:
                self.idle.set()
            duration = self.clock() - started
            fields["duration_ms"] = round(duration * 1000, 2)
            if "fleet" in fields:
                self.telemetry.observe_request(fields["fleet"], duration,
                                               traced.trace_id if traced is not None else "", route.label)
            _log.info("request", **fields)
            if traced is not None:
                traced.end(fields)

    async def _dispatch(self, request: web.Request, route: Route, request_id: str, sink: _HttpSink,
                        fields: dict[str, Any]) -> web.StreamResponse:
        try:  # the request read into the dispatch's: its caller, its body checked, a fleet it may use
            content_type = request.headers.get("Content-Type", "")
            multipart = route.body is Body.MULTIPART
            limit = self.cfg.http.max_audio_bytes if multipart else self.cfg.http.max_body_bytes
            tenant = self._caller(request, fields, limit)
            if multipart:
                boundary_of(content_type)  # before a byte is read: 415 for anything but a form
            else:
                content_type = _json_content_type(content_type)
            body = await self._read_body(request, limit)
            read = read_body(route, body, content_type)
            model, stream = read.model, read.stream
            fields["model"], fields["stream"] = quote(model), stream
            fleet = self._models.get(model)
            adapter = self.adapters.get(model) if fleet is None and self.adapters is not None else None
            if adapter is not None:
                fleet = adapter.fleet
                fields["adapter"] = adapter.name
            if fleet is None or not self.serves(fleet):
                raise NotFound(f"The model `{quote(model)}` does not exist. Valid models: "
                               f"{', '.join(self._valid_models()) or 'none'}", param="model")
            fields["fleet"] = fleet
            self.tenancy.check_fleet(tenant, fleet, adapter.name if adapter is not None else None)
            if adapter is not None and self.adapters is not None and adapter.name in self.adapters.failed:
                raise NoReadyInstance(f"adapter {adapter.name!r} does not load: "
                                      f"{self.adapters.failed[adapter.name]}")
            # a passthrough path goes to the engine as asked (its query string too)
            endpoint = request.path_qs if route.family is Family.OTHER else route.path
            req = Request(fleet=fleet, endpoint=endpoint, body=body, head=read.head, stream=stream,
                          id=request_id, tenant=tenant, source="http", route=route, content_type=content_type,
                          session=_session(request) or read.session,
                          adapter=adapter.name if adapter is not None else "")
        except RouterdError as e:  # refused before the dispatch: counted here
            fields["status"], fields["error"] = e.status, e.message
            self.telemetry.count_request(fields.get("fleet", ""), "", e.status, route.label)
            return error_response(e, route.errors)
        try:
            await self.dispatch.run(req, lambda: sink, fields)
        except RouterdError as e:  # the dispatch noted and counted it
            return error_response(e, route.errors)
        assert sink.response is not None
        await sink.response.write_eof()
        return sink.response

    def _caller(self, request: web.Request, fields: dict[str, Any], limit: int) -> Tenant:
        """Whose request this is, before its body is read: not while draining, a valid key, a body
        that may fit (``limit``: the route's)."""
        if self.draining and not self.handover:
            raise ShuttingDown("routerd is shutting down")
        tenant = authenticate(request, self.tenancy.directory)
        if self.tenancy.directory.configured:
            fields["tenant"] = tenant.name
        if (request.content_length or 0) > limit:
            raise BodyTooLarge(f"the body is larger than {limit} bytes")
        return tenant

    async def _read_body(self, request: web.Request, limit: int) -> bytes:
        """The body, at most ``limit`` (``http.max_body_bytes``, or ``max_audio_bytes`` for a form) —
        checked here rather than by the app's ``client_max_size``, which is fixed when the app is built,
        so a reloaded limit applies; a larger one is refused while it is read, nothing forwarded."""
        parts: list[bytes] = []
        size = 0
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"the body is larger than {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def _close_stream(self, sink: _HttpSink, route: Route) -> None:
        """On shutdown, tell a client whose stream is cut why (best effort, bounded)."""
        assert sink.response is not None
        try:
            async with asyncio.timeout(1.0):
                await sink.response.write(stream_error(route, self.close_reason, "ServiceUnavailableError",
                                                       503))
                await sink.response.write_eof()
        except (ConnectionResetError, RuntimeError, TimeoutError):
            pass

    def _valid_models(self) -> list[str]:
        """The models and adapters there are, for a 404's message."""
        valid = [m for m, f in self._models.items() if self.serves(f)]
        if self.adapters is not None:
            valid += [a.name for a in self.adapters.all() if self.serves(a.fleet)]
        return sorted(valid)

    async def models(self, request: web.Request) -> web.Response:
        # A refusal is answered by errors_as_json. Only the fleets the caller's tenant may use are
        # listed: a model it would get 403 for is not one it has; so for adapters (with `parent`).
        tenant = authenticate(request, self.tenancy.directory)
        data = [{"id": f.model, "object": "model", "created": self.created, "owned_by": "routerd",
                 "root": f.model, "parent": None} for f in self.cfg.fleets
                if tenant.allows(f.name) and self.serves(f.name)]
        if self.adapters is not None:
            parents = self.adapters.parents
            data += [{"id": a.name, "object": "model", "created": self.created, "owned_by": "routerd",
                      "root": a.path, "parent": parents.get(a.fleet)} for a in self.adapters.all()
                     if tenant.allows(a.fleet, a.name) and self.serves(a.fleet)]
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)

    # operations ------------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        fleets = {f.name: self.registry.ready_count(f.name) for f in self.cfg.fleets if self.serves(f.name)}
        elastic = self.elastic
        # A fleet scaled to zero is ready: a request for it waits while an instance starts.
        standby = sorted(name for name, n in fleets.items()
                         if n == 0 and elastic is not None and elastic.standby(name))
        not_ready = sorted(name for name, n in fleets.items() if n == 0 and name not in standby)
        untrusted = self.view_untrusted() if self.view_untrusted is not None else ""
        redis, redis_blocks = self.redis_health() if self.redis_health is not None else ("", False)
        ready = not not_ready and not self.draining and not untrusted and not redis_blocks
        body = {"ready": ready, "draining": self.draining, "ready_instances": fleets,
                "not_ready": not_ready, "standby": standby}
        if redis:  # Redis unusable: unready only if never reached since start (a wrong address or name)
            body["redis"] = redis
        if untrusted:  # a follower that cannot trust the controller's fleet state has no fleet view
            body["untrusted_view"] = untrusted
        return web.json_response(body, status=200 if ready else 503, dumps=_dumps)

    async def metrics(self, request: web.Request) -> web.Response:
        # Prometheus asks for OpenMetrics first: the format that carries exemplars (trace ids).
        om = "application/openmetrics-text" in request.headers.get("Accept", "")
        if self.pages is not None:
            return web.Response(body=await self.pages.page(), headers={"Content-Type": CONTENT_TYPE})
        body = await asyncio.to_thread(self.exposition.render, om) if len(self.handlers) > 64 \
            else self.exposition.render(om)
        return web.Response(body=body,
                            headers={"Content-Type": OPENMETRICS_CONTENT_TYPE if om else CONTENT_TYPE})

    async def admin_fleets(self, request: web.Request) -> web.Response:
        check_admin(request, self.cfg.http.admin_api_key)  # a refusal is answered by errors_as_json
        return web.json_response(self.fleets_status(), dumps=_dumps)

    def fleets_status(self) -> dict[str, Any]:
        """Fleets → instances (``Instance.status()``) plus admission stats: ``GET /admin/fleets``."""
        now = self.clock()
        out: dict[str, Any] = {}
        configured = {f.name: f for f in self.cfg.fleets}
        for name in sorted(set(configured) | set(self.registry.fleets())):
            f = configured.get(name)
            instances = []
            for inst in sorted(self.registry.instances(name), key=lambda i: i.id):
                row = inst.status(now)
                if self.adapter_slots is not None and self.adapter_slots.catalog.slots.get(name):
                    row["adapters"] = self.adapter_slots.status(inst)
                instances.append(row)
            out[name] = {
                "model": f.model if f else None,
                "engine": f.engine if f else None,
                "replicas": _replicas(f, self.desired_replicas),
                "ready": sum(1 for i in self.registry.instances(name) if i.state is InstanceState.READY),
                "instances": instances,
                "admission": self.admission.stats(name),
                "autoscale": self.elastic.status(name) if self.elastic is not None else None,
                "served": self.serves(name),
            }
        status: dict[str, Any] = {"fleets": out, "policy": self.router.policy.name}
        if self.orphaned is not None:
            status["orphaned"] = self.orphaned()
        if self.view_status is not None:
            status["view"] = self.view_status()
        if self.control is not None:
            status["control"] = self.control()
        if self.batch_status is not None:  # batches (issue 31)
            status["batches"] = self.batch_status()
        return status


def _replicas(fleet: FleetConfig | None, desired: Callable[[FleetConfig], int] | None) -> int | None:
    """What ``/admin/fleets`` reports: a static fleet has one instance per URL (``replicas`` is not
    read for it); a launched one has the run-time count, else the configured one."""
    if fleet is None:
        return None
    if fleet.engine == "static":
        return len(fleet.urls)
    return desired(fleet) if desired is not None else fleet.replicas


_FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")


def _json_content_type(content_type: str) -> str:
    """What a JSON route's engine is sent: JSON. A body the client says is a form is refused (415);
    any other label (none, text/plain, octet-stream) is read as JSON and checked as such."""
    media = content_type.partition(";")[0].strip().lower()
    if media in _FORMS:
        raise UnsupportedMediaType(f"this route takes a JSON body (Content-Type: application/json), not "
                                   f"{media}")
    return "application/json"


def _session(request: web.Request) -> str | None:
    """The client's ``X-Session-Id`` (its first 256 characters), or None: routing then falls back to
    the body's ``user``."""
    sid = request.headers.get("X-Session-Id")
    return sid[:256] if sid else None


def _shed_reason(request: web.Request) -> str:
    """Why routerd itself cut this request's connection (a client timeout), or ``""``."""
    conn = request.protocol
    return conn.close_reason if isinstance(conn, ClientConnection) else ""


async def _stamp_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every response carries the request's id (the client's when sane, else routerd's)."""
    response.headers["X-Request-Id"] = client_request_id(request)


def _dumps(obj: Any) -> str:
    return msgspec.json.encode(obj).decode()
