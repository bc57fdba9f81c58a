"""Every Redis key and stream name routerd or its producers' client touches, in one place.

The request stream, consumer group and dead-letter stream come from ``[redis]`` in the config; every
per-job key is derived from a namespace — the request stream's name up to its last ``:`` (``routerd``
for ``routerd:requests``) — so two routerd deployments with different stream names can share one
Redis without seeing each other's jobs. The client computes the same names from the same stream name.

On a Redis Cluster (``[redis] cluster``) the namespace is in braces, a hash tag (``{routerd}:requests``,
``{routerd}:done:<id>``): every key of a deployment is in one slot, so its Lua scripts, transactions and
pipelines run there. Without it the names are as they always were, so producers keep working.

Every name derived here is ``<ns>:<family>:<suffix>`` (built by ``RedisKeys._key``), so one prefix rule,
:meth:`RedisKeys.reserved`, covers every key routerd owns — a key added later included: a producer's
``reply_to`` must not name one (a stream created over the rate-limit buckets or a day's usage would break
them for every routerd). The one family a producer's client owns is ``reply:<id>``, its default reply
stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.crc import key_slot

from .config import RedisConfig
from .config_schema import cluster_names


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
        """A loaded config's names (on a cluster, already under the hash tag: ``config.parse``)."""
        return cls(stream=cfg.stream, group=cfg.group, dead=cfg.dead_stream)

    @classmethod
    def for_stream(cls, stream: str, *, cluster: bool = False) -> RedisKeys:
        """A producer's names for the deployment whose request stream is ``stream`` (as its config
        says it), under the hash tag on a cluster (``[redis] cluster``)."""
        if not cluster:
            return cls(stream=stream)
        stream, dead = cluster_names(stream, RedisConfig().dead_stream)  # a producer never names it
        return cls(stream=stream, dead=dead)

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

    @property
    def tagged(self) -> bool:
        """Whether the names are under a hash tag (``[redis] cluster``)."""
        return self.ns.startswith("{") and self.ns.endswith("}")

    def elsewhere(self, name: str) -> str | None:
        """Why a key named by a producer (``reply_to``) cannot be used with the deployment's keys on a
        Redis Cluster — another slot, which routerd's scripts and transactions cannot reach — or None."""
        if not self.tagged or key_slot(name.encode()) == key_slot(self.stream.encode()):
            return None
        return f"not under the deployment's hash tag {self.ns} (redis.cluster), so in another slot"

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

    # the OpenAI Batch API (routerd/batches/)
    def file(self, file_id: str) -> str:
        """Hash: one file's object (``id``, ``tenant``, ``bytes``, ``chunks``, …)."""
        return self._key("file", file_id)

    def file_chunk(self, file_id: str, n: int) -> str:
        """String: the ``n``-th piece (≤ 256 KiB) of a file's bytes."""
        return self._key("filedata", f"{file_id}:{n}")

    def files_of(self, tenant: str) -> str:
        """Sorted set: a tenant's file ids by creation (ms)."""
        return self._key("files", tenant)

    @property
    def files_bytes(self) -> str:
        """Hash: tenant → bytes of its files (the quota's count)."""
        return self._key("files", "bytes")

    def batch(self, batch_id: str) -> str:
        """Hash: one batch's object and progress (routerd/batches/store.py)."""
        return self._key("batch", batch_id)

    def batches_of(self, tenant: str) -> str:
        """Sorted set: a tenant's batch ids by creation (ms)."""
        return self._key("batches", tenant)

    @property
    def batches_active(self) -> str:
        """Set: the batches not yet in a final state, which some routerd must run."""
        return self._key("batches", "active")

    @property
    def batch_states(self) -> str:
        """Hash: state → how many batches are in it (``/metrics``)."""
        return self._key("batches", "states")

    def batch_lease(self, batch_id: str) -> str:
        """Who runs a batch now: a holder's token, with a TTL it renews."""
        return self._key("batchrun", f"{batch_id}:lease")

    def batch_written(self, batch_id: str) -> str:
        """Bitmap: bit n set once line n's output (or error) line is written."""
        return self._key("batchrun", f"{batch_id}:written")

    def batch_inflight(self, batch_id: str) -> str:
        """Hash: line number → custom_id (JSON) of each line fed as a queue job and not yet written."""
        return self._key("batchrun", f"{batch_id}:inflight")

    def batch_results(self, batch_id: str) -> str:
        """Stream: the results of a batch's queue jobs (their ``reply_to``: a reply stream, the
        client's family, as any producer's)."""
        return self.reply(f"batch:{batch_id}")

    # Responses-API records and conversations (routerd/conversations/store.py)
    def response(self, response_id: str) -> str:
        """A stored response (msgpack ``ResponseRecord``: its tenant, input and output items, chain link),
        expiring ``[responses] ttl_s`` after its last use."""
        return self._key("response", response_id)

    def responses(self, tenant: str) -> str:
        """Sorted set: a tenant's stored response ids by last use (ms), to keep it to its
        ``max_per_tenant``."""
        return self._key("responses", tenant)

    def conversation(self, conversation_id: str) -> str:
        """A conversation (msgpack ``ConversationRecord``: tenant, created_at, metadata)."""
        return self._key("conversation", conversation_id)

    def conversation_items(self, conversation_id: str) -> str:
        """List: a conversation's items (JSON objects, each with its ``id``), oldest first."""
        return self._key("conversation_items", conversation_id)

    def conversations(self, tenant: str) -> str:
        """Sorted set: a tenant's conversation ids by last change (ms), as :meth:`responses`."""
        return self._key("conversations", tenant)

    @property
    def cancel_channel(self) -> str:
        """Pub/sub channel on which cancel requests are announced to every consumer."""
        return f"{self.ns}:cancel"
