"""The simulated engine's tokenizer and deterministic "model output": what it generates is a pure
function of its inputs. A floor module rather than part of ``routerd/sim/``: routing keys a request for
a sim fleet with these very token ids (``routing/engine_cache/block_keys.py``), as it keys a vLLM
fleet's with the model's own tokenizer.

Tests on the router, the queue and failover need to know *exactly* what should reach a client, so the
text depends only on (seed, prompt or rendered chat messages, max_tokens, stop, eos settings) and never
on timing, batching or which instance served it. :func:`expected_text` is the function tests call.

Tokenization is deliberately simple (whitespace words) — the sim needs token *counts* that grow with the
prompt, not a real vocabulary. Chat messages are rendered with ChatML, as the tiny test model does.

Generation is autoregressive like a greedy model's: each token is a function of the seed and the whole
context before it (prompt words, then the words generated so far). So a request whose prompt is another
request's prompt plus the first part of its output — what routerd sends to continue a stream on
another instance — generates exactly the rest of that output, as vLLM at temperature 0 does. The
context is folded into a CRC-32 word by word (one C call over a long prompt, one per token after).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

# A small vocabulary of plain words: generated text is readable and never contains a stop-looking
# sequence by accident unless a test asks for one.
VOCAB: tuple[str, ...] = (
    "the", "router", "sends", "a", "request", "to", "engine", "which", "streams", "tokens", "back",
    "while", "queue", "holds", "many", "users", "and", "each", "replica", "answers", "batch", "of",
    "prompts", "with", "cache", "blocks", "in", "time", "model", "reply", "metrics", "show", "load",
    "fleet", "drains", "slowly", "fast", "one", "two", "three", "more", "less", "ready", "again",
)

Messages = Sequence[dict[str, Any]]


def render_chat(messages: Messages, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """ChatML, like vLLM applying the tiny model's template: by default with the assistant turn opened;
    ``continue_final_message`` leaves the last message open instead (its text is continued)."""
    parts = [f"<|im_start|>{m.get('role', '')}\n{_content_text(m.get('content'))}<|im_end|>\n"
             for m in messages]
    if continue_final_message and parts:
        parts[-1] = parts[-1][:-len("<|im_end|>\n")]
        return "".join(parts)
    return "".join(parts) + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _content_text(content: Any) -> str:
    # OpenAI allows content as a list of parts; only text parts carry tokens here.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(t for p in content if isinstance(p, dict) and isinstance(t := p.get("text"), str))
    return str(content)


def prompt_words(prompt: str | Sequence[int]) -> list[str]:
    """The prompt's "tokens": whitespace words of a string, or the ids of a token-id prompt."""
    if isinstance(prompt, str):
        return prompt.split()
    return [str(t) for t in prompt]


def token_ids(words: Sequence[str]) -> list[int]:
    """The sim's token ids: each word's CRC-32. A pure function of the word, so a router can compute the
    ids — and from them the block keys the sim's KV-cache events carry — exactly as the sim does."""
    return [zlib.crc32(w.encode()) for w in words]


def count_prompt_tokens(prompt: str | Sequence[int]) -> int:
    """At least 1: vLLM prepends BOS, so even an empty prompt costs a token."""
    return max(1, len(prompt_words(prompt)))


def _context(key: str) -> int:
    """CRC-32 of the context's words, each after one space: extended token by token by :func:`_next`."""
    words = key.split()
    return zlib.crc32((" " + " ".join(words)).encode()) if words else 0


def _next(state: int, word: str) -> int:
    return zlib.crc32((" " + word).encode(), state)


_MASK = (1 << 64) - 1


def _draw(seed: int, state: int) -> int:
    """64 well-mixed bits from the seed and the context (splitmix64's finaliser)."""
    z = (state + (seed & _MASK) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def prompt_key(prompt: str | Sequence[int] | Messages) -> str:
    """The string the output is seeded from: the prompt text, token ids, or the rendered chat."""
    if isinstance(prompt, str):
        return prompt
    items: list[Any] = list(prompt)
    if items and isinstance(items[0], dict):
        return render_chat(items)
    return " ".join(str(t) for t in items)


def generate(seed: int, prompt: str | Sequence[int] | Messages, max_tokens: int, *,
             stop: Sequence[str] = (), eos_prob: float = 0.0,
             ignore_eos: bool = False) -> tuple[list[str], str, str | None]:
    """The token texts the engine will emit, the finish reason and the stop reason.

    One piece per generated token (so ``len(pieces)`` is ``completion_tokens``). ``finish_reason`` is
    "length" when ``max_tokens`` ran out, "stop" for EOS or a stop string; the stop string itself is not
    part of the output (vLLM's default ``include_stop_str_in_output=False``) and is the stop reason.
    """
    state = _context(prompt_key(prompt))
    tokens: list[str] = []
    for _ in range(max_tokens):
        bits = _draw(seed, state)
        word = VOCAB[(bits >> 32) % len(VOCAB)]
        eos = (bits & 0xFFFFFFFF) / 2**32 < eos_prob
        if eos and not ignore_eos:
            tokens.append("")  # the EOS token counts as generated but detokenizes to nothing
            return tokens, "stop", None
        tokens.append(" " + word)
        state = _next(state, word)
    if stop:
        cut = _apply_stop(tokens, stop)
        if cut is not None:
            return cut[0], "stop", cut[1]
    return tokens, "length", None


def _apply_stop(tokens: list[str], stop: Sequence[str]) -> tuple[list[str], str] | None:
    """Cut at the first stop string to *complete* (vLLM checks after each token).

    The result has one piece per token generated up to and including the one that completed the stop
    (vLLM counts them all as completion tokens); text from the stop string on is removed, so trailing
    pieces may be shorter or empty.
    """
    text = ""
    for i, tok in enumerate(tokens):
        before = len(text)
        text += tok
        found = [(pos, s) for s in stop if s
                 if (pos := text.find(s, max(0, before - len(s) + 1))) >= 0]
        if not found:
            continue
        cut, which = min(found)
        pieces: list[str] = []
        start = 0
        for t in tokens[: i + 1]:
            pieces.append(t[: max(0, cut - start)])
            start += len(t)
        return pieces, which
    return None


def expected_text(seed: int, prompt: str | Sequence[int] | Messages, max_tokens: int, *,
                  stop: Sequence[str] = (), eos_prob: float = 0.0, ignore_eos: bool = False) -> str:
    """Exactly the text a sim with this ``seed`` returns for ``prompt`` (a string, token ids or chat
    messages) and ``max_tokens`` — streamed chunks concatenated or the non-streaming ``text``."""
    return "".join(generate(seed, prompt, max_tokens, stop=stop, eos_prob=eos_prob,
                            ignore_eos=ignore_eos)[0])
