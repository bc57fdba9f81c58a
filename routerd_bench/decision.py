"""The cost of one routing decision, timed in-process: what routerd adds per request to route by
cache, session and expected wait.

Method: a :class:`~routerd.routing.Router` over a registry of ``instances`` READY instances (fresh
scrapes with some load on them, 1M tokens of KV each) and the default ``cache_aware`` policy. The
traffic is chat requests of ``prompt_tokens`` tokens (at 4 bytes a token): ``conversations``
conversations, each opened by one of two system prompts and its own context, each request the
conversation's next turn (so decisions match a prefix and record the new blocks); and, timed apart as
``total (unique)``, the same number of prompts that share nothing (every block new, old ones evicted:
the most a decision records). Each request is timed in parts with ``thread_time_ns`` — the thread's
CPU time, so what other processes do on a shared machine is not counted (what a busy cache does
still is):

* ``parse``: the body check the ingress always did (``read_head``, one decode) — before this issue as
  now, shown apart;
* ``view``: the request view from the parsed head — the canonical rendering, the block keys;
* ``choose``: ``Router.choose`` — candidates (expected wait, prefix match per instance), the policy,
  and recording the decision (index, session, predicted hit ratio);

and ``total`` is ``view + choose``: what routing adds per request. The first ``warmup`` requests are
not counted; the garbage collector runs as it would in routerd.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import msgspec

from routerd.config import RoutingConfig
from routerd.ingress.validate import read_head
from routerd.registry import Instance, InstanceState, LoadSnapshot, Registry
from routerd.routing import Router

CHAT = "/v1/chat/completions"
_WORDS = ("route", "the", "request", "engine", "cache", "token", "prefix", "block", "queue", "model",
          "answer", "stream", "fleet", "replica", "batch", "decode")


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(_WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:chars]


def _bodies(prompt_tokens: int, conversations: int, requests: int, seed: int) -> list[bytes]:
    """Chat bodies of about ``prompt_tokens`` tokens: each conversation's turns in order (a turn is the
    previous one's messages, an answer and a new question), interleaved; a conversation that reached
    the length starts over."""
    rng = random.Random(seed)
    chars = prompt_tokens * 4
    systems = [_text(rng, chars // 8) for _ in range(2)]
    turn = chars // 16

    def opening(i: int) -> list[dict[str, str]]:  # then 8 turns before it reaches the length
        return [{"role": "system", "content": systems[i % 2]},
                {"role": "user", "content": _text(rng, chars // 2 - len(systems[i % 2]))}]

    convs = [opening(i) for i in range(conversations)]
    bodies = []
    for n in range(requests):
        i = n % conversations
        messages = convs[i]
        if sum(len(m["content"]) for m in messages) + turn > chars:
            messages = convs[i] = opening(i)
        else:
            messages += [{"role": "assistant", "content": _text(rng, turn // 2)},
                         {"role": "user", "content": _text(rng, turn // 2)}]
        # Padded to the length measured: the tail of the last question.
        pad = max(0, chars - sum(len(m["content"]) for m in messages))
        last = dict(messages[-1], content=messages[-1]["content"] + _text(rng, pad))
        bodies.append(msgspec.json.encode({"model": "m", "messages": [*messages[:-1], last],
                                           "max_tokens": 64, "stream": True}))
    return bodies


def _registry(instances: int, now: float, rng: random.Random, kv_blocks: int) -> Registry:
    reg = Registry(clock=lambda: now)
    for i in range(instances):
        inst = reg.add(Instance(id=f"f:{i}", fleet="f", url=f"http://10.0.0.{i}:8000", capacity_hint=16))
        inst.state = InstanceState.READY
        inst.snapshot = LoadSnapshot(scraped_at=now, running=rng.randint(1, 7), waiting=0.0, kv_usage=0.4,
                                     num_gpu_blocks=kv_blocks, block_size=16)
    return reg


def _summary(ns: list[int]) -> dict[str, float]:
    us = sorted(v / 1000 for v in ns)
    return {"p50": round(us[len(us) // 2], 1), "p99": round(us[min(len(us) - 1, int(len(us) * 0.99))], 1),
            "mean": round(statistics.fmean(us), 1)}


def _run(router: Router, bodies: list[bytes], warmup: int) -> tuple[list[int], list[int], list[int], int]:
    """Parse, view and choose each body; CPU ns of each part per request after ``warmup``."""
    views = router.views
    perf = time.thread_time_ns  # CPU time: what other processes on the machine do is not counted
    parse_ns: list[int] = []
    view_ns: list[int] = []
    choose_ns: list[int] = []
    blocks = 0
    for n, body in enumerate(bodies):
        t0 = perf()
        head = read_head(CHAT, body)
        t1 = perf()
        view = views.build("f", CHAT, head)
        t2 = perf()
        router.choose("f", (), view)
        t3 = perf()
        if n >= warmup:
            parse_ns.append(t1 - t0)
            view_ns.append(t2 - t1)
            choose_ns.append(t3 - t2)
            blocks = len(view.block_keys)
    return parse_ns, view_ns, choose_ns, blocks


def _unique(prompt_tokens: int, requests: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [msgspec.json.encode({"model": "m", "max_tokens": 64, "messages": [
        {"role": "user", "content": _text(rng, prompt_tokens * 4)}]}) for _ in range(requests)]


def decision_cost(prompt_tokens: int = 8192, *, instances: int = 4, conversations: int = 64,
                  requests: int = 3000, warmup: int = 500, seed: int = 1) -> dict[str, Any]:
    """Time ``requests`` routing decisions (see the module docstring); µs per request by part."""
    rng = random.Random(seed)
    now = 1000.0
    router = Router.from_config(_registry(instances, now, rng, 65536), RoutingConfig(), rng=rng,
                                clock=lambda: now)
    parse_ns, view_ns, choose_ns, blocks = _run(
        router, _bodies(prompt_tokens, conversations, warmup + requests, seed), warmup)
    total = [a + b for a, b in zip(view_ns, choose_ns, strict=True)]
    # Prompts sharing nothing, on small caches: every block is new and as many are evicted.
    cold = Router.from_config(_registry(instances, now, rng, 4096), RoutingConfig(), rng=rng,
                              clock=lambda: now)
    _, u_view, u_choose, _ = _run(cold, _unique(prompt_tokens, warmup + requests // 2, seed + 1), warmup)
    return {"prompt_tokens": prompt_tokens, "instances": instances, "requests": requests,
            "policy": router.policy.name, "blocks_per_prompt": blocks, "index_blocks": len(router.index),
            "parts": {"parse": _summary(parse_ns), "view": _summary(view_ns), "choose": _summary(choose_ns),
                      "total": _summary(total),
                      "total (unique)": _summary([a + b for a, b in zip(u_view, u_choose, strict=True)])}}
