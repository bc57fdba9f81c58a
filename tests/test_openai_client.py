"""The official ``openai`` client against routerd (in front of simulated engines): it must just work."""

from __future__ import annotations

import openai
import pytest

from tests.fixtures.dataplane import PlaneFactory, SimFactory


@pytest.fixture
async def base_url(sims: SimFactory, dataplane: PlaneFactory) -> str:
    engines = [await sims(model="sim-small"), await sims(model="sim-small")]
    plane = await dataplane([e.url for e in engines], model="sim-small", http={"api_keys": ["sk-test"]})
    return plane.url + "/v1"


async def test_completions_and_chat_streaming_and_not(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="sk-test", max_retries=0) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim-small"]

        comp = await client.completions.create(model="sim-small", prompt="Once upon", max_tokens=5)
        assert comp.choices[0].text
        assert comp.usage is not None
        assert comp.usage.completion_tokens == 5

        chat = await client.chat.completions.create(
            model="sim-small", messages=[{"role": "user", "content": "hi"}], max_tokens=6)
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content

        stream = await client.completions.create(model="sim-small", prompt="Once", max_tokens=7, stream=True)
        texts = [c.choices[0].text async for c in stream if c.choices]
        assert len(texts) == 7
        assert "".join(texts)

        chat_stream = await client.chat.completions.create(
            model="sim-small", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in chat_stream]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 4


async def test_errors_surface_as_openai_exceptions(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="sk-test", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError, match="Valid models: sim-small"):
            await client.completions.create(model="nope", prompt="x", max_tokens=1)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.completions.create(model="sim-small", prompt="x", max_tokens=1)
