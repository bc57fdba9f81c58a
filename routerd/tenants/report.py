"""``routerd usage [--tenant T] [--fleet F] [--days N] [--json]``: the per-day usage stored in Redis.

Reads what every routerd on that Redis wrote (:mod:`routerd.tenants.usage`): requests served, failed
and refused by a rate limit, and the prompt and completion tokens the engines reported, per UTC day,
tenant, fleet and LoRA adapter (``adapter``: empty for the fleet's own model), with the totals over
the days shown.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

import msgspec

from .. import redact
from .._table import print_table
from ..redis_keys import RedisKeys
from ..redis_server import RedisTarget, redis_target
from .usage import COUNTERS, day_of, read_days

_COLUMNS = ["day", "tenant", "fleet", "adapter", *COUNTERS, "total_tokens"]
_MAX_DAYS = 3660  # ten years of per-day counters


def _days(n: int, now: float) -> list[str]:
    return sorted({day_of(now - i * 86_400) for i in range(n)})


async def _read(target: RedisTarget, days: list[str]) -> list[dict[str, Any]]:
    from ..redis_conn import RedisConn

    client: Any = RedisConn(target.url, target.redis, pooled=False).ops()  # password and TLS as the daemon's
    try:
        return await read_days(client, RedisKeys.from_config(target.redis), days)
    finally:
        await client.aclose()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="routerd usage", description="Usage per tenant, fleet and LoRA adapter "
                                "(requests, tokens the engines reported) per UTC day, from routerd's Redis.")
    p.add_argument("--redis", default=os.environ.get("ROUTERD_REDIS_URL", ""),
                   help="Redis URL (default: $ROUTERD_REDIS_URL, else the config's, else localhost)")
    p.add_argument("--config", help="read the Redis URL, password and stream namespace from this config")
    p.add_argument("--tenant", help="only this tenant")
    p.add_argument("--fleet", help="only this fleet")
    p.add_argument("--adapter", help="only this LoRA adapter")
    p.add_argument("--days", type=int, default=7, help="the last N UTC days, today included (default 7)")
    p.add_argument("--json", action="store_true", help="print JSON: {days, rows, totals}")
    args = p.parse_args(argv)
    redact.warn_argv_url(p.prog, args.redis)
    if not 1 <= args.days <= _MAX_DAYS:  # a day is a key to read: a huge N would only hang
        p.error(f"--days must be 1..{_MAX_DAYS}")
    from ..config import EXIT_CONFIG, ConfigError

    try:
        target = redis_target(args.redis, args.config)
    except ConfigError as e:
        print("\n".join(["routerd usage: the config is not valid:", *e.problems]), file=sys.stderr)
        return EXIT_CONFIG
    days = _days(args.days, time.time())
    import redis.exceptions

    try:
        rows = asyncio.run(_read(target, days))
    except (redis.exceptions.RedisError, OSError, TimeoutError) as e:
        print(f"routerd usage: cannot read Redis at {redact.url(target.url)}: {e}", file=sys.stderr)
        return 1
    rows = [r for r in rows if (not args.tenant or r["tenant"] == args.tenant)
            and (not args.fleet or r["fleet"] == args.fleet)
            and (not args.adapter or r["adapter"] == args.adapter)]
    totals = {c: sum(r[c] for r in rows) for c in [*COUNTERS, "total_tokens"]}
    if args.json:
        print(msgspec.json.encode({"days": days, "rows": rows, "totals": totals}).decode())
        return 0
    print_table(f"usage {days[0]} .. {days[-1]} (UTC)", _COLUMNS,
                [[r[c] for c in _COLUMNS] for r in rows] + [["total", "", "", "", *totals.values()]])
    return 0
