"""The durable way in: a Redis Streams consumer with exactly one result per job id.

Modules, each importing only those listed after it:

- ``consumer``: :class:`QueueIngress` — reading under capacity, the group, the lifecycle, depth samples;
- ``cancel``: the cancel channel's listener and ``cancel_local``;
- ``job``: one job's life — validate, read it into the dispatch's request (:mod:`routerd.dataplane.dispatch`),
  redelivery, result, dead letter;
- ``reclaim``: own-pending recovery, ``XAUTOCLAIM`` of idle jobs, keep-alive, delivery counts;
- ``name``: the lease on the consumer's name — its pending jobs are recovered once a previous holder
  still alive (draining) let go;
- ``sinks``: where the engine call writes a job's response (in memory, or chunks to ``reply_to``);
- ``store``: the Lua scripts and the batching writer every Redis write goes through;
- ``held``: the jobs this consumer holds.

The messages and key names are :mod:`routerd.queue_wire` and :mod:`routerd.redis_keys`, shared with the
client.
"""

from .consumer import QueueIngress
from .results import REDIS_DOWN, JobStore, ResultWriter
from .sinks import BufferSink, ReplyRefused, StreamSink

__all__ = [
           "REDIS_DOWN",
           "BufferSink",
           "JobStore",
           "QueueIngress",
           "ReplyRefused",
           "ResultWriter",
           "StreamSink",
]
