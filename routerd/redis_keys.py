"""Every Redis key and stream name routerd or its producers' client touches, in one place.

The request stream, consumer group and dead-letter stream come from ``[redis]`` in the config; every
per-job key is derived from a namespace — the request stream's name up to its last ``:`` (``routerd``
for ``routerd:requests``) — so two routerd deployments with different stream names can share one
Redis without seeing each other's jobs. The client computes the same names from the same stream name.

Every name derived here is ``<ns>:<family>:<suffix>`` (built by ``RedisKeys._key``), so one prefix rule,
:meth:`RedisKeys.reserved`, covers every key routerd owns — a key added later included: a producer's
``reply_to`` must not name one (a stream created over the rate-limit buckets or a day's usage would break
them for every routerd). The one family a producer's client owns is ``reply:<id>``, its default reply
stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import RedisConfig


def namespace_of(stream: str) -> str:
    """``routerd:requests`` → ``routerd``; a stream name without ``:`` is its own namespace."""
    return stream.rsplit(":", 1)[0] if ":" in stream else stream


# Families under the namespace that belong to the producers' client, not to routerd.
CLIENT_FAMILIES = ("reply",)


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Names for one deployment. Build with :meth:`from_config` or directly from the stream name."""

    stream: str = "routerd:requests"
    group: str = "routerd"
    dead: str = "routerd:dead"

    @classmethod
    def from_config(cls, cfg: RedisConfig) -> RedisKeys:
        return cls(stream=cfg.stream, group=cfg.group, dead=cfg.dead_stream)

    @property
    def ns(self) -> str:
        return namespace_of(self.stream)

    def _key(self, family: str, suffix: str) -> str:
        return f"{self.ns}:{family}:{suffix}"

    def reserved(self, name: str) -> str | None:
        """Why ``name`` is a key routerd owns (so no producer may name it, as ``reply_to`` say), or
        None: the request and dead-letter streams, and everything under the namespace but the client's
        own families."""
        if name == self.stream:
            return "the request stream"
        if name == self.dead:
            return "the dead-letter stream"
        if name != self.ns and not name.startswith(f"{self.ns}:"):
            return None
        family = name[len(self.ns) + 1:].split(":", 1)[0]
        if family in CLIENT_FAMILIES and name.startswith(self._key(family, "")):
            return None
        return f"a key under routerd's namespace {self.ns!r}" + (f" ({family}:…)" if family else "")

    def done(self, job_id: str) -> str:
        """The idempotency record: exists once the job's one result is stored; holds that result."""
        return self._key("done", job_id)

    def status(self, job_id: str) -> str:
        """Hash: state (queued | running | done), consumer, instance, entry, updated_ms."""
        return self._key("job", job_id)

    def cancel(self, job_id: str) -> str:
        """Set by a producer to cancel a job; checked before dispatch (the channel covers the run)."""
        return self._key("cancel", job_id)

    def history(self, job_id: str) -> str:
        """List of failed attempts (JSON), copied into the dead-letter entry if the job ends there."""
        return self._key("history", job_id)

    def chunks(self, job_id: str) -> str:
        """The last (run, seq) of a streamed job's chunks written, so none is written twice."""
        return self._key("chunks", job_id)

    def reply(self, job_id: str) -> str:
        """The client's default reply stream for one job."""
        return self._key("reply", job_id)

    def ratelimit(self, tenant: str) -> str:
        """Hash: a tenant's request and token buckets (routerd/tenants/ratelimit.py)."""
        return self._key("ratelimit", tenant)

    def usage(self, day: str) -> str:
        """Hash: one UTC day's (``2026-01-31``) usage, fields ``<tenant>|<fleet>|<counter>``."""
        return self._key("usage", day)

    # the shared view of several routerd processes (routerd/peers/)
    def fleet_state(self) -> str:
        """Hash: the controller's published fleet state (``token``, ``version``, ``state`` sealed msgpack),
        expiring a few seconds after its last publish (routerd/peers/fleet_state.py)."""
        return self._key("fleet", "state")

    def fleet_version(self) -> str:
        """Counter: the last version of :meth:`fleet_state` published (monotonic across controllers)."""
        return self._key("fleet", "version")

    def fleet_channel(self) -> str:
        """Pub/sub channel: a new version of :meth:`fleet_state`, announced so followers apply it at once."""
        return self._key("fleet", "changed")

    def replicas(self) -> str:
        """Hash: replica counts set at run time (``set_replicas``), by fleet (routerd/peers/replicas.py)."""
        return self._key("fleet", "replicas")

    def adapters(self) -> str:
        """Hash: LoRA adapters added at run time (``POST /admin/fleets/{fleet}/adapters``), by name
        (routerd/view/adapters.py)."""
        return self._key("fleet", "adapters")

    def admin_calls(self) -> str:
        """Stream: admin calls a follower hands to the controller (routerd/peers/admin_relay.py)."""
        return self._key("admin", "calls")

    def admin_claim(self, call_id: str) -> str:
        """Who decided one admin call's fate first: the controller taking it, or its caller giving up."""
        return self._key("admin", f"claim:{call_id}")

    def admin_reply(self, call_id: str) -> str:
        """List: the controller's answer to one admin call."""
        return self._key("admin", f"reply:{call_id}")
    def control_lease(self) -> str:
        """The fleet-control lease: ``"<token> <holder json>"``, with a TTL (routerd/peers/lease.py)."""
        return self._key("control", "lease")

    def control_token(self) -> str:
        """The fencing-token counter: INCR'd by each take of the control lease, never reset."""
        return self._key("control", "token")
    def consumer(self, name: str) -> str:
        """Queue consumer ``name``'s live holder (its value), expiring unless renewed
        (routerd/ingress/queue/liveness.py): there exactly while a process may run jobs under the name."""
        return self._key("consumer", name)

    def consumer_names(self) -> str:
        """Hash: the consumer names that hold :meth:`consumer` (→ the last holder's value); one listed
        whose key is gone is dead, and its pending jobs are taken over at once."""
        return self._key("consumers", "named")

    def load(self, ident: str) -> str:
        """One routerd process's in-flight per instance (routerd/peers/load.py), expiring unless renewed."""
        return self._key("load", ident)

    @property
    def processes(self) -> str:
        """Sorted set: the routerd processes sharing this Redis, scored by their last heartbeat (ms)."""
        return self._key("view", "processes")

    @property
    def scrapes(self) -> str:
        """Hash: instance id → the scraping process's last scrape of it (routerd/peers/scrapes.py)."""
        return self._key("view", "scrapes")

    def session(self, digest: str) -> str:
        """A session's last instance and generation (routerd/peers/sessions.py); ``digest`` of its key."""
        return self._key("session", digest)

    @property
    def cancel_channel(self) -> str:
        """Pub/sub channel on which cancel requests are announced to every consumer."""
        return f"{self.ns}:cancel"
