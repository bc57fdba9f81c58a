"""``routerd status [--url URL] [--json] [--admin-key-file FILE]``: fleets and instances of a running daemon.

Reads ``GET /admin/fleets`` and prints one line per instance — state, circuit (closed, open, half_open),
URL, PID, node, generation, last heartbeat, expected wait, what routing learned of it (capacity and its
source, decode and prefill speed, prefix-cache hit ratio as the engine reports it / as routerd predicted
it), restarts and the engine's resource use — so an operator sees a crash loop (restarts climbing, the
reason column), an instance the breaker keeps out, a slow or small instance, or an unplaceable instance
without reading logs.

The admin key never needs the command line, where every user of the machine can read it (``ps``): it
comes from ``--admin-key-file``, ``$ROUTERD_ADMIN_KEY``, the daemon's own ``$ROUTERD_HTTP_ADMIN_API_KEY``
or ``--config``'s ``http.admin_api_key``. ``--admin-key KEY`` still works, with a warning.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import sys
import time
from typing import Any

import aiohttp

from . import redact

EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: the daemon did not answer
EXIT_CONFIG = 78  # EX_CONFIG: an unreadable key file or config


async def fetch(url: str, admin_key: str, timeout_s: float, *, tls: ssl.SSLContext | bool = True,
                ) -> dict[str, Any]:
    """``GET /admin/fleets``; ``tls``: how an https daemon is verified (True: the system's CAs)."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session, \
            session.get(url.rstrip("/") + "/admin/fleets", headers=headers, ssl=tls) as resp:
        body: dict[str, Any] = await resp.json(content_type=None)
        if resp.status != 200:
            msg = body.get("error", {}).get("message", body) if isinstance(body, dict) else body
            raise RuntimeError(f"HTTP {resp.status}: {msg}")
        return body


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return "-"


def _age(ts: float | None, now: float) -> str:
    return "-" if not ts else f"{max(0.0, now - ts):.1f}s ago"


def _seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


def _rate(v: float | None) -> str:
    """Tokens per second, short: ``87/s``, ``12.4k/s``; ``-`` until learned."""
    if v is None:
        return "-"
    return f"{v / 1000:.1f}k/s" if v >= 10_000 else f"{v:.0f}/s"


def _capacity(i: dict[str, Any]) -> str:
    """``8 learned``: the capacity routing uses and where it came from (launch, engine, learned, config)."""
    cap = i.get("capacity")
    return "-" if cap is None else f"{cap} {i.get('capacity_source') or ''}".rstrip()


def _hit(i: dict[str, Any]) -> str:
    """Prefix-cache hit ratio, the engine's then routerd's prediction: ``0.62/0.60`` (``0.62/~0.60``:
    predicted over prompt sizes estimated from bytes, a fleet routerd does not key)."""
    engine, predicted = i.get("prefix_hit_ratio"), i.get("predicted_prefix_hit_ratio")
    estimated = i.get("estimated_prefix_hit_ratio")
    if predicted is None and estimated is not None:
        return ("-" if engine is None else f"{engine:.2f}") + f"/~{estimated:.2f}"
    if engine is None and predicted is None:
        return "-"
    return "/".join("-" if v is None else f"{v:.2f}" for v in (engine, predicted))


def _view(v: dict[str, Any] | None) -> str:
    """Where routing's picture of the cache comes from: ``events`` (``events:partial`` while history is
    missing; ``+N`` gaps replayed) or ``model`` (no events, or stale); ``-`` when not tracked."""
    if not v:
        return "-"
    if v.get("cache_view") != "events":
        return "model"
    ranks = v.get("event_ranks") or []
    out = "events" if all(r.get("health") == "complete" for r in ranks) else "events:partial"
    replayed = sum(r.get("gaps_replayed") or 0 for r in ranks)
    return f"{out}+{replayed}" if replayed else out


def _autoscale(a: dict[str, Any] | None, now: float) -> str:
    """The fleet line's autoscaling part: bounds, pin, what the signals show and the last decision."""
    if not a:
        return ""
    out = f" autoscale={a['min_replicas']}..{a['max_replicas']}"
    if a.get("pinned"):
        out += " PINNED (DELETE /admin/fleets/<fleet>/replicas resumes)"
    s = a.get("signals")
    if s:
        out += (f" demand={s['demand']:.1f} waiting={s['waiting']:.0f} wait={s['expected_wait_s']:.2f}s"
                f" kv={s['kv_usage']:.2f} recommended={a.get('recommended')}")
    if a.get("startup_s") is not None:
        out += f" startup={a['startup_s']:.1f}s"
    recent = a.get("recent") or []
    if recent:
        last = recent[-1]
        out += (f" last={last['from']}→{last['to']} ({last['reason']}, "
                f"{max(0.0, now - last['at']):.0f}s ago)")
    return out


def _view_line(v: dict[str, Any] | None) -> list[str]:
    """With several routerd on one Redis: whether this one controls, whose fleet state it follows, and
    loudly, a state gone stale or a fleet config that differs from the controller's."""
    if not v:
        return []
    if v.get("role") == "controller":
        line = f"view: {v.get('ident')} controls the fleets (publishing version {v.get('version')})"
    else:
        line = (f"view: {v.get('ident')} follows {v.get('controller') or 'no controller yet'} "
                f"(version {v.get('version')}, {v.get('age_s', 0):.1f}s old)")
    if v.get("stale"):
        line += " STALE: no controller publishes; routing on the last fleet state"
    if v.get("untrusted"):
        line += f" UNTRUSTED: {v['untrusted']}"
    if v.get("config_mismatch"):
        line += (f" CONFIG MISMATCH: fleet config {v.get('fingerprint')} here, "
                 f"{v.get('controller_fingerprint')} on the controller (the controller's fleets win)")
    return [line]
def _control(c: dict[str, Any], now: float) -> str:
    """Who controls the fleets (the control lease), as the routerd asked sees it."""
    holder = c.get("controller")
    this = f"this routerd: {c.get('this')}" + (" (controls)" if c.get("controls") else " (follows)")
    if not holder:
        return f"control: nobody yet; {this}"
    return (f"control: {holder.get('ident')} token={holder.get('token')} "
            f"since {_age(holder.get('since'), now)}; {this}")


def _adapters(instance: str, a: dict[str, Any]) -> str:
    """One instance's LoRA adapters: routerd's record beside the engine's vllm:lora_requests_info."""
    held = ",".join(a.get("held") or []) or "-"
    line = f"  {instance} adapters: held={held} ({len(a.get('held') or [])}/{a.get('slots', 0)})"
    if a.get("loading"):
        line += f" loading={','.join(a['loading'])}"
    e = a.get("engine")
    if e:
        line += (f"; engine: running={','.join(e.get('running') or []) or '-'} "
                 f"waiting={','.join(e.get('waiting') or []) or '-'} max_lora={e.get('max_lora')}")
    return line


def render(status: dict[str, Any], now: float | None = None) -> str:
    """The table: one block per fleet, one row per instance; the shared view's line first, if any."""
    now = time.time() if now is None else now
    cols = ["INSTANCE", "STATE", "CIRCUIT", "URL", "PID", "NODE", "GEN", "HEARTBEAT", "WAIT", "RUN/WAIT",
            "CAPACITY", "DECODE", "PREFILL", "HIT", "VIEW", "RESTARTS", "CPU%", "RSS", "GPU MEM", "REASON"]
    rows: list[list[str]] = []
    for name, fleet in status.get("fleets", {}).items():
        rows.append([f"[{name}] model={fleet.get('model')} engine={fleet.get('engine')} "
                     f"ready={fleet.get('ready')}/{fleet.get('replicas')}"
                     + _autoscale(fleet.get("autoscale"), now)])
        for i in fleet.get("instances", []):
            res = i.get("resources") or {}
            run_wait = "-" if i.get("running") is None else f"{i['running']:.0f}/{i.get('waiting') or 0:.0f}"
            rows.append([
                i.get("id", ""), i.get("state", ""), i.get("circuit") or "-", i.get("url") or "-",
                str(i.get("pid") or "-"), i.get("node") or "-", str(i.get("generation", "")),
                _age(i.get("last_heartbeat"), now), _seconds(i.get("expected_wait_s")), run_wait,
                _capacity(i), _rate(i.get("decode_tokens_per_s")), _rate(i.get("prefill_tokens_per_s")),
                _hit(i), _view(i.get("cache_view")), str(i.get("restarts", 0)),
                "-" if res.get("cpu_percent") is None else f"{res['cpu_percent']:.0f}",
                _bytes(res.get("rss_bytes")), _bytes(res.get("gpu_memory_bytes")),
                i.get("state_reason") or "",
            ])
            if i.get("adapters"):
                rows.append([_adapters(i["id"], i["adapters"])])
    widths = [max([len(c)] + [len(r[k]) for r in rows if len(r) == len(cols)]) for k, c in enumerate(cols)]
    control = status.get("control")
    lines = [_control(control, now)] if control else []
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip())
    for r in rows:
        lines.append(r[0] if len(r) == 1 else "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True))
                     .rstrip())
    for o in status.get("orphaned") or []:  # engines of fleets the controller's config lacks
        lines.append(f"orphaned: {o.get('id')} pid={o.get('pid') or '-'} url={o.get('url') or '-'} "
                     f"(fleet {o.get('fleet')!r} is not in the controller's config; running, not routed to; "
                     f"stop it with DELETE /admin/orphans/{o.get('id')})")
    return "\n".join(_view_line(status.get("view")) + lines + _batch_lines(status.get("batches")))


def _batch_lines(b: dict[str, Any] | None) -> list[str]:
    """The Batch API's part (issue 31): batches per state, then one line per batch not yet final."""
    if not b:
        return []
    states = " ".join(f"{k}={v}" for k, v in sorted(b.get("states", {}).items()) if v)
    out = [f"batches: {states or 'none'}; running here {b.get('running_here', 0)}, "
           f"{b.get('lines_per_s_here', 0)} lines/s"]
    for x in b.get("active", []):
        out.append(f"  {x['id']} tenant={x['tenant']} {x['status']} {x['completed']}/{x['total']} done "
                   f"{x['failed']} failed" + (" (runs here)" if x.get("here") else ""))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="routerd status", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("ROUTERD_URL", ""),
                        help="the daemon (default: $ROUTERD_URL, else --config's http.host/port, else "
                        "http://127.0.0.1:8080)")
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    parser.add_argument("--config", help="the daemon's config: its admin key and listener")
    parser.add_argument("--admin-key-file", metavar="FILE", help="read the admin key from FILE")
    parser.add_argument("--admin-key", help=argparse.SUPPRESS)  # visible in ps: kept, with a warning
    parser.add_argument("--cacert", metavar="FILE", help="CA certificate(s) to verify an https daemon by")
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.admin_key is not None:
        redact.warn_argv(parser.prog, "--admin-key", "use $ROUTERD_ADMIN_KEY or --admin-key-file")
    try:
        url, key = _target(args)
        tls: ssl.SSLContext | bool = ssl.create_default_context(cafile=args.cacert) if args.cacert else True
    except (OSError, ValueError) as e:
        print(f"routerd status: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        status = _redacted(asyncio.run(fetch(url, key, args.timeout, tls=tls)))
    except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as e:
        print(redact.text(f"routerd status: {url}: {e or type(e).__name__}"), file=sys.stderr)
        return EXIT_UNAVAILABLE
    print(json.dumps(status, indent=2, sort_keys=True) if args.json else render(status))
    return 0


def _target(args: argparse.Namespace) -> tuple[str, str]:
    """The daemon's URL and the admin key, first found: ``--admin-key-file``, ``--admin-key``,
    ``$ROUTERD_ADMIN_KEY``, ``$ROUTERD_HTTP_ADMIN_API_KEY``, ``--config``'s (which that variable
    overrides too). Raises OSError (an unreadable file) or ValueError (an invalid config)."""
    key = ""
    if args.admin_key_file:
        with open(args.admin_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
        if not key:
            raise ValueError(f"{args.admin_key_file}: no key on its first line")
    key = key or args.admin_key or os.environ.get("ROUTERD_ADMIN_KEY", "")
    key = key or os.environ.get("ROUTERD_HTTP_ADMIN_API_KEY", "")
    url = args.url
    if args.config:
        from .config import ConfigError, load_for_tool

        try:
            http = load_for_tool(args.config).http
        except ConfigError as e:
            raise ValueError("\n".join([f"{args.config} is not valid:", *e.problems])) from None
        key = key or http.admin_api_key
        if not url:
            host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(http.host, http.host)
            host = f"[{host}]" if ":" in host else host
            url = f"{'https' if http.tls_cert else 'http'}://{host}:{http.port}"
    return url or "http://127.0.0.1:8080", key


def _redacted(status: dict[str, Any]) -> dict[str, Any]:
    """Engine URLs without their passwords, whatever the daemon's version sent (older ones did not
    redact them)."""
    for fleet in status.get("fleets", {}).values():
        for inst in fleet.get("instances", []) if isinstance(fleet, dict) else []:
            if isinstance(inst, dict) and isinstance(inst.get("url"), str):
                inst["url"] = redact.url(inst["url"])
    return status
