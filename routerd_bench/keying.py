"""What keying a request for the engines' own cache view costs routerd's event loop, at long prompts.

To score a request against the engines' KV-event views, routerd tokenizes it as the engine will and
hashes its blocks (:mod:`routerd.routing.engine_cache.block_keys`) — milliseconds for an 8k-token prompt,
too long for the event loop. Method: ``requests`` chat prompts of about ``prompt_tokens`` tokens (each opens a
conversation of its own: nothing is shared), read as the ingress reads them (``read_head``) and keyed
one at a time, on a running event loop, the way routerd keys them
(``RequestViews.with_engine_keys``), in three ways:

* ``process`` — routerd's way above ``INLINE_MAX``: in the keying worker process
  (:mod:`routerd.routing.engine_cache.keying_process`), started and ready before the first request;
* ``thread`` — the fallback while that worker starts: in a thread (``block_keys.keys_for``);
* ``inline`` — on the loop itself, for comparison: what the request waits for its keys without either.

Figures per request: ``loop_us`` — the CPU time *this process* spent while the request was keyed
(``process_time``: the loop's thread and the executor's helper threads together; with the GIL, an
upper bound of what held the loop up — ``process`` leaves out the worker's own time, ``thread`` does
not), and ``wait_ms`` — how long the request waited for its keys (wall clock; on a shared machine the
noisier figure). The target is ``process`` loop p99 ≤ 1 ms with a wait no longer than ``inline``'s.

Keyers: the sim's (its whitespace tokens), and a Hugging Face ``tokenizer.json`` directory when one
is given (``--keying-model-dir``; ``scripts/make_tiny_model.py`` builds one).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import msgspec

from routerd.config import RoutingConfig
from routerd.ingress.validate import read_head
from routerd.openai import ChatHead
from routerd.routing.engine_cache import block_keys
from routerd.routing.engine_cache.keying_process import KeyingProcess
from routerd.routing.request import RequestViews
from routerd.sim_tokens import VOCAB
from routerd.vllm_wire import block_hash

from ._common import summary

CHAT = "/v1/chat/completions"
FLEET = "f"
BLOCK = 16


def _bodies(keyer: block_keys.EngineKeyer, prompt_tokens: int, requests: int, seed: int) -> list[bytes]:
    """Chat bodies of about ``prompt_tokens`` tokens by ``keyer``, sharing nothing."""
    rng = random.Random(seed)

    def body(words: int) -> bytes:
        text = " ".join(rng.choices(VOCAB, k=words))
        return msgspec.json.encode({"model": "m", "max_tokens": 16, "messages": [
            {"role": "system", "content": f"conversation {rng.random()}"},
            {"role": "user", "content": text}]})

    probe = _head(body(prompt_tokens))
    per_word = len(keyer.token_ids(probe) or []) / prompt_tokens
    words = max(1, round(prompt_tokens / max(per_word, 1e-9)))
    return [body(words) for _ in range(requests)]


def _head(body: bytes) -> ChatHead:
    head = read_head(CHAT, body)
    if not isinstance(head, ChatHead):
        raise TypeError("a chat body read as something else")
    return head


async def _run(views: RequestViews, keyer: block_keys.EngineKeyer, bodies: list[bytes],
               mode: str) -> dict[str, Any]:
    root = block_hash.none_hash(None)
    loop_s: list[float] = []
    wait_s: list[float] = []
    blocks = 0
    for body in bodies:
        head = _head(body)
        view = views.build(FLEET, CHAT, head)
        c0, w0 = time.process_time(), time.perf_counter()
        if mode == "inline":
            keys = block_keys.keys(keyer, head, BLOCK, root, hittable=True)
        else:
            keys = (await views.with_engine_keys(view, head)).engine_keys
        loop_s.append(time.process_time() - c0)
        wait_s.append(time.perf_counter() - w0)
        blocks = len(keys)
        await asyncio.sleep(0)
    return {"blocks": blocks, "loop_us": summary(loop_s, 1e6), "wait_ms": summary(wait_s)}


async def _keyer_cost(keyer: block_keys.EngineKeyer, prompt_tokens: int, requests: int,
                      seed: int) -> dict[str, Any]:
    bodies = _bodies(keyer, prompt_tokens, requests, seed)
    root = block_hash.none_hash(None)
    process = KeyingProcess({FLEET: keyer.spec}, timeout_s=60)
    try:
        await process.wait_ready(120)
        out: dict[str, Any] = {"prompt_tokens": len(keyer.token_ids(_head(bodies[0])) or [])}
        for mode in ("process", "thread", "inline"):
            views = RequestViews(RoutingConfig(), keyers={FLEET: (keyer, BLOCK, root)},
                                 keying=process if mode == "process" else None)
            await _run(views, keyer, bodies[: max(1, requests // 10)], mode)  # warm-up
            out[mode] = await _run(views, keyer, bodies, mode)
        return out
    finally:
        process.close()


async def keying_cost(prompt_tokens: int = 8192, *, model_dir: str = "", requests: int = 200,
                      seed: int = 1) -> dict[str, Any]:
    """Per request: this process's CPU time while a prompt is keyed, and the request's wait, by way of
    keying and keyer (see the module docstring)."""
    keyers: dict[str, block_keys.EngineKeyer] = {"sim": block_keys.SimKeyer()}
    if model_dir:
        hf = block_keys.load_keyer("vllm", model_dir)
        if hf is None:
            raise ValueError(f"{model_dir}: no tokenizer.json there (or routerd[kv] not installed)")
        keyers["hf"] = hf
    return {"requests": requests, "block_size": BLOCK, "inline_max_chars": block_keys.INLINE_MAX,
            "keyers": {name: await _keyer_cost(k, prompt_tokens, requests, seed)
                       for name, k in keyers.items()}}
