"""What keying a long prompt costs: the request's wait and the event loop's, for an ~8k-token chat.

    .venv/bin/python scripts/measure_keying.py [--model-dir DIR] [--tokens 8192] [--block-size 16] [-n 200]

Without ``--model-dir`` the sim's keyer is measured. Prints the time one keying takes (tokenize +
vLLM's sha256 block chain: what the request waits) and, while keyings run back to back through
:func:`routerd.routing.engine_cache.block_keys.keys_for`, the longest stretches the event loop could not run
anything else (how late a 1 ms timer fires): inline for comparison, in a thread
(:func:`~routerd.routing.engine_cache.block_keys.keys_for`), and in the keying process routerd uses above
``INLINE_MAX`` (:mod:`routerd.routing.engine_cache.keying_process`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from routerd.ingress.validate import ChatHead, ChatMessage
from routerd.routing.engine_cache import block_keys
from routerd.routing.engine_cache.keying_process import KeyingProcess
from routerd.sim_tokens import VOCAB
from routerd.vllm_wire import block_hash


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000.0


async def _loop_lateness(work: asyncio.Future[None]) -> list[float]:
    """How late a 1 ms timer fires while ``work`` runs: what any other request on the loop waits."""
    late: list[float] = []
    while not work.done():
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        late.append(max(0.0, time.perf_counter() - t0 - 0.001))
    return late


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default="")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("-n", type=int, default=200)
    args = ap.parse_args()
    keyer = block_keys.load_keyer("vllm", args.model_dir) if args.model_dir else block_keys.SimKeyer()
    assert keyer is not None, "no tokenizer there (or tokenizers/jinja2 not installed)"
    words = [VOCAB[i % len(VOCAB)] for i in range(args.tokens * 2)]
    text = " ".join(words)
    ids = keyer.token_ids(ChatHead(model="m", messages=[ChatMessage(role="user", content=text)])) or []
    # Cut the text to about the wanted token count.
    text = " ".join(words[: int(len(words) * args.tokens / max(1, len(ids)))])
    head = ChatHead(model="m", messages=[ChatMessage(role="system", content="You are careful."),
                                         ChatMessage(role="user", content=text)])
    root = block_hash.none_hash(None)
    n_tokens = len(keyer.token_ids(head) or [])
    once = []
    for _ in range(args.n):
        t0 = time.perf_counter()
        block_keys.keys(keyer, head, args.block_size, root)
        once.append(time.perf_counter() - t0)

    process = KeyingProcess({"f": keyer.spec}, timeout_s=60)
    await process.wait_ready(60)  # the worker started and its keyer built

    async def run(mode: str) -> None:
        for _ in range(args.n):
            if mode == "inline":
                block_keys.keys(keyer, head, args.block_size, root)
                await asyncio.sleep(0)
            elif mode == "thread":
                await block_keys.keys_for(keyer, head, args.block_size, root)
            else:
                await process.keyed("f", head, args.block_size, root)

    print(f"prompt: {n_tokens} tokens, {len(text)} chars, block size {args.block_size}, n={args.n}, "
          f"keyer {type(keyer).__name__}")
    print(f"one keying (the request's wait): p50 {_pct(once, 0.5):.2f} ms  p99 {_pct(once, 0.99):.2f} ms  "
          f"mean {statistics.fmean(once) * 1000:.2f} ms")
    # The longest stretch the hashing holds the GIL in the thread: between two hand-backs (and before the
    # first, from the end of the GIL-free tokenizing) — what the loop can wait for the GIL at most.
    ids = keyer.token_ids(head) or []
    slices: list[float] = []
    for _ in range(args.n):
        last = time.perf_counter()

        def pause() -> None:
            nonlocal last
            now = time.perf_counter()
            slices.append(now - last)
            time.sleep(0)
            last = time.perf_counter()

        block_hash.block_keys(ids, args.block_size, root, pause=pause)
        slices.append(time.perf_counter() - last)
    print(f"GIL held by the hashing between hand-backs: p50 {_pct(slices, 0.5):.3f} ms  "
          f"p99 {_pct(slices, 0.99):.3f} ms  max {max(slices) * 1000:.3f} ms")
    idle = asyncio.ensure_future(asyncio.sleep(sum(once)))
    late = await _loop_lateness(idle)
    print(f"a 1 ms timer's lateness, nothing else running (the machine's floor): "
          f"p50 {_pct(late, 0.5):.3f} ms  p99 {_pct(late, 0.99):.3f} ms  max {max(late) * 1000:.3f} ms")
    for mode in ("inline", "thread", "process"):
        t0 = time.perf_counter()
        work = asyncio.ensure_future(run(mode))
        late = await _loop_lateness(work)
        await work
        per = (time.perf_counter() - t0) / args.n * 1000
        print(f"a 1 ms timer's lateness, {mode} ({per:.1f} ms a keying): "
              f"p50 {_pct(late, 0.5):.3f} ms  p99 {_pct(late, 0.99):.3f} ms  max {max(late) * 1000:.3f} ms")
    process.close()


if __name__ == "__main__":  # the keying process is spawned: it imports this module without running it
    asyncio.run(main())
