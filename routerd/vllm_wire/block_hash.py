"""The block keys vLLM computes for its prefix cache, computed the same way outside vLLM.

An engine's KV-cache events name blocks by these keys, so a router that wants to ask "which of this
request's blocks does that engine hold?" must derive the very same keys from the request's tokens.
vLLM 0.32 (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``) chains them:

- ``NONE_HASH = H(seed)``, the seed being ``PYTHONHASHSEED`` when set, else ``"vllm-none-hash"`` for
  the cryptographic algorithms;
- block *i* (full blocks only): ``H((parent, tuple(token_ids), extra_keys))``, parent = block *i−1*'s
  full hash (``NONE_HASH`` for the first), ``extra_keys`` None without LoRA, images or ``cache_salt``
  (a LoRA request's: ``(("lora", name, path),)`` on every block, :func:`lora_extra`);
- ``H = sha256(pickle.dumps(x, HIGHEST_PROTOCOL))`` for ``--prefix-caching-hash-algo sha256`` (the
  default), the only algorithm supported here: routerd launches its engines with it, and the
  alternatives need ``cbor2``/``xxhash`` (xxhash additionally seeds randomly unless told);
- the events publish the *low 64 bits* of each hash as an int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
  default on) or the whole digest as bytes — :func:`external` maps both to the same int.

The chain runs on full digests, so the published ints cannot be extended: keys are recomputed from
token ids (the sim and :mod:`routerd.routing.engine_cache.blocks` do), never from a published parent.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence

HASH_ALGO = "sha256"
DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed when PYTHONHASHSEED is unset (sha256)
# The PYTHONHASHSEED routerd starts its engines with (Python wants an integer there): the first block's
# parent is then sha256 of this string, the same on every engine routerd launches.
LAUNCH_SEED = "0"
_MASK64 = (1 << 64) - 1
ExtraKeys = tuple[tuple[str, ...], ...]


def _sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str | None) -> bytes:
    """The first block's parent: what ``init_none_hash`` derives from ``PYTHONHASHSEED`` (or None)."""
    return _sha256(DEFAULT_SEED if seed is None else seed)


def lora_extra(name: str, path: str) -> ExtraKeys:
    """The extra keys vLLM 0.32 hashes into every block of a LoRA request: ``(("lora", name, path),)``
    (``_gen_lora_extra_hash_keys``: the path too, so a name pointed at new weights is a new cache)."""
    return (("lora", name, path),)


def block_digests(token_ids: Sequence[int], block_size: int, root: bytes, *,
                  pause: Callable[[], None] | None = None, extra: ExtraKeys | None = None) -> list[bytes]:
    """Full digests of every *full* block of ``token_ids``, chained from ``root`` (:func:`none_hash`);
    ``extra``: the blocks' extra keys (:func:`lora_extra`), None without LoRA.

    ``pause`` is called every 32 blocks: in a thread, ``time.sleep(0)`` there hands the GIL back, so a
    long prompt's hashing does not hold the event loop's thread off for a whole switch interval."""
    out: list[bytes] = []
    parent = root
    ids = list(token_ids)
    for n, start in enumerate(range(0, len(ids) - block_size + 1, block_size), 1):
        parent = _sha256((parent, tuple(ids[start:start + block_size]), extra))
        out.append(parent)
        if pause is not None and n % 32 == 0:
            pause()
    return out


def external(block_hash: bytes | int) -> int:
    """The key a KV event carries for a block, as an int: the digest's low 64 bits (an int as is)."""
    if isinstance(block_hash, int):
        return block_hash & _MASK64
    return int.from_bytes(block_hash, "big") & _MASK64


def block_keys(token_ids: Sequence[int], block_size: int, root: bytes, *,
               pause: Callable[[], None] | None = None, extra: ExtraKeys | None = None) -> list[int]:
    """The event keys of the full blocks of ``token_ids``: what the engine will announce storing."""
    return [external(d) for d in block_digests(token_ids, block_size, root, pause=pause, extra=extra)]
