"""Keys the engine would compute: routerd keys a request before routing it exactly as the engine will
announce its blocks — the sim (its own tokens) and a Hugging Face tokenizer with the model's chat
template (checked against the real engine's own ``/tokenize``)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from routerd.ingress.validate import ChatHead, ChatMessage, CompletionHead
from routerd.routing.engine_cache import block_keys
from routerd.routing.engine_cache.keying_process import KeyingProcess
from routerd.vllm_wire import block_hash
from tests.fixtures.sim import SimEngineFactory
from tests.fixtures.vllm import VllmServer

ROOT = block_hash.none_hash(None)
CONVERSATION = [
    {"role": "system", "content": "You are careful. " * 12},
    {"role": "user", "content": "the router sends a request to the engine which streams tokens back " * 4},
    {"role": "assistant", "content": "ready again " * 10},
    {"role": "user", "content": "and each replica answers a batch of prompts with cache blocks " * 3},
]
KV = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0"})


def _chat() -> ChatHead:
    return ChatHead(model="m",
                    messages=[ChatMessage(role=m["role"], content=m["content"]) for m in CONVERSATION])


async def test_the_sim_keyer_predicts_the_blocks_the_sim_caches(sim_engine: SimEngineFactory) -> None:
    eng = await sim_engine(kv_events_config=KV, block_size=16)
    prompt = "the queue holds many users " * 30
    async with aiohttp.ClientSession() as s:
        body = {"messages": CONVERSATION, "max_tokens": 1}
        async with s.post(f"{eng.url}/v1/chat/completions", json=body) as r:
            assert r.status == 200
        chat_keys = block_keys.keys(block_keys.SimKeyer(), _chat(), 16, ROOT)
        assert len(chat_keys) > 5
        assert eng.engine.cached_block_keys() == set(chat_keys)
        async with s.post(f"{eng.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
            assert r.status == 200
    done_keys = block_keys.keys(block_keys.SimKeyer(), CompletionHead(model="m", prompt=prompt), 16, ROOT)
    assert len(done_keys) == 150 // 16
    assert eng.engine.cached_block_keys() == set(chat_keys) | set(done_keys)


async def test_a_long_prompt_is_keyed_off_the_loop_with_the_same_result() -> None:
    head = CompletionHead(model="m", prompt="many users " * 4000)
    keyer = block_keys.SimKeyer()
    assert block_keys.prompt_size(head) > block_keys.INLINE_MAX
    assert await block_keys.keys_for(keyer, head, 16, ROOT) == block_keys.keys(keyer, head, 16, ROOT)


def test_what_cannot_be_keyed_has_no_keys() -> None:
    keyer = block_keys.SimKeyer()
    assert block_keys.keys(keyer, CompletionHead(model="m", prompt=["a", "b"]), 16, ROOT) == ()
    assert block_keys.keys(keyer, CompletionHead(model="m", prompt="short"), 16, ROOT) == ()
    assert block_keys.load_keyer("vllm", None) is None
    assert block_keys.load_keyer("vllm", "/nonexistent") is None


def _engine_tokens(server: VllmServer, body: dict[str, object]) -> list[int]:
    """The token ids the engine itself makes of `body` (its `POST /tokenize`): what it hashes into blocks."""
    data = json.dumps({"model": server.model, **body}).encode()
    req = urllib.request.Request(server.url + "/tokenize", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        tokens: list[int] = json.loads(r.read())["tokens"]
    return tokens


@pytest.mark.vllm
def test_the_hf_keyer_tokenizes_as_the_engine_does(vllm_server: VllmServer, tiny_model_dir: Path) -> None:
    """The reference is the engine's own tokenizer (its chat template rendered with the generation
    prompt, no special tokens on top, as for a chat request; a completion prompt with them), not
    ``transformers``: the ids vLLM makes are the ones its KV blocks are hashed from."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    prompt = "hello world, the router sends a prompt"
    chat_ids = _engine_tokens(vllm_server, {"messages": CONVERSATION, "add_generation_prompt": True})
    prompt_ids = _engine_tokens(vllm_server, {"prompt": prompt, "add_special_tokens": True})
    keyer = block_keys.load_keyer("vllm", str(tiny_model_dir))
    assert isinstance(keyer, block_keys.HfKeyer)
    assert len(chat_ids) > 100  # the whole conversation, templated
    assert keyer.token_ids(_chat()) == chat_ids
    assert keyer.token_ids(CompletionHead(model="m", prompt=prompt)) == prompt_ids


def test_a_template_that_fails_on_the_messages_leaves_the_request_unkeyed(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}{{ m.content }}{{ no_such.thing }}{% endfor %}"}))
    keyer = block_keys.load_keyer("vllm", str(tmp_path))
    assert keyer is not None
    head = ChatHead(model="m", messages=[ChatMessage(role="user", content="hello " * 64)])
    assert block_keys.keys(keyer, head, 16, ROOT) == ()  # the template fails: no crash, no keys
    assert block_keys.keys(keyer, CompletionHead(model="m", prompt="hello " * 64), 16, ROOT) != ()


async def test_a_view_counts_at_least_the_engines_own_tokens() -> None:
    """The estimate from bytes (1 token per 4) would make a prompt of one-letter words half as long as
    the engine counts it — and an exact cache hit larger than the prompt."""
    from routerd.config import RoutingConfig
    from routerd.routing.request import RequestViews

    views = RequestViews(RoutingConfig())
    views.keyers["f"] = (block_keys.SimKeyer(), 16, ROOT)
    head = CompletionHead(model="m", prompt="a " * 100)
    plain = views.build("f", "/v1/completions", head)
    assert plain.prompt_tokens == 50
    keyed = await views.with_engine_keys(plain, head)
    assert len(keyed.engine_keys) == 99 // 16
    assert keyed.engine_block_tokens == 16
    assert keyed.prompt_tokens == keyed.engine_prompt_tokens == 100  # the engine's own count
    assert keyed.exact_tokens
    assert not plain.exact_tokens
    views.ratio("f").add(1.0, 1000.0)  # the learned ratio moves: the engine's count stays
    assert views.current(keyed).prompt_tokens == 100
    assert (await views.with_engine_keys(views.build("g", "/v1/completions", head), head)).engine_keys == ()


@pytest.mark.subprocess  # the keying process
async def test_a_keying_process_keys_as_the_thread_does_and_survives_its_worker() -> None:
    keyer = block_keys.SimKeyer()
    head = CompletionHead(model="m", prompt="many users " * 3000)
    expected = block_keys.keyed(keyer, head, 16, ROOT, hittable=True)
    assert expected.tokens == 6000
    assert len(expected.keys) == 5999 // 16
    kp = KeyingProcess({"f": keyer.spec}, timeout_s=60, restart_backoff_s=3600)
    try:
        # No request waits for the worker to start: until it is up, the caller keys in a thread.
        assert await kp.keyed("f", head, 16, ROOT, hittable=True) is None
        assert kp.failures == 0
        await kp.wait_ready(60)  # a spawned interpreter importing routerd
        assert await kp.keyed("f", head, 16, ROOT, hittable=True) == expected
        assert await kp.keyed("other", head, 16, ROOT) is None  # a fleet it does not key
        pool = kp._pool
        assert pool is not None
        for proc in list(pool._processes.values()):  # the worker dies
            proc.kill()
        assert await kp.keyed("f", head, 16, ROOT, hittable=True) is None  # the caller falls back
        assert kp.failures == 1
        # no new worker within the backoff: one that cannot start is not spawned again by each request
        assert await kp.keyed("f", head, 16, ROOT, hittable=True) is None
        assert kp._pool is None
        kp.restart_backoff_s = 0.0
        kp._restart_at = 0.0
        assert await kp.keyed("f", head, 16, ROOT, hittable=True) is None  # a new worker, starting
        assert kp._pool is not None
        await kp.wait_ready(60)  # a spawned interpreter importing routerd
        assert await kp.keyed("f", head, 16, ROOT, hittable=True) == expected
    finally:
        kp.close()


async def test_the_sims_usage_says_what_its_cache_served(sim_engine: SimEngineFactory) -> None:
    """``--enable-prompt-tokens-details``, as vLLM's: a stream's usage carries the prompt tokens its
    prefix cache served — what the routing benchmark holds routerd's predicted hit against."""
    from routerd_bench._common import timed_request

    eng = await sim_engine(enable_prompt_tokens_details=True, block_size=16)
    plain = await sim_engine(block_size=16)
    body = json.dumps({"model": "m", "prompt": "the queue holds many users " * 30, "max_tokens": 2,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    async with aiohttp.ClientSession() as s:
        first = await timed_request(s, f"{eng.url}/v1/completions", body, True)
        second = await timed_request(s, f"{eng.url}/v1/completions", body, True)
        without = await timed_request(s, f"{plain.url}/v1/completions", body, True)
    assert (first.prompt_tokens, first.cached_tokens) == (150, 0)
    assert (second.prompt_tokens, second.cached_tokens) == (150, 149 // 16 * 16)  # the last token computed
    assert (without.prompt_tokens, without.cached_tokens) == (150, -1)  # not reported, as vLLM's default
