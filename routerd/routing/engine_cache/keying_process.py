"""Keying long prompts in a process of their own, so the event loop never waits for it.

In a thread (:func:`routerd.routing.engine_cache.block_keys.keys_for`) the block hashing hands the GIL back
every
32 blocks, but a tokenizer still holds it for stretches of milliseconds on an ~8k-token prompt
(``scripts/measure_keying.py``). Here the whole of it — tokenizing, rendering, hashing — runs in one
worker process; the loop pays for sending the parsed head and receiving the keys (a few hundred
microseconds for 8k tokens). The worker builds each fleet's keyer once from its ``spec``
(:func:`~routerd.routing.engine_cache.block_keys.load_keyer`). A worker that dies, or an answer later than
``timeout_s``, makes :meth:`KeyingProcess.keyed` return None — the caller keys in a thread instead — and
the first call after ``restart_backoff_s`` starts a new worker.

A worker takes seconds to start (a spawned interpreter importing routerd and building its keyers), so
no request waits for that: :meth:`KeyingProcess.start` begins it (routerd's start-up calls it), and until
it is ready — and after it died, while the next one starts — :meth:`KeyingProcess.keyed` answers None at
once and the request is keyed in a thread, as if there were no worker.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from ... import _proc, log
from ...openai import ChatHead, CompletionHead
from ...vllm_wire import block_hash
from . import block_keys

_log = log.get("routerd.routing.engine_cache.keying_process")

# The worker process's keyers, built once per fleet by its initializer (this module's only state, and
# only in the worker: the pool's processes are separate interpreters).
_worker_keyers: dict[str, block_keys.EngineKeyer] = {}


def _init_worker(specs: dict[str, tuple[str, str]], parent_pid: int) -> None:
    # routerd stops this process itself (close()), after its drain: a terminal's Ctrl-C is not for it,
    # and a SIGKILLed routerd must not leave it behind (routerd/_proc.py)
    _proc.leave_terminal(parent_pid)
    # One core for the worker: a tokenizer spreading one prompt over every core would take them from
    # the event loop it is there to spare (read by tokenizers when it first tokenizes).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    for fleet, (engine, source) in specs.items():
        keyer = block_keys.load_keyer(engine, source)
        if keyer is not None:
            _worker_keyers[fleet] = keyer


def _worker_ready() -> bool:
    return True  # the initializer has run: the keyers are built


def _log_ready(fleets: list[str], started: float, ready: Future[bool]) -> None:
    """When the worker is up (or could not start): from the executor's thread, once per worker."""
    if ready.cancelled():
        return
    if ready.exception() is not None:
        _log.warning("keying_process_start_failed", fleets=fleets, error=repr(ready.exception()))
    else:
        _log.info("keying_process_ready", fleets=fleets, start_s=round(time.monotonic() - started, 3))


def _worker_keyed(fleet: str, head: CompletionHead | ChatHead, block_size: int, root: bytes,
                  hittable: bool, extra: block_hash.ExtraKeys | None = None) -> block_keys.Keyed | None:
    keyer = _worker_keyers.get(fleet)
    if keyer is None:
        return None
    return block_keys.keyed(keyer, head, block_size, root, hittable=hittable, extra=extra)


class KeyingProcess:
    """One worker process keying for ``specs``' fleets (fleet → keyer spec). :meth:`close` ends it."""

    def __init__(self, specs: dict[str, tuple[str, str]], *, timeout_s: float = 10.0,
                 restart_backoff_s: float = 5.0) -> None:
        self.specs = dict(specs)
        self.timeout_s = timeout_s
        # after a failure no new worker for this long (requests are keyed in threads meanwhile): a
        # worker that cannot start would otherwise be spawned again — seconds of CPU — by every request
        self.restart_backoff_s = restart_backoff_s
        self._restart_at = 0.0
        self.failures = 0
        self._pool: ProcessPoolExecutor | None = None
        self._ready: Future[bool] | None = None  # done when the worker has started and built its keyers

    def start(self) -> None:
        """Start the worker (if it is not running) without waiting for it: see the module docstring."""
        self._start()

    def _start(self) -> tuple[ProcessPoolExecutor, Future[bool]]:
        if self._pool is None or self._ready is None:
            # spawn: a fork of a process holding Ray, redis and event-loop threads is not safe
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker, initargs=(self.specs, os.getpid()))
            with _proc.terminal_signals_blocked():  # the worker is spawned by this first submit
                self._ready = self._pool.submit(_worker_ready)
            self._ready.add_done_callback(functools.partial(_log_ready, sorted(self.specs), time.monotonic()))
            _log.info("keying_process_started", fleets=sorted(self.specs))
        return self._pool, self._ready

    async def wait_ready(self, timeout_s: float) -> None:
        """Start the worker and wait until it is up (a tool or a test; a request never waits for it)."""
        _, ready = self._start()
        async with asyncio.timeout(timeout_s):
            await asyncio.wrap_future(ready)

    @property
    def ready(self) -> bool:
        """Whether the worker is up: :meth:`keyed` hands it work only then."""
        return self._ready is not None and self._ready.done() and not self._ready.exception()

    async def keyed(self, fleet: str, head: CompletionHead | ChatHead, block_size: int, root: bytes, *,
                    hittable: bool = False, extra: block_hash.ExtraKeys | None = None
                    ) -> block_keys.Keyed | None:
        """The keys and the prompt's tokens (:func:`~routerd.routing.engine_cache.block_keys.keyed`),
        computed in
        the worker; None when it could not (the caller keys in a thread)."""
        if fleet not in self.specs or (self._pool is None and time.monotonic() < self._restart_at):
            return None
        pool, ready = self._start()
        if not ready.done():
            return None  # still starting: this request is keyed in a thread
        try:
            ready.result()  # raises what broke the start
            future = pool.submit(_worker_keyed, fleet, head, block_size, root, hittable, extra)
            async with asyncio.timeout(self.timeout_s):
                return await asyncio.wrap_future(future)
        except (BrokenProcessPool, TimeoutError, OSError) as e:
            self.failures += 1
            _log.warning("keying_process_failed", fleet=fleet, error=repr(e))
            self.close()  # a new worker on a call after the backoff
            self._restart_at = time.monotonic() + self.restart_backoff_s
            return None

    def close(self) -> None:
        """End the worker now (one that hangs too: the executor has no public way to end a busy one)."""
        if self._pool is not None:
            pool, self._pool, self._ready = self._pool, None, None
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.terminate()
            pool.shutdown(wait=False, cancel_futures=True)
