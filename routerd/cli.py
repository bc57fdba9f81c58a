"""The ``routerd`` command: one sub-command per job, each importing only what it needs.

Heavy imports (ray, redis) stay inside the sub-command so ``routerd check-config`` and
``routerd sim-engine`` start fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from . import __version__

Handler = Callable[[list[str]], int]


def _run(argv: list[str]) -> int:
    from .daemon import main as daemon_main

    return daemon_main(argv)


def _check_config(argv: list[str]) -> int:
    from . import config, plugins

    parser = argparse.ArgumentParser(prog="routerd check-config",
                                     description="Validate a config file; exit 0 valid, 78 invalid.")
    parser.add_argument("file")
    args = parser.parse_args(argv)
    try:
        cfg = config.load(args.file)
        problems = plugins.check(cfg)
    except config.ConfigError as e:
        problems = e.problems
    if problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        print(f"{args.file}: {len(problems)} problem(s)", file=sys.stderr)
        return config.EXIT_CONFIG
    print(f"{args.file}: ok ({len(cfg.fleets)} fleet(s))")
    return 0


def _sim_engine(argv: list[str]) -> int:
    from .sim.server import main as sim_main

    return sim_main(argv)


def _status(argv: list[str]) -> int:
    from .status import main as status_main

    return status_main(argv)


def _submit(argv: list[str]) -> int:
    from .submit import submit_main

    return submit_main(argv)


def _usage(argv: list[str]) -> int:
    from .tenants.report import main as usage_main

    return usage_main(argv)


def _redis_acl(argv: list[str]) -> int:
    from .redis_acl import main as acl_main

    return acl_main(argv)


def _bench(argv: list[str]) -> int:
    """The benchmarks are a package of their own (``routerd_bench``), shipped beside routerd but not part
    of it: nothing else in routerd imports them, so a missing harness only costs this command."""
    try:
        from routerd_bench import main as bench_main
    except ImportError as e:
        if e.name != "routerd_bench":
            raise
        print("routerd bench: the benchmark package routerd_bench is not installed "
              "(install routerd from its source tree: pip install -e '.[bench]')", file=sys.stderr)
        return 2
    return bench_main(argv)


COMMANDS: dict[str, tuple[Handler, str]] = {
    "run": (_run, "run the daemon (foreground; systemd runs this)"),
    "check-config": (_check_config, "validate a config file; exit 0 valid, 78 invalid"),
    "status": (_status, "fleets and instances from a running daemon's admin API"),
    "submit": (_submit, "enqueue one request on the Redis queue (and wait for its result)"),
    "usage": (_usage, "usage per tenant and fleet per day (requests, tokens), from Redis"),
    "redis-acl": (_redis_acl, "Redis ACL rules for routerd's own user and a queue producer"),
    "sim-engine": (_sim_engine, "the vLLM-compatible simulated engine"),
    "bench": (_bench, "benchmarks: overhead, routing, queue, failover, autoscale, fairness, scale, batch, "
                       "lora"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(f"usage: routerd {{{','.join(COMMANDS)}}} ...\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<14} {text}")
        return 0 if args else 2
    if args[0] in {"-V", "--version"}:
        print(f"routerd {__version__}")
        return 0
    cmd = COMMANDS.get(args[0])
    if cmd is None:
        print(f"routerd: unknown command {args[0]!r} (one of: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    return cmd[0](args[1:])
