"""Build a tiny random-weight Llama + byte-level BPE tokenizer for running real `vllm serve` in tests.

Why: the real engine needs *some* Hugging Face model directory, the machine has no hub access, and
test speed depends on the model being trivial (342k parameters, 1.4 MB). Everything is generated
locally and deterministically (fixed seeds), so two runs give the same tokenizer and weights.

Run with the vLLM venv's python (it has torch, transformers and tokenizers):

    .venv-vllm/bin/python scripts/make_tiny_model.py OUTDIR
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VOCAB_SIZE = 364  # 256 byte symbols + 3 specials + ~105 merges: big enough to look like BPE

# ChatML, the format of most chat models vLLM serves; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SUBJECTS = ["the router", "a request", "the engine", "my model", "each replica", "the queue", "hello world"]
_VERBS = ["sends", "routes", "answers", "streams", "measures", "drains", "retries", "admits"]
_OBJECTS = ["tokens", "a prompt", "the reply", "many users", "the metrics", "one batch", "the cache"]
_TAILS = ["quickly", "on time", "again", "in order", "with care", "today", "twice"]


def _sentences(n: int, seed: int) -> Iterator[str]:
    """Generated English-like text: enough repeated words for BPE merges, no download needed."""
    rng = random.Random(seed)
    for _ in range(n):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_TAILS)]
        end = rng.choice([".", "!", "?", ","])
        yield " ".join(words) + end


def build_tokenizer(outdir: Path) -> None:
    """Train the byte-level BPE and save it as a `PreTrainedTokenizerFast` with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_sentences(3000, seed=1234), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(outdir))


def build_model(outdir: Path, vocab_size: int, eos_id: int) -> int:
    """Save a random-weight float32 Llama; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(outdir))
    model.generation_config.save_pretrained(str(outdir))
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path)
    args = parser.parse_args(argv)
    outdir: Path = args.outdir
    outdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    build_tokenizer(outdir)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(outdir))
    params = build_model(outdir, vocab_size=len(tok), eos_id=tok.convert_tokens_to_ids(EOS))
    chat_text = tok.apply_chat_template(
        [{"role": "user", "content": "hello world"}], add_generation_prompt=True, tokenize=False
    )
    chat_ids = tok(chat_text, add_special_tokens=False)["input_ids"]
    print(
        f"tiny model in {outdir}: vocab {len(tok)}, {params} parameters, "
        f"chat prompt {len(chat_ids)} tokens, {time.monotonic() - t0:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
