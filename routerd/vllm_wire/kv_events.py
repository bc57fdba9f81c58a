"""vLLM's KV-cache event wire, decoded tolerantly: the event types and the decoding of one batch.

The wire (vLLM 0.32 ``vllm/distributed/kv_events.py``): one ZMQ PUB message per scheduler step that
changed the cache, frames ``[topic, 8-byte big-endian seq, msgpack batch]``; the batch is
``[ts, events, data_parallel_rank]`` (``EventBatch`` is ``array_like``; one revision sent it as a map,
accepted too). The events inside changed shape in 2026 — positional arrays ``["BlockStored", hashes,
parent, token_ids, block_size, lora_id, medium, lora_name, …]`` became tagged maps ``{"type":
"BlockStored", "block_hashes": …}`` — and every field vLLM added broke subscribers that decoded a batch
as one typed whole. So :func:`decode_batch` decodes each event on its own, accepts both forms, ignores
fields it does not know and counts (never raises on) events it cannot use. Shared by the subscriber
(:mod:`routerd.routing.engine_cache.subscriber`), the engine views and the simulator's publisher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from .block_hash import external

_unpack = msgspec.msgpack.Decoder()
_INT_TUPLE = tuple[int, ...]
_MASK64 = (1 << 64) - 1
END_SEQ = -1
# Larger messages are dropped by ZMQ itself (the connection is reset): one scheduler step's batch is a
# few hundred KB at most, and a peer that sends more must not run routerd out of memory.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks the engine committed to its cache (keys as :func:`block_hash.external` ints)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    # The LoRA adapter of the request that stored them (its name is an extra key of their hashes).
    lora_name: str | None = None
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted (a cached block reallocated; freeing alone emits nothing)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (``reset_prefix_cache``)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One publisher message: its seq, timestamp, rank, the events understood and how many were not."""

    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None
    skipped: int = 0


class DecodeError(ValueError):
    """A frame or batch routerd cannot read at all (a bad event inside a batch is only skipped)."""


# Positional field order of the array form, after the tag (vllm 0.32's struct declaration order).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name")
_REMOVED_FIELDS = ("block_hashes", "medium")


def _as_fields(raw: Any) -> tuple[str, dict[str, Any]] | None:
    """(kind, fields) of one event in either form, or None when it has no recognisable tag."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        return (kind, raw) if isinstance(kind, str) else None
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS if kind == "BlockRemoved" else ()
        return kind, dict(zip(names, raw[1:], strict=False))
    return None


def _ints(value: Any) -> tuple[int, ...] | None:
    """``value`` as a tuple of ints when it is a list of them (checked in C: a batch of a long prompt
    carries thousands of token ids, and every routerd decodes every engine's batches); else None."""
    try:
        return msgspec.convert(value, _INT_TUPLE)
    except msgspec.ValidationError:
        return None


def _hashes(value: Any) -> tuple[int, ...]:
    ints = _ints(value)
    if ints is not None and (not ints or (min(ints) >= 0 and max(ints) <= _MASK64)):
        return ints  # already what external() makes of an int
    if not isinstance(value, list | tuple) or not all(isinstance(h, int | bytes) for h in value):
        raise TypeError("block_hashes must be a list of ints or bytes")
    return tuple(external(h) for h in value)


def _medium(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def decode_event(raw: Any) -> KvEvent | None:
    """One event in array or map form; None for a kind or shape routerd does not use (counted)."""
    parsed = _as_fields(raw)
    if parsed is None:
        return None
    kind, f = parsed
    try:
        if kind == "BlockStored":
            parent = f.get("parent_block_hash")
            raw_tokens = f.get("token_ids", ())
            size = f.get("block_size")
            if not isinstance(size, int) or size < 1 or not isinstance(raw_tokens, list | tuple):
                return None
            tokens = _ints(raw_tokens)
            if tokens is None:  # not plain ints: as tolerant as ever, at Python's pace
                tokens = tuple(int(t) for t in raw_tokens)
            lora_name, lora_id = f.get("lora_name"), f.get("lora_id")
            return BlockStored(block_hashes=_hashes(f.get("block_hashes")),
                               parent_block_hash=None if parent is None else external(parent),
                               token_ids=tokens, block_size=size, medium=_medium(f.get("medium")),
                               lora_name=lora_name if isinstance(lora_name, str) else None,
                               lora_id=lora_id if isinstance(lora_id, int) else None)
        if kind == "BlockRemoved":
            return BlockRemoved(block_hashes=_hashes(f.get("block_hashes")), medium=_medium(f.get("medium")))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    except (TypeError, ValueError):
        return None
    return None


def decode_batch(seq: int, payload: bytes) -> EventBatch:
    """A msgpack batch, ``[ts, events, dp_rank]`` or ``{"ts", "events", "data_parallel_rank"}``.

    Raises :class:`DecodeError` only when the batch itself is unreadable; its events decode one by one.
    """
    try:
        raw = _unpack.decode(payload)
    except (msgspec.DecodeError, RecursionError) as e:  # nesting too deep is msgspec's RecursionError
        raise DecodeError(f"batch {seq}: not msgpack ({e})") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise DecodeError(f"batch {seq}: neither [ts, events, rank] nor a map")
    if not isinstance(events, list) or not isinstance(ts, int | float):
        raise DecodeError(f"batch {seq}: ts or events of the wrong type")
    decoded = [decode_event(e) for e in events]
    kept = tuple(e for e in decoded if e is not None)
    return EventBatch(seq=seq, ts=float(ts), events=kept, dp_rank=rank if isinstance(rank, int) else None,
                      skipped=len(decoded) - len(kept))


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise DecodeError(f"seq frame of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)
