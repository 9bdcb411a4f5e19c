"""Create tiny randomly initialised checkpoints for end-to-end tests.

No network access and no tokenizer: the engine is run with
``skip_tokenizer_init=True`` and token-id prompts. The weights depend only on
the seed, so every run of this script produces the same model.

Usage: python make_tiny_model.py OUTPUT_DIR [--arch llama|gemma3|lora] [--seed N]

llama: 2 layers of full attention. gemma3: Gemma 3's shape, sliding-window
layers (window WINDOW tokens) between full-attention layers, which vLLM keeps
in two KV-cache groups. lora: a LoRA adapter (rank 8, q_proj and v_proj) of
the tiny Llama, in PEFT's format; adapters of different seeds change the KV.
"""

from __future__ import annotations

import argparse
import os
import sys

# Shape of the models. Head size 32, which vLLM's CPU attention supports; the
# vocabulary is small so random prompts repeat little.
TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    head_dim=32,
)
# Not a multiple of the test's block (32) or chunk (64) size: the window at a
# chunk boundary starts inside a chunk, so loads begin with a block nobody reads.
WINDOW = 80


def _config(arch: str):
    import transformers

    common = dict(TINY, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    if arch == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**common, num_hidden_layers=2, rms_norm_eps=1e-5)
    if arch == "gemma3":
        layers = ["sliding_attention", "full_attention"] * 2
        cfg = transformers.Gemma3TextConfig(**common, num_hidden_layers=len(layers), layer_types=layers,
                                            sliding_window=WINDOW, query_pre_attn_scalar=TINY["head_dim"],
                                            pad_token_id=0)
        return transformers.Gemma3ForCausalLM, cfg
    raise ValueError(f"unknown arch {arch!r}")


def make_tiny_model(out_dir: str, arch: str = "llama", seed: int = 1234) -> str:
    """Write the checkpoint (config.json + safetensors) into ``out_dir``."""
    import torch

    torch.manual_seed(seed)
    model_cls, config = _config(arch)
    model = model_cls(config)
    # The default init (std 0.02) gives near-uniform logits; wider weights
    # make greedy decoding depend visibly on the context, so a wrong KV
    # cache changes the output instead of hiding behind ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    model = model.to(torch.float32)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_tiny_lora(out_dir: str, seed: int = 1) -> str:
    """Write a LoRA adapter of the tiny Llama (adapter_config.json + safetensors)."""
    import json

    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    rank, hidden, kv = 8, TINY["hidden_size"], TINY["num_key_value_heads"] * TINY["head_dim"]
    weights = {}
    for layer in range(2):
        for module, out in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[prefix + ".lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.3
            weights[prefix + ".lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.3
    os.makedirs(out_dir, exist_ok=True)
    save_file(weights, os.path.join(out_dir, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16, "lora_dropout": 0.0,
              "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
              "modules_to_save": None, "base_model_name_or_path": "tiny-llama"}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="llama", choices=["llama", "gemma3", "lora"])
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.arch == "lora":
        make_tiny_lora(args.out_dir, args.seed)
    else:
        make_tiny_model(args.out_dir, args.arch, args.seed)
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
