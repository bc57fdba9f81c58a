"""The routing benchmark's workloads: a fleet of simulated engines and a seeded plan of requests.

A plan is fixed before any router sees it — every body, every arrival time and every think time comes
from one seed — so each router meets exactly the same traffic. A conversation's later turns go as an
agent sends them: ``think_s`` after the previous answer arrived (a tool call, a user reading), so
only when they go depends on the router, as it would in production.

Prompt lengths are in the sim's tokens (whitespace words, ``routerd.sim_tokens``); assistant turns are
what the engines will answer (``expected_text`` with the fleet's seed: every instance of a fleet runs
the same seed, like replicas of one model), so a conversation reads the same whatever served it.

* ``heterogeneous`` — 2 instances of 8 sequences at 10 ms/token and 1 of 2 sequences at 40 ms/token;
  short unique chat prompts. The fleet config states no capacities: routerd must learn them.
* ``multiturn`` — agent-like conversations: each opens with its own long context (a document, code),
  each turn adds a question and the answer; two apps with their own system prompt, one far more
  popular. 4 instances with prefix caching and a prefill cost, so a turn served away from its context
  pays the whole prefill again.
* ``shared-prefix`` — many requests sharing a few long system prompts (skewed popularity) and a short
  question of their own: a popular prefix must not turn one instance into a hot spot.
* ``random`` — long prompts that share nothing: a cache-aware policy must cost nothing here.
* ``cache-pressure`` — many conversations over eight shared system prompts on engines whose KV is sized
  so that the plan's distinct prompt blocks would fill three-quarters of the fleet's (:func:`fit_kv`):
  every block placed on a second engine evicts another, so what a router believes each engine holds
  decides the hit ratio.

The prefix-caching engines publish vLLM's KV-cache events (``KV_EVENTS``) and report each request's
cached prompt tokens in its usage (``enable_prompt_tokens_details``), so routerd can route by the
engines' own cache view and the benchmark can hold routerd's prediction against the engine's count.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from routerd.sim_tokens import count_prompt_tokens, expected_text, prompt_words, render_chat, token_ids
from routerd.vllm_wire import block_hash

MODEL = "bench"
CHAT = "/v1/chat/completions"

# Each instance kind as SimConfig fields (``routerd sim-engine`` flags).
FAST = {"max_num_seqs": 8, "ttft_ms": 20.0, "itl_ms": 10.0, "batch_factor": 0.5}
SLOW = {"max_num_seqs": 2, "ttft_ms": 80.0, "itl_ms": 40.0, "batch_factor": 0.5}
# Long prompts: prefill costs 0.05 ms per uncached token (20k tokens/s, an 8B model on one GPU) and it
# stalls the batch's decode, as chunked prefill does; a 2,000-token context costs 100 ms to prefill
# and a cache hit saves that. 64k tokens of KV each.
CACHED: dict[str, Any] = {"max_num_seqs": 8, "ttft_ms": 15.0, "itl_ms": 10.0, "batch_factor": 0.5,
          "prefill_ms_per_token": 0.05, "num_gpu_blocks": 4096, "block_size": 16, "max_model_len": 16384,
          "enable_prefix_caching": True, "kv_events_config": "", "enable_prompt_tokens_details": True}
# vLLM's KV-cache events, both sockets on ports the engine picks (routerd finds them through
# GET /kv_event_sources), on loopback only.
KV_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0",
                        "replay_endpoint": "tcp://127.0.0.1:0"})
CACHED["kv_events_config"] = KV_EVENTS

WORKLOADS = ("heterogeneous", "multiturn", "shared-prefix", "random", "cache-pressure")


@dataclass(frozen=True)
class Request:
    """One request of a plan: when it is meant to go, and what."""

    at: float  # first turn: send time, seconds from the start of the run
    body: bytes
    conversation: int  # its turns go in order; a one-off request is a conversation of one turn
    turn: int
    think_s: float  # later turns: sent this long after the previous turn's answer arrived
    prompt_tokens: int  # as the sim counts them
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    """What one workload runs on and how its plan is built (``plan(rate_rps, duration_s, seed)``)."""

    name: str
    fleet: list[dict[str, Any]]  # one SimConfig dict per instance
    kinds: list[str]  # a name per instance: "fast0", "slow2", "i1", …
    plan: Callable[[float, float, int], list[Request]]
    description: str
    kv_fill: float = 0.0  # > 0: each engine's KV is sized to the plan (fit_kv), else as in ``fleet``

    @property
    def kv_events(self) -> bool:
        """Whether the fleet's engines publish KV-cache events (routerd may route by them)."""
        return all(bool(k.get("kv_events_config")) for k in self.fleet)


def _vocabulary() -> tuple[str, ...]:
    # 4,096 made-up words: two texts drawn from it share nothing beyond chance.
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "su", "do", "gra", "bel", "tin",
                 "mor", "qua"]
    return tuple(a + b + c for a in syllables for b in syllables for c in syllables)[:4096]


WORDS = _vocabulary()


def text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choices(WORDS, k=max(1, tokens)))


def _n(tokens: float, scale: float) -> int:
    return max(1, round(tokens * scale))


def _chat(messages: list[dict[str, str]], max_tokens: int) -> bytes:
    # include_usage: the stream ends with its usage, where an engine says what its cache served
    return msgspec.json.encode({"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                                "stream": True, "stream_options": {"include_usage": True},
                                "ignore_eos": True})


def _poisson(rng: random.Random, rate: float, duration: float) -> list[float]:
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _tokens(messages: list[dict[str, str]]) -> int:
    return count_prompt_tokens(render_chat(messages))


def one_off(prompt_tokens: tuple[int, int], max_tokens: tuple[int, int], scale: float,
            prefixes: list[tuple[str, float]] | None = None) -> Callable[[float, float, int], list[Request]]:
    """Independent single-turn chats at Poisson times: a unique user message of ``prompt_tokens``
    (uniform range), after one of ``prefixes`` (system prompt, weight) when given."""

    def plan(rate: float, duration: float, seed: int) -> list[Request]:
        rng = random.Random(seed)
        out = []
        for i, at in enumerate(_poisson(rng, rate, duration)):
            messages = []
            if prefixes:
                system = rng.choices([p for p, _ in prefixes], weights=[w for _, w in prefixes])[0]
                messages.append({"role": "system", "content": system})
            messages.append({"role": "user", "content": text(rng, _n(rng.randint(*prompt_tokens), scale))})
            n_out = _n(rng.randint(*max_tokens), scale)
            out.append(Request(at=at, body=_chat(messages, n_out), conversation=i, turn=0, think_s=0.0,
                               prompt_tokens=_tokens(messages), max_tokens=n_out))
        return out

    return plan


def conversations(*, scale: float, engine_seed: int, apps: list[tuple[str, float]],
                  context_tokens: tuple[int, int] = (1000, 2000), turns: tuple[int, int] = (3, 6),
                  question_tokens: tuple[int, int] = (20, 80), answer_tokens: tuple[int, int] = (16, 48),
                  think_s: tuple[float, float] = (0.2, 0.6)) -> Callable[[float, float, int], list[Request]]:
    """Agent-like conversations starting at Poisson times (``rate`` is requests/s: conversations/s is
    that over the mean turn count). Each later turn goes ``think_s`` after the previous answer; its
    messages are everything before plus the answer the engines give (``expected_text``)."""
    mean_turns = (turns[0] + turns[1]) / 2

    def plan(rate: float, duration: float, seed: int) -> list[Request]:
        rng = random.Random(seed)
        out = []
        for c, start in enumerate(_poisson(rng, rate / mean_turns, duration)):
            system = rng.choices([a for a, _ in apps], weights=[w for _, w in apps])[0]
            context = text(rng, _n(rng.randint(*context_tokens), scale))
            question = text(rng, _n(rng.randint(*question_tokens), scale))
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"{context}\n\n{question}"}]
            think = 0.0
            for turn in range(rng.randint(*turns)):
                max_tokens = _n(rng.randint(*answer_tokens), scale)
                out.append(Request(at=start, body=_chat(messages, max_tokens), conversation=c, turn=turn,
                                   think_s=think, prompt_tokens=_tokens(messages), max_tokens=max_tokens))
                answer = expected_text(engine_seed, messages, max_tokens, ignore_eos=True)
                messages = [*messages, {"role": "assistant", "content": answer},
                            {"role": "user", "content": text(rng, _n(rng.randint(*question_tokens), scale))}]
                think = rng.uniform(*think_s)
        return out

    return plan


def _request_blocks(plan: Sequence[Request], block_size: int) -> list[tuple[Request, list[int]]]:
    """Each request with its prompt's full KV blocks (the sim's tokens, vLLM's block keys; any root:
    only which keys are equal counts), in the order they are sent: by conversation start, then turn."""
    root = block_hash.none_hash(None)
    out = []
    for r in sorted(plan, key=lambda r: (r.at, r.conversation, r.turn)):
        messages = msgspec.json.decode(r.body)["messages"]
        ids = token_ids(prompt_words(render_chat(messages)))
        out.append((r, block_hash.block_keys(ids, block_size, root)))
    return out


def prompt_blocks(plan: Sequence[Request], block_size: int) -> int:
    """How many distinct full KV blocks the plan's prompts make: what the fleet's caches would hold if
    every prompt were kept once."""
    return len({k for _, keys in _request_blocks(plan, block_size) for k in keys})


def hit_ceiling(plan: Sequence[Request], block_size: int) -> float:
    """The most a prefix cache can serve of the plan's prompt tokens: one cache that never evicts, each
    block missed once — a fleet hit ratio no router can pass (the unique openings must be computed)."""
    seen: set[int] = set()
    hit = total = 0
    for r, keys in _request_blocks(plan, block_size):
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hit += min(n * block_size, (r.prompt_tokens - 1) // block_size * block_size)
        total += r.prompt_tokens
        seen.update(keys)
    return round(hit / total, 4) if total else math.nan


def fit_kv(work: Workload, plan: Sequence[Request]) -> tuple[list[dict[str, Any]], float]:
    """``work.fleet`` with each engine's ``num_gpu_blocks`` set so that the plan's distinct prompt blocks
    fill ``work.kv_fill`` of the fleet's KV, but never below what a full batch of the plan's requests
    needs (of its mean length; the longest alone must fit too); and the fill that gives (the floor may
    lower it)."""
    size = int(work.fleet[0]["block_size"])
    blocks = prompt_blocks(plan, size)
    lengths = [math.ceil((r.prompt_tokens + r.max_tokens) / size) + 1 for r in plan] or [1]
    floor = max(max(int(k["max_num_seqs"]) for k in work.fleet) * round(sum(lengths) / len(lengths)),
                max(lengths))
    per_engine = max(floor, math.ceil(blocks / work.kv_fill / len(work.fleet)))
    fleet = [{**k, "num_gpu_blocks": per_engine, "max_model_len": min(k["max_model_len"], per_engine * size)}
             for k in work.fleet]
    return fleet, round(blocks / (per_engine * len(fleet)), 3)


def build(name: str, *, scale: float = 1.0, engine_seed: int = 0) -> Workload:
    """The workload ``name`` with every prompt and answer length multiplied by ``scale`` (tests use a
    small one)."""
    # System prompts depend on the name only, not on the run's seed: the same apps in every run.
    rng = random.Random(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))
    if name == "heterogeneous":
        fast, slow = {**FAST, "seed": engine_seed}, {**SLOW, "seed": engine_seed}
        fleet = [fast, fast, slow]
        return Workload(name, fleet, ["fast0", "fast1", "slow2"],
                        one_off((20, 60), (16, 64), scale),
                        "2 × (8 seqs, 10 ms/token) + 1 × (2 seqs, 40 ms/token), capacities not configured; "
                        "unique 20–60-token chats, 16–64 tokens out")
    cached = {**CACHED, "seed": engine_seed}
    fleet = [cached] * 4
    kinds = [f"i{i}" for i in range(4)]
    if name == "multiturn":
        apps = [(text(rng, _n(600, scale)), 0.85), (text(rng, _n(400, scale)), 0.15)]
        return Workload(name, fleet, kinds, conversations(scale=scale, engine_seed=engine_seed, apps=apps),
                        "4 × (8 seqs, 10 ms/token, prefill 0.05 ms/token, 64k-token KV); conversations of "
                        "3–6 turns, each opening with its own 1–2k-token context, the next turn 0.2–0.6 s "
                        "after an answer; two apps' system prompts (600, 400 tokens) at 85/15 %")
    if name == "shared-prefix":
        weights = (0.55, 0.25, 0.12, 0.08)
        prefixes = [(text(rng, _n(1000, scale)), w) for w in weights]
        return Workload(name, fleet, kinds, one_off((20, 80), (16, 48), scale, prefixes),
                        "4 × (8 seqs, 10 ms/token, prefill 0.05 ms/token); 4 system prompts of 1,000 "
                        "tokens at 55/25/12/8 % + a unique 20–80-token question")
    if name == "cache-pressure":
        apps = [(text(rng, _n(800, scale)), w) for w in (0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.05)]
        return Workload(name, fleet, kinds,
                        conversations(scale=scale, engine_seed=engine_seed, apps=apps,
                                      context_tokens=(1000, 3000), turns=(3, 8)),
                        "4 × (8 seqs, 10 ms/token, prefill 0.05 ms/token), KV sized so that the plan's "
                        "distinct prompt blocks fill 75 % of the fleet's; conversations of 3–8 turns, each "
                        "opening with its own 1–3k-token context; eight 800-token system prompts at "
                        "30/20/15/10/10/5/5/5 %", kv_fill=0.75)
    if name == "random":
        return Workload(name, fleet, kinds, one_off((300, 1000), (16, 48), scale),
                        "4 × (8 seqs, 10 ms/token, prefill 0.05 ms/token); unique 300–1,000-token prompts")
    raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
