"""Make PEFT LoRA adapters for a local Llama directory (the tiny test model), nothing downloaded.

Each adapter is r = 8 on ``q_proj`` and ``v_proj`` of every layer, with random non-zero A and B
(fixed seed per adapter), so it changes the model's greedy output and two adapters differ from each
other. Shapes follow the base model's ``config.json`` (q: heads × head_dim, v: kv_heads × head_dim),
as vLLM reads a PEFT directory: ``adapter_config.json`` + ``adapter_model.safetensors``.

Run with the vLLM venv's python (it has torch and safetensors):

    .venv-vllm/bin/python scripts/make_lora_adapters.py MODEL_DIR OUT_DIR [--names a b] [--rank 8]

Prints each adapter's directory, one per line.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path


def make(model_dir: Path, out: Path, name: str, rank: int, scale: float) -> Path:
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    layers = int(cfg["num_hidden_layers"])
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tensors = {}
    for i in range(layers):
        for proj, out_features in (("q_proj", heads * head_dim), ("v_proj", kv_heads * head_dim)):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * scale
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": str(model_dir), "fan_in_fan_out": False, "inference_mode": True,
    }, indent=2))
    return d


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--names", nargs="+", default=["lora-a", "lora-b"])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--scale", type=float, default=0.5, help="std of the random weights")
    args = ap.parse_args(argv)
    for name in args.names:
        print(make(args.model_dir, args.out_dir, name, args.rank, args.scale))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
