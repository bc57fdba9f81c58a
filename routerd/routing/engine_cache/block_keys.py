"""The block keys an engine will compute for a request, computed by routerd before it routes it.

An engine's KV-cache events name its blocks by keys over its *tokens* (:mod:`routerd.vllm_wire.block_hash`),
so scoring a request against an engine's own cache view needs the request's tokens as the engine will
see them — the model's tokenizer, the chat rendered by the model's chat template — in process: a
``/tokenize`` call per request on the request path is what collapsed under concurrency elsewhere.

- :class:`SimKeyer`: the simulated engine's rendering and token ids (:mod:`routerd.sim_tokens`), exact.
- :class:`HfKeyer`: a Hugging Face model directory's ``tokenizer.json`` (``tokenizers``) and
  ``tokenizer_config.json`` chat template (``jinja2``), rendered the way ``transformers`` renders it
  for vLLM (``trim_blocks``, ``lstrip_blocks``, ``add_generation_prompt=True``), a chat tokenized
  without added special tokens (the template holds them), a completion prompt with them — as vLLM's
  renderer does. Both packages are optional (``pip install routerd[kv]``): without them, or without a
  tokenizer for the model, :func:`load_keyer` returns None and the fleet keeps the request-side model.

Cost: :func:`keyed_for` runs a long prompt's tokenizing and hashing in a thread, so the event loop
pays only the hand-off (``scripts/measure_keying.py`` measures both).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from ...openai import ChatHead, ChatMessage, CompletionHead
from ...vllm_wire import block_hash

# Prompts longer than this (UTF-8 bytes of text, or token ids) are keyed in a thread: measured, a few
# thousand bytes cost well under the event loop's budget inline, and a thread hand-off costs ~50 µs.
INLINE_MAX = 4096


class EngineKeyer(Protocol):
    """A fleet's tokenizer, as its engines tokenize: the prompt's token ids, or None (unusable).

    ``spec`` is what :func:`load_keyer` built it from, so another process can build the same one."""

    spec: tuple[str, str]

    def token_ids(self, head: CompletionHead | ChatHead) -> list[int] | None: ...


def _message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls is not None:
            d["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _single_prompt(prompt: Any) -> str | list[int] | None:
    """A completion's one prompt (a batch of one unwrapped), or None for a batch or a bad shape."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


class SimKeyer:
    """``routerd sim-engine``'s tokens: whitespace words of the prompt or its ChatML rendering."""

    spec = ("sim", "")

    def token_ids(self, head: CompletionHead | ChatHead) -> list[int] | None:
        from ...sim_tokens import prompt_words, render_chat, token_ids

        if isinstance(head, ChatHead):
            return token_ids(prompt_words(render_chat(_message_dicts(head.messages))))
        prompt = _single_prompt(head.prompt)
        return None if prompt is None else token_ids(prompt_words(prompt))


class HfKeyer:
    """A Hugging Face tokenizer directory, as vLLM tokenizes with it (see the module docstring)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.spec = ("vllm", str(model_dir))
        import jinja2
        import jinja2.sandbox
        from tokenizers import Tokenizer

        d = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = d / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        self.special = {k: v if isinstance(v, str) else (v or {}).get("content", "")
                        for k, v in cfg.items() if k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template) if isinstance(template, str) else None

    def render(self, messages: Sequence[ChatMessage]) -> str | None:
        """The chat as the template renders it; None when there is no template or it fails on these
        messages (the engine will answer that request itself; routing just cannot key it)."""
        import jinja2

        if self.template is None:
            return None
        try:
            return str(self.template.render(messages=_message_dicts(messages), add_generation_prompt=True,
                                            **self.special))
        except jinja2.TemplateError:
            return None

    def token_ids(self, head: CompletionHead | ChatHead) -> list[int] | None:
        if isinstance(head, ChatHead):
            text = self.render(head.messages)
            if text is None:
                return None
            return self._encode(text, add_special_tokens=False)
        prompt = _single_prompt(head.prompt)
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens=True)
        return prompt

    def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: it lets go of the GIL while the Rust tokenizer works, so keying in a
        # thread leaves the event loop free for all but the hashing
        return list(self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


def _raise(message: str) -> None:
    raise ValueError(message)


def load_keyer(engine: str, model_dir: str | None) -> EngineKeyer | None:
    """The keyer for a fleet: the sim's for ``sim``; a model directory's tokenizer for ``vllm`` when it
    has one and the optional packages are there; else None (the request-side model keeps routing)."""
    if engine == "sim":
        return SimKeyer()
    if not model_dir or not (Path(model_dir) / "tokenizer.json").exists():
        return None
    try:
        return HfKeyer(model_dir)
    except ImportError:
        return None


def prompt_size(head: CompletionHead | ChatHead) -> int:
    """About how much work keying is: the text's characters (or token ids) — to decide inline or not."""
    if isinstance(head, ChatHead):
        return sum(len(m.content) if isinstance(m.content, str) else 64 for m in head.messages)
    p = head.prompt
    return len(p) if isinstance(p, str | list) else 0


class Keyed(NamedTuple):
    """A request keyed as its engine will key it: the block keys, and the prompt's tokens as the engine
    counts them (what ``vllm:prompt_tokens`` and ``vllm:prefix_cache_queries`` add for it); ``tokens``
    is 0 when the keyer could not tokenize the prompt (no keys then either)."""

    keys: tuple[int, ...]
    tokens: int


def keyed(keyer: EngineKeyer, head: CompletionHead | ChatHead, block_size: int, root: bytes, *,
          hittable: bool = False, pause: Callable[[], None] | None = None,
          extra: block_hash.ExtraKeys | None = None) -> Keyed:
    """The request's block keys as the engine will announce them (empty when it cannot be keyed), and
    its prompt's tokens.

    ``hittable``: only the blocks a cache hit can cover — vLLM computes a prompt's last token whatever
    it holds, so of a prompt of *n* tokens at most ⌊(n−1)/block⌋ blocks are ever served from cache.
    ``extra``: the blocks' extra keys as the engine hashes them (a LoRA request's:
    ``block_hash.lora_extra``)."""
    try:
        ids = keyer.token_ids(head)
    except (ValueError, TypeError, LookupError):  # a template refusing the messages: the engine will too
        return Keyed((), 0)
    if not ids:
        return Keyed((), 0)
    hashed = ids[:-1] if hittable else ids
    keys = tuple(block_hash.block_keys(hashed, block_size, root, pause=pause, extra=extra)) if hashed else ()
    return Keyed(keys, len(ids))


def keys(keyer: EngineKeyer, head: CompletionHead | ChatHead, block_size: int, root: bytes, *,
         hittable: bool = False, pause: Callable[[], None] | None = None) -> tuple[int, ...]:
    """:func:`keyed`'s keys alone."""
    return keyed(keyer, head, block_size, root, hittable=hittable, pause=pause).keys


async def keyed_for(keyer: EngineKeyer, head: CompletionHead | ChatHead, block_size: int,
                    root: bytes, *, hittable: bool = False,
                    extra: block_hash.ExtraKeys | None = None) -> Keyed:
    """:func:`keyed`, in a thread when the prompt is long (the request waits as long either way; the
    loop waits less — see the module docstring for what that buys under the GIL)."""
    if prompt_size(head) <= INLINE_MAX:
        return keyed(keyer, head, block_size, root, hittable=hittable, extra=extra)
    work = functools.partial(keyed, hittable=hittable, pause=_yield_gil, extra=extra)
    return await asyncio.to_thread(work, keyer, head, block_size, root)


async def keys_for(keyer: EngineKeyer, head: CompletionHead | ChatHead, block_size: int,
                   root: bytes, *, hittable: bool = False) -> tuple[int, ...]:
    """:func:`keyed_for`'s keys alone."""
    return (await keyed_for(keyer, head, block_size, root, hittable=hittable)).keys


def _yield_gil() -> None:
    time.sleep(0)  # releases the GIL: the event loop's thread runs if it was waiting for it
