"""``routerd submit``: one request onto routerd's Redis queue through the producers' client
(:mod:`routerd.client`), and its result when asked to wait — traced as a producer span when tracing is
on, so the job's trace starts here."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import TYPE_CHECKING, Any

from .client import QueueClient
from .queue_wire import ResultView, json_encode
from .redact import warn_argv_url

if TYPE_CHECKING:
    from .redis_server import RedisTarget


def submit_main(argv: list[str]) -> int:
    """``routerd submit [--redis URL] [--model M] [--wait] PROMPT``."""
    p = argparse.ArgumentParser(prog="routerd submit", description="Enqueue one request on routerd's "
                                "Redis queue; print its id (or, with --wait, its result as JSON).")
    p.add_argument("prompt")
    p.add_argument("--redis", default=os.environ.get("ROUTERD_REDIS_URL", ""),
                   help="Redis URL (default: $ROUTERD_REDIS_URL, else the config's, else localhost)")
    p.add_argument("--config", help="read the Redis URL, stream and first model from this config")
    p.add_argument("--model", help="model name (default: the config's first fleet)")
    p.add_argument("--chat", action="store_true", help="send as /v1/chat/completions")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--deadline-ms", type=int, help="ms from now after which the job is not run")
    p.add_argument("--tenant", help="the job's tenant (a [[tenants]] name; default: default)")
    p.add_argument("--stream", action="store_true", help="stream: print chunks as they arrive")
    p.add_argument("--wait", action="store_true", help="wait for the result and print it")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--id-prefix", default=os.environ.get("ROUTERD_ID_PREFIX", ""),
                   help="begin the job id with this: the scope of a producer's Redis ACL (routerd "
                   "redis-acl --producer-prefix; default: $ROUTERD_ID_PREFIX)")
    args = p.parse_args(argv)
    warn_argv_url(p.prog, args.redis)
    from .config import EXIT_CONFIG, ConfigError

    try:
        target, model = _resolve(args)
    except ConfigError as e:
        print("\n".join(["routerd submit: the config is not valid:", *e.problems]), file=sys.stderr)
        return EXIT_CONFIG
    if not model:
        p.error("--model is required (or --config with a fleet)")
    return asyncio.run(_submit(args, target, model))


def _resolve(args: argparse.Namespace) -> tuple[RedisTarget, str | None]:
    from .redis_server import redis_target

    target = redis_target(args.redis, args.config)
    model = args.model or (target.cfg.fleets[0].model if target.cfg is not None and target.cfg.fleets
                           else None)
    return target, model


async def _submit(args: argparse.Namespace, target: RedisTarget, model: str) -> int:
    """The job inside a producer span of its own when tracing is on (``[tracing]`` of ``--config``, or
    the ``OTEL_*`` variables): the job's trace starts here and its id goes to stderr."""
    from .config import TracingConfig
    from .tracing import SpanKind, Tracing

    stream = target.redis.stream
    tracing = Tracing.from_config(target.cfg.tracing if target.cfg is not None else TracingConfig())
    try:
        with tracing.start("routerd.submit", SpanKind.PRODUCER, {
                "messaging.system": "redis", "messaging.operation.type": "send",
                "messaging.destination.name": stream}) as span:
            if span is not None:
                print(f"trace_id {span.trace_id:032x}", file=sys.stderr)
            code = await _submit_one(args, target, model)
            if code:
                tracing.failed(f"exit status {code}")
            return code
    finally:
        await tracing.aclose()


async def _submit_one(args: argparse.Namespace, target: RedisTarget, model: str) -> int:
    if args.chat:
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": args.prompt}]}
    else:
        body = {"model": model, "prompt": args.prompt}
    body["max_tokens"] = args.max_tokens
    if args.stream:
        body["stream"] = True
    redis_cfg = target.redis
    # As the daemon reaches Redis: user, password, TLS, and the sentinels of a config that has them.
    async with QueueClient.from_config(redis_cfg, target.url, id_prefix=args.id_prefix) as q:
        job = await q.submit(body, priority=args.priority, deadline_ms=args.deadline_ms, tenant=args.tenant)
        if not args.wait:
            print(job.id)
            return 0
        result: ResultView | None = None
        try:
            if args.stream:
                async for item in q.chunks(job, timeout=args.timeout):
                    if isinstance(item, ResultView):
                        result = item
                    else:
                        sys.stdout.write(json_encode(item.data).decode() + "\n")
            else:
                result = await q.wait(job, timeout=args.timeout)
        except TimeoutError:
            print(f"{job.id}: no result within {args.timeout}s", file=sys.stderr)
            return 1
        assert result is not None
        print(json_encode(result).decode())
        return 0 if result.status == "ok" else 1
