"""The OpenAI Batch API on the durable queue: files and batches in Redis, each line a queue job.

Modules, each importing only those listed after it:

- ``routes``: the HTTP routes (``/v1/files``, ``/v1/batches``), OpenAI's shapes;
- ``metrics``: ``/metrics`` from the runner's samples;
- ``runner``: which routerd runs which batch, and how a batch is validated, fed, collected and ended;
- ``lease``: one runner per batch at a time;
- ``store``: the batch hash and the atomic steps (Lua) that make every line's output exactly once;
- ``lines``: one line checked, made a job, its result made an output line;
- ``files``: files in Redis in bounded pieces, streamed in and out;
- ``wire``: OpenAI's objects and errors, ids.

Key names are :mod:`routerd.redis_keys`'; the jobs are :mod:`routerd.queue_wire`' wire format.
"""

from .metrics import BatchCollector
from .routes import add_batch_routes
from .runner import BatchRunner

__all__ = ["BatchCollector", "BatchRunner", "add_batch_routes"]
