"""Least-privilege Redis users for one deployment: the ACL rules ``routerd redis-acl`` prints.

Two users. **routerd's own** may use routerd's namespace (every key of :mod:`routerd.redis_keys`, the request
and dead-letter streams, the pub/sub channels) with exactly the commands routerd sends, its Lua scripts'
commands included (Redis checks those against the caller's ACL too). **A producer** may ``XADD`` to the
request stream and use the keys of its own jobs, nothing else: "its own" is a job-id prefix. Every
per-job key is ``<ns>:<family>:<job id>`` (:class:`~routerd.redis_keys.RedisKeys`), so a producer whose client
starts every job id with ``acme-`` (:class:`routerd.client.QueueClient` ``id_prefix``, ``routerd submit
--id-prefix``) touches only ``<ns>:reply:acme-*`` (its reply streams: read, delete), ``<ns>:done:acme-*``
(its results: read), ``<ns>:job:acme-*`` (the "queued" mark) and ``<ns>:cancel:acme-*``, and may publish
on the cancel channel (routerd acts on a job id published there only if that job's cancel key exists,
so one producer cannot cancel another's job).

What an ACL cannot say: ``XADD`` takes ``MAXLEN``, so a producer can trim the request stream and drop
jobs queued but not yet read. Producers that must not be able to do that to each other need
deployments of their own (another ``redis.stream``).
"""

from __future__ import annotations

import hashlib
import re

from .config import RedisConfig
from .redis_keys import RedisKeys

# What routerd sends, by where it is sent from (grep routerd/ for the client calls, and the Lua scripts
# in ingress/queue/results.py, tenants/ratelimit.py, peers/lease.py and peers/fleet_state.py). A command
# added to routerd must be added here: tests/test_redis_acl.py runs routerd under these rules.
ROUTERD_COMMANDS: tuple[str, ...] = (
    # a URL's database (/N), the queue writer's barrier, Lua's clock. Not CLIENT SETINFO (Redis 7.2+),
    # which redis-py sends on connect and does without when refused.
    "select", "ping", "time",
    # the queue: consumer group, reads, reclaims, results, dead letters (ingress/queue/)
    "xgroup|create", "xreadgroup", "xautoclaim", "xclaim", "xpending", "xack", "xdel", "xlen", "xadd",
    "type", "exists", "lrange", "rpush",
    # admin relay (peers/admin_relay.py): calls stream, claims, answers
    "xread", "blpop",
    # strings: done records, cursors, lease, sessions, load records, fencing tokens
    "get", "set", "mget", "del", "incr",
    # hashes: job status, rate-limit buckets, usage, fleet state, replicas, scrapes
    "hset", "hget", "hmget", "hgetall", "hdel", "hkeys", "hincrby",
    "expire", "pexpire", "pttl",
    # the process set (peers/load.py)
    "sadd", "srem", "smembers",
    # the cancel and fleet-state channels
    "publish", "subscribe", "unsubscribe",
    # the Lua scripts (redis-py's Script: EVALSHA, then SCRIPT LOAD on NOSCRIPT; the queue writer's
    # SCRIPT LOAD once per Redis start)
    "evalsha", "script|load",
    # the control lease (peers/lease.py): its scripts in a pipeline (EVAL: no more than EVALSHA after
    # SCRIPT LOAD allows), between ROLE (are replicas connected?) and WAIT (has one the lease?)
    "eval", "role", "wait",
    # the admin relay's answer (RPUSH + PEXPIRE) in one transaction
    "multi", "exec", "discard",
    # batches (routerd/batches/): files' pieces, tenants' lists, the written-lines bitmap, the output's
    # appends (its Lua scripts too)
    "zadd", "zrem", "zrevrank", "zrevrange", "persist", "unlink", "hlen", "getbit", "setbit", "append",
    "strlen",
    # stored responses and conversations (conversations/store.py): each tenant's index by last use,
    # a conversation's items
    "zremrangebyscore", "zcard", "zpopmin", "llen", "lrem",
)

# What routerd.client.QueueClient sends: submit (HSETNX + EXPIRE + XADD in MULTI), wait (XREAD, GET,
# MGET), status (GET, HGETALL), cancel (SET + PUBLISH in MULTI), and DEL for a producer cleaning up;
# WAIT for submit(durable=True).
PRODUCER_COMMANDS: tuple[str, ...] = (
    "select", "ping", "xadd", "xread", "get", "mget", "hsetnx", "hgetall", "expire", "set",
    "del", "publish", "multi", "exec", "discard", "wait",
)

def _cluster(keys: RedisKeys) -> tuple[str, ...]:
    """On a Redis Cluster (``[redis] cluster``: the names under a hash tag) every client asks a node
    which master serves the deployment's slot (routerd/redis_cluster.py)."""
    return ("cluster|slots",) if keys.tagged else ()


_GLOB = re.compile(r"([*?\[\]\\])")
_NAME = re.compile(r"^[A-Za-z0-9_.@+-]{1,64}$")


def glob_escape(name: str) -> str:
    """``name`` as a literal in an ACL key or channel pattern."""
    return _GLOB.sub(r"\\\1", name)


def _checked(what: str, value: str) -> str:
    if not value or any(c.isspace() for c in value):
        raise ValueError(f"{what} {value!r}: empty or holds white space, which an ACL rule cannot")
    return value


def routerd_rules(keys: RedisKeys, reply_patterns: tuple[str, ...] = ()) -> list[str]:
    """Rules (after ``user NAME``) for routerd's own user."""
    ns = glob_escape(_checked("the namespace", keys.ns))
    rules = ["resetchannels", "-@all", *(f"+{c}" for c in ROUTERD_COMMANDS + _cluster(keys)), f"~{ns}:*"]
    for name in dict.fromkeys((keys.stream, keys.dead)):
        if not name.startswith(f"{keys.ns}:"):
            rules.append(f"~{glob_escape(_checked('the stream', name))}")
    rules += [f"~{_checked('a reply pattern', p)}" for p in reply_patterns]
    rules.append(f"&{ns}:*")
    return rules


def producer_rules(keys: RedisKeys, prefix: str, reply_patterns: tuple[str, ...] = ()) -> list[str]:
    """Rules (after ``user NAME``) for a producer whose job ids start with ``prefix``."""
    own = glob_escape(_checked("the producer prefix", prefix)) + "*"
    ns = glob_escape(keys.ns)
    probe = keys.reply(prefix)
    if keys.reserved(probe) is not None:  # pragma: no cover - the client family is never reserved
        raise ValueError(f"{probe!r} is routerd's own key")
    return ["resetchannels", "-@all", *(f"+{c}" for c in PRODUCER_COMMANDS + _cluster(keys)),
            f"%W~{glob_escape(keys.stream)}",
            f"~{ns}:reply:{own}", f"%R~{ns}:done:{own}", f"~{ns}:job:{own}", f"%W~{ns}:cancel:{own}",
            *(f"~{_checked('a reply pattern', p)}" for p in reply_patterns),
            f"&{glob_escape(keys.cancel_channel)}"]


def _line(user: str, rules: list[str], password: str) -> str:
    """``user NAME reset on [#sha256] <rules>``: the password rule holds the SHA-256 of ``password``
    (never the password itself); none without one."""
    head = ["reset", "on"]
    if password:
        head.append(f"#{hashlib.sha256(password.encode()).hexdigest()}")
    return " ".join(["user", user, *head, *rules])


def acl_file(cfg: RedisConfig, *, routerd_user: str, producer_user: str, producer_prefix: str,
             reply_patterns: tuple[str, ...] = (), routerd_password: str = "",
             producer_password: str = "") -> str:
    """The two users as lines of a Redis ACL file (``aclfile`` in redis.conf); the same rules follow
    ``ACL SETUSER NAME`` in redis-cli. A user whose password is not given gets none (it cannot log in
    until one is added with ``>password`` or ``#sha256``). Raises ValueError for a name an ACL rule
    cannot hold."""
    for what, name in (("--routerd-user", routerd_user), ("--producer-user", producer_user)):
        if not _NAME.match(name):
            raise ValueError(f"{what} {name!r}: letters, digits and _.@+- only (1-64)")
    if routerd_user == producer_user:
        raise ValueError("the routerd user and the producer user must differ")
    keys = RedisKeys.from_config(cfg)
    return "\n".join([
        _line(routerd_user, routerd_rules(keys, reply_patterns), routerd_password),
        _line(producer_user, producer_rules(keys, producer_prefix, reply_patterns), producer_password),
    ]) + "\n"


def main(argv: list[str]) -> int:
    """``routerd redis-acl [--config FILE] [--routerd-user NAME] [--producer-user NAME] [...]``."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="routerd redis-acl", description="Print Redis ACL rules (ACL file "
                                "lines) for routerd's own user and a queue producer of this config.")
    p.add_argument("--config", help="the deployment's config: its [redis] stream names, user and password")
    p.add_argument("--routerd-user", help="routerd's user (default: the config's redis.username, else "
                   "routerd)")
    p.add_argument("--producer-user", default="producer", help="the producer's user (default: producer)")
    p.add_argument("--producer-prefix", help="the producer's job ids begin with this (default: "
                   "'<producer user>-'); its client is given the same (routerd submit --id-prefix)")
    p.add_argument("--reply-pattern", action="append", default=[], metavar="GLOB",
                   help="reply_to streams outside routerd's namespace (both users get them); repeatable")
    args = p.parse_args(argv)
    from .config import EXIT_CONFIG, ConfigError, RedisConfig
    from .redis_server import redis_target

    try:
        cfg = redis_target("", args.config).redis if args.config else RedisConfig()
    except ConfigError as e:
        print("\n".join(["routerd redis-acl: the config is not valid:", *e.problems]), file=sys.stderr)
        return EXIT_CONFIG
    routerd_user = args.routerd_user or cfg.username or "routerd"
    prefix = args.producer_prefix if args.producer_prefix is not None else f"{args.producer_user}-"
    try:
        text = acl_file(cfg, routerd_user=routerd_user, producer_user=args.producer_user,
                        producer_prefix=prefix, reply_patterns=tuple(args.reply_pattern),
                        routerd_password=cfg.password if routerd_user == cfg.username else "")
    except ValueError as e:
        p.error(str(e))
    sys.stdout.write(text)
    return 0
