"""The OpenAI Batch API on routerd (issue 31): the ``openai`` client unchanged against real ``routerd
run`` processes on one real Redis, in front of simulated engines — whose answers are deterministic per
prompt, so every output line is checked for the right answer."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from routerd.sim_tokens import generate
from routerd.status import render
from tests.fixtures.daemon import RouterdFactory, RouterdProcess
from tests.fixtures.helpers import until
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.sim import SimProcessFactory

MODEL = "m"


def _answer(prompt: str, max_tokens: int) -> str:
    """What the sim engine (seed 0, no EOS) answers ``prompt`` with."""
    return "".join(generate(0, prompt, max_tokens)[0])


def _line(i: int, *, endpoint: str = "/v1/completions", max_tokens: int = 3, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens}
    if endpoint == "/v1/completions":
        body["prompt"] = f"line {i} of the batch"
    else:
        body["messages"] = [{"role": "user", "content": f"line {i}"}]
    return {"custom_id": f"req-{i}", "method": "POST", "url": endpoint, "body": {**body, **extra}}


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def _config(routerd_config: Any, redis_server: RedisServer, tmp_path: Path, name: str, sim_url: str,
            **batches: Any) -> dict[str, Any]:
    return routerd_config(
        daemon={"state_dir": str(tmp_path / name)},
        http={"max_body_bytes": 4096},
        redis={"enabled": True, "url": redis_server.url, "consumer": name, "block_ms": 200},
        batches={"poll_s": 0.2, "lease_s": 2.0, **batches},
        tenants=[{"name": "a", "api_keys": ["sk-a"]}, {"name": "b", "api_keys": ["sk-b"]}],
        fleets=[{"name": "f", "model": MODEL, "engine": "static", "urls": [sim_url]}])


def _client(rp: RouterdProcess, key: str = "sk-a") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=rp.url + "/v1", api_key=key, max_retries=0, timeout=30)


async def _until_final(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.1)


async def _output(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(x) for x in content.text.splitlines()]


@pytest.mark.timeout(180)
async def test_the_openai_client_runs_batches_and_bad_input_gets_clear_errors(
        redis_server: RedisServer, routerd_process: RouterdFactory, routerd_config: Any,
        sim_process: SimProcessFactory, tmp_path: Path) -> None:
    """One routerd for both (each start costs seconds): the client's whole round, then item 6."""
    sim = await sim_process(model=MODEL, max_num_seqs=64, ttft_ms=1, itl_ms=1)
    rp = await asyncio.to_thread(routerd_process, _config(
        routerd_config, redis_server, tmp_path, "r1", sim.url, max_file_bytes=100_000,
        tenant_quota_bytes=150_000, lines_in_flight=20))
    lines = [_line(i) for i in range(40)] + [_line(i, endpoint="/v1/chat/completions") for i in range(40, 50)]
    for x in lines[40:]:
        x["url"] = "/v1/chat/completions"
    async with _client(rp) as a, _client(rp, "sk-b") as b:
        uploaded = await a.files.create(file=("in.jsonl", _jsonl(lines[:40])), purpose="batch")
        assert uploaded.object == "file"
        assert uploaded.bytes == len(_jsonl(lines[:40]))
        assert uploaded.purpose == "batch"
        assert (await a.files.retrieve(uploaded.id)).id == uploaded.id
        batch = await a.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                       completion_window="24h", metadata={"job": "nightly"})
        assert batch.status == "validating"
        assert batch.metadata == {"job": "nightly"}
        # a second batch on the same file while the first runs: allowed, as OpenAI does
        again = await a.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                       completion_window="24h")
        chat_file = await a.files.create(file=("chat.jsonl", _jsonl(lines[40:])), purpose="batch")
        chat = await a.batches.create(input_file_id=chat_file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")

        # another tenant sees none of it
        with pytest.raises(openai.NotFoundError):
            await b.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            await b.files.content(uploaded.id)
        assert (await b.batches.list()).data == []

        done = await _until_final(a, batch.id)
        assert done.status == "completed", done
        assert done.request_counts is not None
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (40, 40, 0)
        assert done.in_progress_at
        assert done.finalizing_at
        assert done.completed_at
        assert done.error_file_id is None
        out = await _output(a, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(40))
        for x in out:
            i = int(x["custom_id"].split("-")[1])
            assert x["error"] is None
            assert x["response"]["status_code"] == 200
            assert x["response"]["body"]["choices"][0]["text"] == _answer(f"line {i} of the batch", 3)
        assert (await _until_final(a, again.id)).request_counts.completed == 40  # type: ignore[union-attr]
        chat_done = await _until_final(a, chat.id)
        assert chat_done.status == "completed"
        chat_out = await _output(a, chat_done.output_file_id)
        assert len(chat_out) == 10
        assert all(x["response"]["body"]["choices"][0]["message"]["content"] for x in chat_out)

        listed = await a.batches.list(limit=2)
        assert [x.id for x in listed.data] == [chat.id, again.id]
        assert listed.has_more
        rest = await a.batches.list(after=again.id)
        assert [x.id for x in rest.data] == [batch.id]
        files = {f.id: f.purpose for f in (await a.files.list()).data}
        assert files[uploaded.id] == "batch"
        assert files[done.output_file_id] == "batch_output"  # type: ignore[index]

        # cancelling a finished batch is refused and changes nothing
        with pytest.raises(openai.ConflictError, match="completed"):
            await a.batches.cancel(batch.id)
        assert (await a.batches.retrieve(batch.id)).status == "completed"

        deleted = await a.files.delete(uploaded.id)
        assert deleted.deleted
        with pytest.raises(openai.NotFoundError):
            await a.files.retrieve(uploaded.id)

        # both are the runner's sample, taken every poll_s (a scrape never waits on Redis): on a busy
        # machine the last batch's end reaches the API before the next sample
        async def sampled() -> bool:
            return 'routerd_batches{state="completed"} 3.0' in await _get(rp, "/metrics") and \
                "batches: completed=3" in render(json.loads(await _get(rp, "/admin/fleets")))

        await until(sampled, 30, "the three completed batches in /metrics and routerd status")
        await _bad_input(a, b)


async def _get(rp: RouterdProcess, path: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(rp.url + path) as r:
        return await r.text()


async def _bad_input(a: openai.AsyncOpenAI, b: openai.AsyncOpenAI) -> None:
    """Issue 31 item 6: each bad input gets a clear error, and nothing already done is lost."""
    good = await a.files.create(file=("good.jsonl", _jsonl([_line(i) for i in range(5)])),
                                purpose="batch")
    # a file that is not JSONL, and one with a line over the body limit (4096 bytes here), another
    # endpoint's line, a duplicate custom_id and a model nobody serves: failed, the lines named
    bad = b"this is not json\n" + _jsonl([
        _line(1), _line(2, prompt="x" * 5000), {**_line(3), "url": "/v1/chat/completions"}, _line(1),
        _line(5, model="nope")])
    bad_file = await a.files.create(file=("bad.jsonl", bad), purpose="batch")
    failed = await _until_final(a, (await a.batches.create(
        input_file_id=bad_file.id, endpoint="/v1/completions", completion_window="24h")).id)
    assert failed.status == "failed"
    assert failed.failed_at
    assert failed.errors is not None
    by_line = {e.line: e.code for e in failed.errors.data or []}
    assert by_line == {1: "invalid_json_line", 3: "request_too_large", 4: "mismatched_endpoint",
                       5: "duplicate_custom_id", 6: "model_not_found"}
    assert failed.output_file_id is None

    with pytest.raises(openai.NotFoundError, match="No such File"):
        await a.batches.create(input_file_id="file-nope", endpoint="/v1/completions",
                               completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):  # a route routerd does not serve
        await a.batches.create(input_file_id=good.id, endpoint="/v1/moderations",  # type: ignore[arg-type]
                               completion_window="24h")
    # too big, and past the tenant's quota (b has stored nothing yet): refused while read, nothing kept
    with pytest.raises(openai.APIStatusError, match="max_file_bytes") as too_big:
        await b.files.create(file=("big.jsonl", b"x" * 120_000), purpose="batch")
    assert too_big.value.status_code == 413
    kept = await b.files.create(file=("ok.jsonl", b"y" * 90_000), purpose="batch")
    with pytest.raises(openai.APIStatusError, match="quota"):
        await b.files.create(file=("more.jsonl", b"z" * 90_000), purpose="batch")
    assert [f.id for f in (await b.files.list()).data] == [kept.id]
    await b.files.delete(kept.id)
    assert (await b.files.list()).data == []

    # an expired file: gone, and no batch on it
    short = await a.files.create(file=("short.jsonl", _jsonl([_line(0)])), purpose="batch",
                                 extra_body={"expires_after": {"anchor": "created_at", "seconds": 1}})
    assert short.expires_at
    await asyncio.sleep(2.1)
    with pytest.raises(openai.BadRequestError, match="expired"):
        await a.batches.create(input_file_id=short.id, endpoint="/v1/completions",
                               completion_window="24h")

    # the good file still runs to the end after all of that
    done = await _until_final(a, (await a.batches.create(
        input_file_id=good.id, endpoint="/v1/completions", completion_window="24h")).id)
    assert done.status == "completed"
    assert len(await _output(a, done.output_file_id)) == 5
    with pytest.raises(openai.ConflictError):
        await a.batches.cancel(failed.id)

    # a cancel: no line is fed any more, what was done is written, the batch ends cancelled
    slow_lines = _jsonl([_line(i, max_tokens=100) for i in range(300)])
    slow = await a.files.create(file=("slow.jsonl", slow_lines), purpose="batch")
    running = await a.batches.create(input_file_id=slow.id, endpoint="/v1/completions",
                                     completion_window="24h")
    deadline = time.monotonic() + 60
    while (await a.batches.retrieve(running.id)).request_counts.completed == 0:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert (await a.batches.cancel(running.id)).status == "cancelling"
    cancelled = await _until_final(a, running.id)
    assert cancelled.status == "cancelled"
    assert cancelled.cancelled_at
    out = await _output(a, cancelled.output_file_id)
    assert len(out) == cancelled.request_counts.completed < 300  # type: ignore[union-attr]
    assert len({x["custom_id"] for x in out}) == len(out)


async def _holder(r: aioredis.Redis, batch_id: str) -> str:
    raw = await r.get(f"routerd:batchrun:{batch_id}:lease")
    return raw.decode().split()[0] if raw else ""


@pytest.mark.timeout(180)
async def test_a_batch_survives_the_sigkill_of_the_routerd_running_it(
        redis_server: RedisServer, redis_async: aioredis.Redis, routerd_process: RouterdFactory,
        routerd_config: Any, sim_process: SimProcessFactory, tmp_path: Path) -> None:
    """2,000 lines; the routerd running the batch is SIGKILLed mid-way; the other one finishes it: the
    output has every line once, each with its prompt's answer."""
    n = 2000
    sim = await sim_process(model=MODEL, max_num_seqs=256, ttft_ms=1, itl_ms=5)
    pair = [routerd_process(_config(routerd_config, redis_server, tmp_path, name, sim.url,
                                    lines_in_flight=200), wait_ready=False) for name in ("r1", "r2")]
    await asyncio.gather(*(asyncio.to_thread(rp.wait_notify, "READY=1", 120) for rp in pair))
    async with _client(pair[0]) as a:
        upload = await a.files.create(file=("in.jsonl", _jsonl([_line(i) for i in range(n)])),
                                      purpose="batch")
        batch = await a.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                       completion_window="24h")
        deadline = time.monotonic() + 60
        while (await a.batches.retrieve(batch.id)).request_counts.completed < n // 5:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, pair[0].log()
            await asyncio.sleep(0.05)
    runner = await _holder(redis_async, batch.id)
    doomed, survivor = pair if runner == "r1" else pair[::-1]
    doomed.proc.send_signal(signal.SIGKILL)
    doomed.proc.wait(10)
    written = int(await redis_async.hget(f"routerd:batch:{batch.id}", "completed") or 0)
    assert written < n, "the batch ended before its runner was killed: nothing was tested"
    async with _client(survivor) as a:
        done = await _until_final(a, batch.id, timeout=120)
        assert done.status == "completed", survivor.log()
        assert done.request_counts.completed == n  # type: ignore[union-attr]
        out = await _output(a, done.output_file_id)
    assert len(out) == n
    assert len({x["custom_id"] for x in out}) == n
    for x in out:
        i = int(x["custom_id"].split("-")[1])
        assert x["response"]["body"]["choices"][0]["text"] == _answer(f"line {i} of the batch", 3), x
    assert await _holder(redis_async, batch.id) == ""


@pytest.mark.timeout(120)
async def test_lines_not_done_when_the_window_ends_are_written_as_expired(
        redis_server: RedisServer, routerd_process: RouterdFactory, routerd_config: Any,
        sim_process: SimProcessFactory, tmp_path: Path) -> None:
    sim = await sim_process(model=MODEL, max_num_seqs=8, ttft_ms=1, itl_ms=50)
    rp = await asyncio.to_thread(routerd_process, _config(routerd_config, redis_server, tmp_path, "r1",
                                                          sim.url, window_s=8, lines_in_flight=2))
    # two quick lines, then eight that take ~50 s each: those cannot be done in the window
    lines = [_line(i, max_tokens=1) for i in range(2)] + [_line(i, max_tokens=1000) for i in range(2, 10)]
    async with _client(rp) as a:
        upload = await a.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
        batch = await a.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                       completion_window="24h")
        done = await _until_final(a, batch.id, timeout=60)
        assert done.status == "expired"
        assert done.expired_at
        counts = done.request_counts
        assert counts is not None
        assert counts.completed + counts.failed == 10
        assert counts.failed >= 8
        out = await _output(a, done.output_file_id)
        errors = await _output(a, done.error_file_id)
    assert len(out) == counts.completed
    for x in out:
        prompt = f"line {x['custom_id'][4:]} of the batch"
        assert x["response"]["body"]["choices"][0]["text"] == _answer(prompt, 1)
    assert {x["error"]["code"] for x in errors} == {"batch_expired"}
    assert all(x["response"] is None for x in errors)
    assert sorted(x["custom_id"] for x in out + errors) == sorted(f"req-{i}" for i in range(10))
