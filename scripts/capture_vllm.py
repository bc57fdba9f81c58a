"""Capture what a real `vllm serve` answers, so the simulated engine can be checked against it.

Why: routerd's tests run against `routerd.sim`, a fake vLLM. A fake drifts unless something pins
it to the real thing; `tests/test_sim_fidelity.py` compares the sim with the files this script
writes into `tests/data/vllm/` (metrics exposition, JSON bodies, raw SSE bytes, error bodies, and
a `manifest.json` with status codes and content types). Re-run it when the vLLM version changes.

    python scripts/capture_vllm.py [--vllm-bin .venv-vllm/bin/vllm] [--model DIR] [--out tests/data/vllm]

Only the standard library (and routerd's stdlib-only ``routerd._net``) is used, with blocking urllib
and a timeout on every call, so it runs with either venv. It starts the engine in its own session,
stops it with SIGTERM and fails if any process of that session is left.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # routerd's own port helper (stdlib only) from this checkout, in either venv
from routerd._net import free_port  # noqa: E402  # importable only once ROOT is on the path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture_routes import SETS, CaptureSet, Step, resolve  # noqa: E402  # the script's own directory

SERVED_NAME = "tiny"
MODEL_PLACEHOLDER = "/models/tiny"  # the temp model dir is replaced by this so captures are stable
HTTP_TIMEOUT_S = 60.0


def serve_command(vllm_bin: Path, model_dir: Path, port: int) -> list[str]:
    """The engine flags from the brief: small, eager (fast start), float32 on CPU."""
    return [
        str(vllm_bin),
        "serve",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--max-num-seqs",
        "8",
    ]


def serve_env(scratch: Path) -> dict[str, str]:
    """No hub, no usage stats, 1 GiB KV cache (the minimum: parsed as int GiB), caches in scratch."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=str(scratch / "vllm_cache"),
        TMPDIR=str(scratch),  # vLLM leaves a vllm_dist_<hex> file per start in the temp dir
    )
    return env


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


def request(
    url: str, method: str = "GET", body: bytes | None = None, timeout: float = HTTP_TIMEOUT_S,
    content_type: str = "application/json",
) -> Response:
    """One HTTP call returning status, headers and the raw (de-chunked) body, errors included."""
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Response(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read())
    except urllib.error.HTTPError as e:
        return Response(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


def wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout_s: float) -> float:
    """Poll /health until 200; returns seconds waited. Fails fast if the engine exits."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} before /health answered")
        try:
            if request(base + "/health", timeout=2.0).status == 200:
                return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"/health not 200 after {timeout_s:.0f} s")


def session_alive(sid: int) -> list[int]:
    """PIDs still in the engine's session (it was started with start_new_session=True)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state ppid pgrp session
            alive.append(int(entry.name))
    return alive


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> list[int]:
    """SIGTERM the API server (it shuts its engine core and worker down); returns leftover PIDs."""
    sid = proc.pid
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    left = session_alive(sid)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = session_alive(sid)
    for pid in left:  # only processes of the session we started
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


COMPLETION = {"model": SERVED_NAME, "prompt": "hello world", "max_tokens": 8, "temperature": 0}
CHAT = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "hello world"}],
    "max_tokens": 8,
    "temperature": 0,
}
USAGE = {"stream_options": {"include_usage": True}}


def capture_plan() -> tuple[Step, ...]:
    """Completions and chat. Order matters: /metrics comes last, after what it counts."""

    def js(obj: dict[str, Any]) -> str:
        return json.dumps(obj)

    steps = [
        ("health", "GET", "/health", None),
        ("models.json", "GET", "/v1/models", None),
        ("version.json", "GET", "/version", None),
        ("completion.json", "POST", "/v1/completions", js(COMPLETION)),
        ("completion_stream.sse", "POST", "/v1/completions", js({**COMPLETION, "stream": True})),
        (
            "completion_stream_usage.sse",
            "POST",
            "/v1/completions",
            js({**COMPLETION, "stream": True, **USAGE}),
        ),
        ("chat.json", "POST", "/v1/chat/completions", js(CHAT)),
        ("chat_stream.sse", "POST", "/v1/chat/completions", js({**CHAT, "stream": True})),
        ("chat_stream_usage.sse", "POST", "/v1/chat/completions", js({**CHAT, "stream": True, **USAGE})),
        ("error_unknown_model.json", "POST", "/v1/completions", js({**COMPLETION, "model": "no-such-model"})),
        ("error_chat_unknown_model.json", "POST", "/v1/chat/completions", js({**CHAT, "model": "nope"})),
        ("error_malformed_json.json", "POST", "/v1/completions", '{"model": "tiny", "prompt": '),
        ("error_chat_malformed_json.json", "POST", "/v1/chat/completions", "{not json"),
        ("error_missing_field.json", "POST", "/v1/chat/completions", js({"model": SERVED_NAME})),
        ("error_completion_missing_prompt.json", "POST", "/v1/completions", js({"model": SERVED_NAME})),
        ("error_wrong_type.json", "POST", "/v1/completions", js({**COMPLETION, "max_tokens": "eight"})),
        ("error_too_long.json", "POST", "/v1/completions", js({**COMPLETION, "max_tokens": 1000})),
        # Errors found before a stream starts are plain JSON even when "stream": true was asked for.
        (
            "error_stream_unknown_model.json",
            "POST",
            "/v1/chat/completions",
            js({**CHAT, "model": "nope", "stream": True}),
        ),
        (
            "error_stream_too_long.json",
            "POST",
            "/v1/completions",
            js({**COMPLETION, "max_tokens": 1000, "stream": True}),
        ),
        (
            "error_prompt_too_long.json",
            "POST",
            "/v1/completions",
            js({**COMPLETION, "prompt": "hello world " * 300}),
        ),
        ("load.json", "GET", "/load", None),
        ("metrics.txt", "GET", "/metrics", None),
    ]
    return tuple(Step(*s) for s in steps)


def capture(base: str, out: Path, model_dir: Path, steps: tuple[Step, ...]) -> dict[str, Any]:
    """Run the steps and write one file per step; returns the manifest's `files` section.

    A step may refer to an earlier answer (``{{file:key}}``, see capture_routes.py): the manifest
    keeps the template beside what was sent, so a replay can fill it from its own answers."""
    files: dict[str, Any] = {}
    answers: dict[str, Any] = {}
    for step in steps:
        path = resolve(step.path, answers, in_body=False)
        text = None if step.body is None else resolve(step.body, answers, in_body=True)
        charset = "latin-1" if "multipart" in step.content_type else "utf-8"  # a form holds raw bytes
        body = None if text is None else text.encode(charset)
        resp = request(base + path, step.method, body, content_type=step.content_type)
        data = resp.body.replace(str(model_dir).encode(), MODEL_PLACEHOLDER.encode())
        fname = step.name if "." in step.name else step.name + ".txt"
        (out / fname).write_bytes(data)
        if fname.endswith(".json"):
            with contextlib.suppress(ValueError):
                answers[fname] = json.loads(data)
        files[fname] = {
            "method": step.method,
            "path": path,
            "request": text,
            "status": resp.status,
            "content_type": resp.headers.get("content-type"),
            # Everything but the volatile ones, so a relay can be checked header by header.
            "headers": {k: v for k, v in sorted(resp.headers.items()) if k not in ("date", "content-length")},
            "bytes": len(data),
        }
        if step.content_type != "application/json":
            files[fname]["request_content_type"] = step.content_type
        if text != step.body or path != step.path:
            files[fname]["template"] = {"path": step.path, "request": step.body}
        print(f"{resp.status} {step.method} {path} -> {fname} ({len(data)} bytes)")
    return files


def vllm_version(base: str) -> str:
    """What the running server says (``GET /version``): no second ``import vllm``, which took over
    two minutes on a loaded machine."""
    resp = request(base + "/version")
    version: str = json.loads(resp.body).get("version", "unknown") if resp.status == 200 else "unknown"
    return version


def build_model(vllm_bin: Path, dest: Path) -> None:
    py = vllm_bin.parent / "python"
    subprocess.run(
        [str(py), str(ROOT / "scripts" / "make_tiny_model.py"), str(dest)], check=True, timeout=300
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="capture real vLLM responses for the sim fidelity test")
    parser.add_argument(
        "--vllm-bin",
        type=Path,
        default=Path(os.environ.get("ROUTERD_VLLM_BIN", ROOT / ".venv-vllm/bin/vllm")),
    )
    parser.add_argument("--model", type=Path, help="model dir (default: build the tiny model)")
    parser.add_argument("--set", dest="capture_set", choices=["base", *SETS], default="base",
                        help="base: completions and chat; generate, pooling, classify: the other routes "
                        "(each its own engine and directory under tests/data/vllm/)")
    parser.add_argument("--out", type=Path, help="default tests/data/vllm (base), else its set's dir there")
    parser.add_argument("--startup-timeout", type=float, default=240.0)
    args = parser.parse_args(argv)
    base_set = CaptureSet("base", "", steps=capture_plan())
    plan = base_set if args.capture_set == "base" else SETS[args.capture_set]
    args.out = args.out or ROOT / "tests/data/vllm" / plan.subdir
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="routerd-capture-"))
    model_dir = args.model or scratch / "model"
    proc: subprocess.Popen[bytes] | None = None
    left: list[int] = []
    try:
        if args.model is None:
            build_model(args.vllm_bin, model_dir)
        port = free_port()
        cmd = [*serve_command(args.vllm_bin, model_dir, port), *plan.extra_args]
        env = {**serve_env(scratch), **plan.extra_env}
        with (scratch / "vllm.log").open("wb") as log:  # the child keeps its own copy of the fd
            proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        base = f"http://127.0.0.1:{port}"
        startup_s = wait_healthy(base, proc, args.startup_timeout)
        print(f"vllm healthy after {startup_s:.1f} s")
        files = capture(base, args.out, model_dir, plan.steps)
        version = vllm_version(base)
        left = stop(proc)
        manifest = {
            "set": plan.name,
            "vllm_version": version,
            "command": [
                MODEL_PLACEHOLDER if c == str(model_dir) else "<port>" if c == str(port) else c
                for c in cmd[1:]
            ],
            "env": {
                k: "<tmp>" if "ROOT" in k else v
                for k, v in env.items()
                if k.startswith(("VLLM_", "HF_"))
            },
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "startup_s": round(startup_s, 1),
            "shutdown_left_processes": left,
            "files": files,
            "order": list(files),  # the replay order for the fidelity test
        }
        (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    except Exception:
        if proc is not None:
            sys.stderr.write((scratch / "vllm.log").read_text(errors="replace")[-4000:])
        raise
    finally:
        if proc is not None:
            left = stop(proc) or left
        shutil.rmtree(scratch, ignore_errors=True)
    if left:
        print(f"FAIL: processes left after SIGTERM: {left}", file=sys.stderr)
        return 1
    print(f"captured into {args.out}; no vllm process left")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
