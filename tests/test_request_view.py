"""The request view routing policies see: canonical rendering, block keys, token estimates, session."""

from __future__ import annotations

import itertools
import json
from typing import Any

import msgspec
import pytest

from routerd.config import RoutingConfig
from routerd.ingress.validate import ChatMessage, read_head
from routerd.routing.request import BYTES_PER_TOKEN, RequestViews, TokenRatio, render_chat

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SYSTEM = "You are the support assistant of a company that routes requests to engines. " * 12
CONTEXT = "The document under discussion explains how prefix caching keeps blocks of the prompt. " * 30


def views(**routing: Any) -> RequestViews:
    return RequestViews(RoutingConfig(**routing))


def view(v: RequestViews, body: dict[str, Any] | bytes, endpoint: str = CHAT, **kw: Any) -> Any:
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    return v.build("f", endpoint, read_head(endpoint, raw), **kw)


def conversation(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": CONTEXT + "What does it say?"}]
    for t in range(1, turns):
        messages += [{"role": "assistant", "content": f"Answer number {t}: it keeps them. " * 9},
                     {"role": "user", "content": f"And question {t}, which asks about eviction? " * 5}]
    return messages


def test_a_conversations_next_turn_extends_its_keys() -> None:
    """Turn n's prompt is a prefix of turn n+1's: every full block of turn n keeps its key, so an
    instance that saw turn n is found to hold all of them."""
    v = views(prefix_block_tokens=16)
    keys = [view(v, {"model": "m", "messages": conversation(t)}).block_keys for t in (1, 2, 3, 4)]
    for before, after in itertools.pairwise(keys):
        assert len(after) > len(before) > 0
        assert after[:len(before)] == before


def test_rendering_is_canonical_whatever_the_client_serialises() -> None:
    """Whitespace, key order, ASCII escapes, and text given as content parts do not change the keys:
    the engine's template sees the same messages."""
    v = views(prefix_block_tokens=16)
    messages = [*conversation(2), {"role": "user", "content": "Grüße — ça va? " * 40}]
    compact = msgspec.json.encode({"model": "m", "messages": messages})
    spaced = json.dumps({"messages": [{"content": m["content"], "role": m["role"]} for m in messages],
                         "model": "m"}, indent=2, ensure_ascii=True).encode()
    parts = msgspec.json.encode({"model": "m", "messages": [
        {"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]})
    a, b, c = (view(v, body) for body in (compact, spaced, parts))
    assert a.block_keys == b.block_keys == c.block_keys
    assert a.prompt_tokens == b.prompt_tokens == c.prompt_tokens


def test_different_prompts_share_no_key_and_a_shared_system_prompt_shares_its_blocks() -> None:
    v = views(prefix_block_tokens=16)
    one = view(v, {"model": "m", "messages": [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": "first " * 200}]}).block_keys
    two = view(v, {"model": "m", "messages": [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": "second " * 200}]}).block_keys
    other = view(v, {"model": "m", "messages": [{"role": "system", "content": "Another app. " * 80},
                                                {"role": "user", "content": "first " * 200}]}).block_keys
    shared = len("system\n" + SYSTEM + "\n") // (16 * BYTES_PER_TOKEN)
    assert one[:shared] == two[:shared]
    assert one[shared + 1:] != two[shared + 1:]
    assert not set(one) & set(other)
    # Two images are not alike just because their text is.
    img = [{"type": "text", "text": "look " * 100}, {"type": "image_url", "image_url": {"url": "http://a/1.png"}}]
    img2 = [img[0], {"type": "image_url", "image_url": {"url": "http://a/2.png"}}]
    assert render_chat([ChatMessage(role="user", content=img)]) != \
        render_chat([ChatMessage(role="user", content=img2)])


def test_reordered_blocks_do_not_look_alike() -> None:
    v = views(prefix_block_tokens=4)
    a, b = "A" * 16, "B" * 16
    ab = view(v, {"model": "m", "prompt": a + b}, COMPLETIONS).block_keys
    ba = view(v, {"model": "m", "prompt": b + a}, COMPLETIONS).block_keys
    aa = view(v, {"model": "m", "prompt": a + a + a}, COMPLETIONS).block_keys
    assert len(ab) == 2
    assert ab[1] != ba[1]
    assert len(set(aa)) == 3


def test_completion_prompts_text_ids_and_batches() -> None:
    v = views(prefix_block_tokens=8)
    text = view(v, {"model": "m", "prompt": "x" * 100, "max_tokens": 7}, COMPLETIONS)
    assert (text.prompt_tokens, text.prompt_bytes, text.max_tokens) == (25, 100, 7)
    assert len(text.block_keys) == 100 // 32
    ids = view(v, {"model": "m", "prompt": list(range(50))}, COMPLETIONS)
    assert (ids.prompt_tokens, ids.prompt_bytes, ids.block_tokens, len(ids.block_keys)) == (50, 0, 8.0, 6)
    longer = view(v, {"model": "m", "prompt": [*range(50), 7, 7, 7, 7, 7, 7, 7, 7]}, COMPLETIONS)
    assert longer.block_keys[:6] == ids.block_keys
    batch = view(v, {"model": "m", "prompt": ["x" * 100, "y" * 60]}, COMPLETIONS)
    assert batch.block_keys == text.block_keys
    assert batch.prompt_tokens == 40
    id_batch = view(v, {"model": "m", "prompt": [list(range(50)), [1, 2, 3]]}, COMPLETIONS)
    assert (id_batch.prompt_tokens, id_batch.block_keys) == (53, ids.block_keys)


def test_hashing_stops_at_the_configured_length() -> None:
    long_body = {"model": "m", "prompt": "word " * 20_000}  # ~25k tokens
    capped = view(views(prefix_block_tokens=64, prefix_hash_max_tokens=4096), long_body, COMPLETIONS)
    assert len(capped.block_keys) == 4096 // 64
    assert capped.prompt_tokens == 25_000  # counted whole, hashed only in part
    assert view(views(prefix_hash_max_tokens=0), long_body, COMPLETIONS).block_keys == ()
    short = view(views(prefix_block_tokens=64), {"model": "m", "prompt": "tiny"}, COMPLETIONS)
    assert short.block_keys == ()


def test_session_max_tokens_and_what_is_ignored() -> None:
    v = views()
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert view(v, {**base, "user": "alice"}).session == "alice"
    assert view(v, {**base, "user": "alice"}, session="conv-7").session == "conv-7"
    assert view(v, {**base, "user": 42}).session is None
    assert view(v, {**base, "max_completion_tokens": 33}).max_tokens == 33
    assert view(v, {**base, "max_tokens": "lots"}).max_tokens is None
    assert view(v, {**base, "max_tokens": True}).max_tokens is None
    odd = view(v, {"model": "m", "messages": [{"role": 5, "content": {"weird": 1}}]})
    assert odd.prompt_tokens > 0  # rendered anyway: the engine will judge it
    assert view(v, base, priority=3).priority == 3


@pytest.mark.parametrize(("tokens", "chars", "expected"), [
    (0.0, 0.0, 0.25),  # no evidence: the prior
    (30_000.0, 100_000.0, 0.3),
    (1.0, 100_000_000.0, 1 / 16),  # bounded
])
def test_token_ratio_learns_from_what_engines_count(tokens: float, chars: float, expected: float) -> None:
    r = TokenRatio()
    r.add(tokens, chars)
    assert r.value == pytest.approx(expected, rel=0.02)


def test_the_estimate_follows_the_learned_ratio() -> None:
    v = views()
    before = view(v, {"model": "m", "prompt": "z" * 4000}, COMPLETIONS)
    v.ratio("f").add(2_000_000, 4_000_000)
    after = view(v, {"model": "m", "prompt": "z" * 4000}, COMPLETIONS)
    assert before.prompt_tokens == 1000
    assert after.prompt_tokens == pytest.approx(2000, rel=0.01)
    assert after.block_keys == before.block_keys  # the blocks are fixed in bytes
    assert after.block_tokens == pytest.approx(2 * before.block_tokens, rel=0.01)


@pytest.mark.parametrize("prompt", [[1, 2, {"a": 1}, 4] * 20, [[1, [2]], [3]], [None] * 70])
def test_odd_prompts_are_routed_not_refused(prompt: list[Any]) -> None:
    """What is not a prompt the engine takes gets its 400 from the engine: routing just knows less."""
    v = view(views(prefix_block_tokens=8), {"model": "m", "prompt": prompt}, COMPLETIONS)
    assert v.fleet == "f"

