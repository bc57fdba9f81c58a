"""``routerd sim-engine``: an aiohttp server that looks like ``vllm serve`` (0.12+) from the outside.

:class:`SimEngine` is the in-process form tests use (``url = await eng.start()``; ``await eng.stop()``;
``eng.faults``; ``eng.stats``); :func:`main` runs the same thing as a process, which is what the sim
launcher starts inside a Ray actor. The server is embedded with ``AppRunner``/``TCPSite`` (never
``run_app``) so its lifecycle is ours: the engine task is owned and cancelled on stop, and in-flight
requests are aborted (counted ``finished_reason="abort"``) before the site closes.

Admin routes outside vLLM's surface live under ``/sim/``: ``GET|POST|DELETE /sim/faults`` and
``GET /sim/stats``. They keep answering while the engine "hangs", so a test can clear the hang.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import hmac
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any, Protocol

import msgspec
from aiohttp import web

from routerd import log
from routerd.errors import error_body, sse_error_event

from . import protocol as p
from . import wire
from .anthropic import AnthropicRoutes
from .audio import AudioRoutes
from .config import SimConfig
from .engine import BatchEngine, SeqState, Sequence, SimStats
from .faults import Faults, FaultUpdate
from .kv_publisher import KvEventPublisher, parse_config
from .lora import LoraRoutes, SimLora
from .metrics import SimMetrics
from .pooling import PoolingRoutes
from .responses import ResponsesRoutes
from .running import Prompt, Runner
from .tokens_api import TokenizeRoutes

SIM_KEY: web.AppKey[SimEngine] = web.AppKey("sim")
_fault_dec = msgspec.json.Decoder(FaultUpdate)
_MAX_BODY_BYTES = 256 * 1024 * 1024


_log = log.get("routerd.sim")


SSE_HEADERS = wire.SSE_HEADERS
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RouteFamily(Protocol):
    """A module's routes (pooling, tokenize, responses, …): what it adds to the app."""

    def routes(self) -> list[web.RouteDef]: ...

# vLLM's AuthenticationMiddleware (vllm/entrypoints/serve/middleware/authenticate.py): the paths an API
# key guards, by prefix as it matches them; everything else (/health, /metrics, /load, …) stays open.
GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
UNAUTHORIZED = b'{"error":"Unauthorized"}'


_json_response = wire.json_response
_event = wire.data_event


def _usage(req: p.GenRequest, completion_tokens: int) -> dict[str, Any] | None:
    """A chunk's usage with ``stream_options.continuous_usage_stats``, else None (no usage member)."""
    if not req.continuous_usage:
        return None
    return p.continuous_usage(req.chat, req.prompt_tokens, completion_tokens)


class SimEngine:
    """One simulated vLLM server: the batching engine, its metrics, its faults and its HTTP site.

    ``exit_on_crash`` makes the "crash" fault ``os._exit(1)`` the process (the CLI does this); in-process
    a crash instead drops the listening socket and every connection at once, which is what a router
    sees of a dead process, and sets the ``crashed`` event.

    Tests read ``url``/``port`` after :meth:`start`, change ``faults`` and read ``stats``.
    """

    def __init__(self, config: SimConfig, *, exit_on_crash: bool = False) -> None:
        if config.max_model_len > config.kv_capacity_tokens:
            # vLLM refuses to start when one max-length request cannot fit in the KV cache.
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the KV cache "
                             f"({config.num_gpu_blocks} blocks × {config.block_size} tokens)")
        self.config = config
        self._key_digests = [hashlib.sha256(k.encode()).digest() for k in config.api_key]
        self.faults = Faults(seed=config.seed, on_crash=self._crash)
        self.metrics = SimMetrics(config)
        self.engine = BatchEngine(config, self.faults, self.metrics)
        # LoRA adapters (routerd/sim/lora.py): the load/unload routes and /v1/models always know them;
        # only --enable-lora lets a load succeed and gives the scheduler its max_loras check
        self.lora = SimLora(config)
        if config.enable_lora:
            self.lora.bind_metrics(self.metrics.registry)
            self.engine.lora = self.lora
        # KV-cache events as vLLM publishes them; block keys then as vLLM computes them (seeded alike).
        kv_cfg = parse_config(config.kv_events_config)
        self.kv_events: KvEventPublisher | None = None
        if kv_cfg is not None and kv_cfg.enabled:
            self.kv_events = KvEventPublisher(kv_cfg, self.faults, form=config.kv_events_form)
            self.engine.kv_publish = self.kv_events.publish
        self.runner = Runner(config, self.engine, self.faults, kv_keys=self.kv_events is not None)
        # The route families beyond completions and chat, each in its module (README: "vLLM routes").
        self.responses = ResponsesRoutes(config, self.runner)
        generating: list[RouteFamily] = [self.responses, AnthropicRoutes(config, self.runner)]
        pooling: list[RouteFamily] = [PoolingRoutes(config, self.runner)]
        lora = LoraRoutes(self.lora, self.engine.utility,
                          lambda: (s.lora for s in self.engine.running if s.lora is not None))
        self.families: list[RouteFamily] = [TokenizeRoutes(config), lora]
        if config.runner in ("all", "generate"):
            self.families += generating
        if config.runner in ("all", "pooling"):
            self.families += pooling
        if config.runner == "all":
            self.families.append(AudioRoutes(config, self.runner))
        # How often it was watched: "/metrics" and "/health" requests answered, so a test can count
        # routerd's scrapes and heartbeats of this engine.
        self.watched: collections.Counter[str] = collections.Counter()
        # The W3C trace context of the last requests, as vLLM would continue it (GET /sim/stats): tests
        # check that routerd hands its span's context to the engine.
        self.traceparents: collections.deque[str] = collections.deque(maxlen=256)
        self.created = config.fixed_created or int(time.time())
        self.url = ""
        self.port = 0
        self._exit_on_crash = exit_on_crash
        self._runner: web.AppRunner | None = None
        self._engine_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.crashed = asyncio.Event()

    @property
    def server_load(self) -> int:
        """Generate and pooling requests in flight (``GET /load``)."""
        return self.runner.server_load

    @property
    def stats(self) -> SimStats:
        """running, waiting, completed, aborted, failed, preemptions, kv_cache_usage — right now."""
        return self.engine.stats

    def build_app(self) -> web.Application:
        # uvicorn sets no body limit; aiohttp's default 1 MiB would answer a long prompt 413 in plain text.
        # The key is checked first, as vLLM's middleware runs before its routes.
        auth = [self._authenticate] if self.config.api_key else []
        app = web.Application(middlewares=[*auth, self._hang_middleware, self._fastapi_errors],
                              client_max_size=_MAX_BODY_BYTES)
        app[SIM_KEY] = self
        r = app.router
        r.add_get("/health", self._health)
        r.add_route("*", "/ping", self._health)
        r.add_get("/v1/models", self._models)
        r.add_get("/version", self._version)
        r.add_get("/load", self._load)
        r.add_get("/metrics", self._metrics)
        r.add_get("/kv_event_sources", self._kv_event_sources)
        r.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        if self.config.runner != "pooling":
            r.add_post("/v1/completions", self._completions)
            r.add_post("/v1/chat/completions", self._chat)
        for family in self.families:
            r.add_routes(family.routes())
        r.add_get("/sim/faults", self._get_faults)
        r.add_post("/sim/faults", self._post_faults)
        r.add_delete("/sim/faults", self._delete_faults)
        r.add_get("/sim/stats", self._stats)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start the engine task and the HTTP site; return the base URL (``http://host:port``)."""
        if self._runner is not None:
            raise RuntimeError("SimEngine already started")
        if self.kv_events is not None:
            self.kv_events.start(host)
        self._engine_task = asyncio.create_task(self.engine.run(), name=f"sim-engine:{self.config.model}")
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the request.
        # keepalive_timeout: uvicorn's 5 s under vLLM, so routers meet the same idle-connection resets.
        runner = web.AppRunner(self.build_app(), handler_cancellation=True, access_log=None,
                               shutdown_timeout=2.0, keepalive_timeout=5.0)
        await runner.setup()
        self._runner = runner
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await self.stop()
            raise
        # aiohttp exposes the bound port (port=0 picks a free one) only through the asyncio server.
        sockets = getattr(site._server, "sockets", None)  # asyncio.Server or uvloop's Server
        if not sockets:
            await self.stop()
            raise RuntimeError(f"sim-engine: no listening socket on {host}:{port}")
        self.port = int(sockets[0].getsockname()[1])
        self.url = f"http://{host}:{self.port}"
        _log.info("sim_engine_started", url=self.url, model=self.config.model,
                  max_num_seqs=self.config.max_num_seqs)
        return self.url

    async def stop(self) -> None:
        """Graceful stop: refuse new work, abort in-flight requests, close the site, end the engine."""
        self.runner.stopping = True
        self.faults.clear()  # a hung engine must not hold up its own shutdown
        self.engine.abort_all()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        await self._cancel_engine()
        if self.kv_events is not None:
            await self.kv_events.stop()
        for task in list(self._tasks):
            if task is not asyncio.current_task():
                task.cancel()
        await asyncio.gather(*(t for t in self._tasks if t is not asyncio.current_task()),
                             return_exceptions=True)

    async def _cancel_engine(self) -> None:
        if self._engine_task is not None:
            task, self._engine_task = self._engine_task, None
            task.cancel()
            # wait() does not re-raise the task's CancelledError, but does raise ours if stop() is cancelled.
            await asyncio.wait([task])

    def _crash(self) -> None:
        """The "crash" fault. In-process: close the listener and reset every connection right now
        (synchronously, so the next connect is refused), then tidy up in a task; ``crashed`` is set."""
        if self._exit_on_crash:
            os._exit(1)
        runner = self._runner
        if runner is not None:
            for site in list(runner.sites):
                srv = site._server
                if srv is not None:
                    srv.close()
            if runner.server is not None:
                for conn in list(runner.server.connections):
                    if conn.transport is not None:
                        conn.transport.abort()
        self.crashed.set()
        task = asyncio.get_running_loop().create_task(self.stop(), name="sim-crash-cleanup")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- middlewares ----------------------------------------------------------------------------

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # As vLLM: OPTIONS and the paths outside GUARDED_PREFIX pass; a guarded one needs
        # "Authorization: Bearer <one of the keys>" (scheme case-insensitive), else 401 with a flat body.
        if request.method != "OPTIONS" and request.path.startswith(GUARDED_PREFIX) \
                and not self._token_ok(request.headers.get("Authorization", "")):
            return web.Response(status=401, body=UNAUTHORIZED, content_type="application/json")
        return await handler(request)

    def _token_ok(self, value: str) -> bool:
        scheme, _, token = value.partition(" ")
        if not value or scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        ok = False
        for key in self._key_digests:  # every key compared, in constant time, as vLLM does
            ok |= hmac.compare_digest(digest, key)
        return ok

    @web.middleware
    async def _hang_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # A hung engine accepts connections and reads requests but never answers; /sim/ stays live.
        if not request.path.startswith("/sim/"):
            await self.faults.wait_unhung()
            # what vLLM would continue its trace from, on every inference route (GET /sim/stats)
            if request.method == "POST" and (traceparent := request.headers.get("traceparent")):
                self.traceparents.append(traceparent)
        return await handler(request)

    @web.middleware
    async def _fastapi_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # vLLM runs on FastAPI: unknown routes and wrong methods answer {"detail": ...}.
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return _json_response({"detail": "Not Found"}, 404)
        except web.HTTPMethodNotAllowed:
            return _json_response({"detail": "Method Not Allowed"}, 405)

    # ---- vLLM routes ----------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        self.watched[request.path] += 1
        return web.Response(status=503 if self.faults.unhealthy else 200)

    async def _models(self, request: web.Request) -> web.Response:
        body = p.models_body(self.config, self.created)
        body["data"].extend(self.lora.model_cards(self.created, body["data"][0]["permission"][0]))
        return _json_response(body)

    async def _version(self, request: web.Request) -> web.Response:
        return _json_response({"version": self.config.version})

    async def _load(self, request: web.Request) -> web.Response:
        return _json_response({"server_load": self.server_load})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.watched["/metrics"] += 1
        resp = web.Response(body=self.metrics.exposition())
        resp.headers["Content-Type"] = self.metrics.content_type
        return resp

    async def _kv_event_sources(self, request: web.Request) -> web.Response:
        return _json_response(self.kv_events.sources() if self.kv_events is not None else {})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.engine.reset_prefix_cache()
        return web.Response(status=200)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await wire.read_json(request)
            adapter = self.lora.resolve(body.get("model") if isinstance(body, dict) else None)
            # An adapter's request is answered under the adapter's name, as vLLM's model_name(lora_request)
            cfg = self.config if adapter is None else msgspec.structs.replace(self.config, model=adapter.name)
            req = p.parse_request(body, cfg, chat=chat)
        except wire.Unparsable:
            return wire.unparsable()
        except p.RequestError as e:
            return self._error(e)
        if self.runner.refuses(req.key):
            return wire.internal_error()
        seq = self.runner.generation(Prompt(req.words, req.prompt_tokens, req.key), req.max_tokens,
                                     stop=req.stop, ignore_eos=req.ignore_eos, lora=adapter)
        async with self.runner.running(seq):
            if req.stream:
                return await self._stream(request, req, seq)
            if not await self.runner.finish(seq):
                return wire.internal_error()
            build = p.chat_body if chat else p.completion_body
            return _json_response(build(p.new_id(chat), int(time.time()), cfg, "".join(seq.pieces),
                                        seq.finish_reason, seq.stop_reason, req.prompt_tokens, seq.generated))

    async def _stream(self, request: web.Request, req: p.GenRequest, seq: Sequence) -> web.StreamResponse:
        cfg, chat = self.config, req.chat
        rid, created = p.new_id(chat), int(time.time())
        # Headers go at once, as uvicorn sends them under vLLM; not one body byte before the first token:
        # vLLM builds chat's role chunk on the first engine output, after queueing and prefill, so a
        # client that times the first SSE event measures time to first token here as it would there.
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        sent = 0
        last_idx = seq.num_tokens - 1
        async for idx in seq.stream():
            if chat and sent == 0:
                await resp.write(_event(p.chat_role_chunk(rid, created, cfg, usage=_usage(req, 0))))
                sent = 1
            if self.runner.breaks_stream(sent, seq):
                await resp.write(sse_error_event("The server had an error while processing your request."))
                await resp.write_eof()
                return resp
            last = idx == last_idx
            finish = seq.finish_reason if last else None
            stop_reason = seq.stop_reason if last else None
            tail = last and not req.include_usage
            build = p.chat_chunk if chat else p.completion_chunk
            await resp.write(_event(build(rid, created, cfg, seq.pieces[idx], finish, stop_reason,
                                          last_without_usage=tail, usage=_usage(req, idx + 1))))
            sent += 1
        if seq.state is not SeqState.FINISHED:  # the engine dropped it (server stopping)
            await resp.write(sse_error_event("The server had an error while processing your request."))
            await resp.write_eof()
            return resp
        if req.include_usage:
            await resp.write(_event(p.usage_chunk(rid, created, cfg, chat, req.prompt_tokens, seq.generated,
                                                  seq.cached_tokens)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _error(self, e: p.RequestError) -> web.Response:
        return _json_response(e.body, e.status)

    # ---- /sim admin -----------------------------------------------------------------------------

    async def _get_faults(self, request: web.Request) -> web.Response:
        return _json_response(self.faults.snapshot())

    async def _post_faults(self, request: web.Request) -> web.Response:
        try:
            update = _fault_dec.decode(await request.read())
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
            return _json_response(error_body(str(e)[:200], "BadRequestError", 400), 400)
        _log.warning("sim_faults_set", **{k: v for k, v in msgspec.structs.asdict(update).items()
                                          if v is not msgspec.UNSET})
        self.faults.apply(update)
        return _json_response(self.faults.snapshot())

    async def _delete_faults(self, request: web.Request) -> web.Response:
        self.faults.clear()
        _log.info("sim_faults_cleared")
        return _json_response(self.faults.snapshot())

    async def _stats(self, request: web.Request) -> web.Response:
        return _json_response({**asdict(self.stats), "server_load": self.server_load,
                               "metrics_requests": self.watched["/metrics"],
                               "traceparents": list(self.traceparents)})


# ---- the process ----------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="routerd sim-engine",
                                 description="A simulated vLLM server (OpenAI API, /metrics, faults).")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", "--served-model-name", dest="model", required=True)
    ap.add_argument("--log-level", default="info")
    # As vLLM's: repeatable, else $VLLM_API_KEY (main). The environment is the way to keep it off the
    # process list, which every user of the node can read.
    ap.add_argument("--api-key", dest="api_key", action="append", default=[],
                    help="require 'Authorization: Bearer KEY' on /v1, /v2, /inference, /cohere")
    for f in msgspec.structs.fields(SimConfig):
        if f.name in ("model", "api_key"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            ap.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            ap.add_argument(flag, dest=f.name, type=_flag_type(f.type), default=f.default)
    return ap


def _flag_type(t: Any) -> Callable[[str], Any]:
    # Annotated[int, Meta] → int; the Meta bounds are checked when the SimConfig is built.
    base = getattr(t, "__origin__", t)
    return base if base in (int, float, str) else str


async def _serve(cfg: SimConfig, host: str, port: int) -> int:
    sim = SimEngine(cfg, exit_on_crash=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    # Signals for faults where no HTTP is possible (a test holding only the pid).
    loop.add_signal_handler(signal.SIGUSR1, lambda: sim.faults.set(hang=True))
    loop.add_signal_handler(signal.SIGUSR2, sim.faults.clear)
    await sim.start(host, port)
    try:
        await stop.wait()
    finally:
        _log.info("sim_engine_stopping", url=sim.url)
        await sim.stop()
    return 0


def main(argv: list[str]) -> int:
    """``routerd sim-engine --port P --model NAME [...]``; runs until SIGTERM/SIGINT."""
    args = vars(_parser().parse_args(argv))
    host, port, level = args.pop("host"), args.pop("port"), args.pop("log_level")
    if not args["api_key"] and os.environ.get("VLLM_API_KEY"):  # --api-key wins, as in vLLM
        args["api_key"] = [os.environ["VLLM_API_KEY"]]
    try:
        cfg = msgspec.convert(args, SimConfig)
        parse_config(cfg.kv_events_config)
        if cfg.max_model_len > cfg.kv_capacity_tokens:
            raise msgspec.ValidationError("max_model_len exceeds num_gpu_blocks × block_size")
    except msgspec.ValidationError as e:
        print(f"routerd sim-engine: {e}", file=sys.stderr)
        return 2
    log.setup(level)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_serve(cfg, host, port))
    return int(uvloop.run(_serve(cfg, host, port)))
