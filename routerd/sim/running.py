"""How a route's request becomes work for the batching engine: one place for every route family.

Chat, completions, the Responses API, Anthropic's messages and audio *generate*: their output is
``sim_tokens.generate`` over the rendered prompt, produced token by token by the engine loop, so they
queue, batch, get preempted and show in ``/metrics`` as chat does. Pooling routes (embeddings, score,
rerank, classify, pooling) take an engine slot for one prefill-only step. Tokenize takes none.

:class:`Runner` holds what every handler of those families shares: the engine, the faults, the count
of requests in flight (``/load``) and whether the server is stopping; the families get it from
``SimEngine`` rather than the server itself, so none of them imports the server.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from routerd.vllm_wire import block_hash

from ..sim_tokens import generate, token_ids
from . import protocol as p
from .config import SimConfig
from .engine import BatchEngine, SeqState
from .engine import Sequence as Seq
from .faults import Faults
from .lora import SimAdapter, SimLora


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt as the engine sees it: its words (the sim's tokens), count and output key."""

    words: list[str]
    tokens: int
    key: str


class Runner:
    """Builds the engine's sequences for a route's request and runs them with the server's accounting."""

    def __init__(self, config: SimConfig, engine: BatchEngine, faults: Faults, *, kv_keys: bool) -> None:
        self.config = config
        self.engine = engine
        self.faults = faults
        self.server_load = 0  # generate and pooling requests in flight, as vLLM's load_aware_call counts
        self.stopping = False
        self._kv_keys = kv_keys  # KV events on: block keys as vLLM computes them
        self._kv_root = block_hash.none_hash(os.environ.get("PYTHONHASHSEED"))

    def refuses(self, key: str) -> bool:
        """An injected 500 for this request: the server stopping, the error rate, or a poison text."""
        return self.stopping or self.faults.draw_error() or self.faults.poisoned(key)

    def _hashes(self, words: Sequence[str], lora: SimAdapter | None = None) -> tuple[list[int], list[int]]:
        """The prompt's block keys and token ids; an adapter's blocks are other blocks (its LoRA extra
        key, as vLLM's)."""
        if self._kv_keys:
            ids = token_ids(words)
            return block_hash.block_keys(ids, self.config.block_size, self._kv_root,
                                         extra=None if lora is None else lora.extra_key_tuple), ids
        hashes = p.block_hashes(words, self.config.block_size)
        if lora is not None:
            hashes = [hash((lora.extra_key, h)) for h in hashes]
        return hashes, []

    def generation(self, prompt: Prompt, max_tokens: int, *, stop: tuple[str, ...] = (),
                   ignore_eos: bool = False, lora: SimAdapter | None = None) -> Seq:
        """The sequence that generates ``prompt``'s deterministic output (not submitted yet); with a LoRA
        adapter, the adapter's output (``adapter_seed``) over the adapter's blocks."""
        cfg = self.config
        seed = SimLora.seed(cfg.seed, lora)
        pieces, finish, stop_reason = generate(seed, prompt.key, max_tokens, stop=stop,
                                               eos_prob=cfg.eos_prob, ignore_eos=ignore_eos)
        hashes, ids = self._hashes(prompt.words, lora)
        return Seq(prompt_tokens=prompt.tokens, block_hashes=hashes, pieces=pieces, finish_reason=finish,
                   stop_reason=stop_reason, max_tokens=max_tokens, arrival=0.0, token_ids=ids, lora=lora)

    def pooling(self, prompt: Prompt) -> Seq:
        """A pooling request: the prompt's prefill and nothing generated (one step, finished "stop")."""
        hashes, ids = self._hashes(prompt.words)
        return Seq(prompt_tokens=prompt.tokens, block_hashes=hashes, pieces=[""], finish_reason="stop",
                   stop_reason=None, max_tokens=1, arrival=0.0, token_ids=ids, pooling=True)

    @contextlib.asynccontextmanager
    async def running(self, seq: Seq) -> AsyncIterator[Seq]:
        """Submit ``seq`` for the block's duration; on the way out (client gone, handler cancelled) it is
        aborted, which frees its batch slot — a no-op once it finished."""
        self.server_load += 1
        try:
            self.engine.submit(seq)
            yield seq
        finally:
            self.engine.abort(seq)
            self.server_load -= 1

    async def finish(self, seq: Seq) -> bool:
        """Wait for ``seq`` to end; whether it finished (False: the engine dropped it)."""
        async for _ in seq.stream():
            pass
        return self.finished(seq)

    @staticmethod
    def finished(seq: Seq) -> bool:
        """Whether ``seq`` ran to its end (not aborted by a fault, the client or the server stopping)."""
        return seq.state is SeqState.FINISHED

    def breaks_stream(self, sent: int, seq: Seq) -> bool:
        """The fail-mid-stream fault: after ``sent`` events the stream breaks (the request failed)."""
        limit = self.faults.fail_after_chunks
        if limit is not None and sent >= limit:
            self.engine.abort(seq, reason="error")
            return True
        return False
