"""Create tiny randomly initialised checkpoints for end-to-end tests.

No network access and no tokenizer: the engine is run with
``skip_tokenizer_init=True`` and token-id prompts. The weights depend only on
the seed, so every run of this script produces the same model.

Usage: python make_tiny_model.py OUTPUT_DIR [--arch llama|gemma3] [--seed N]

llama: 2 layers of full attention. gemma3: Gemma 3's shape, sliding-window
layers (window WINDOW tokens) between full-attention layers, which vLLM keeps
in two KV-cache groups.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="llama", choices=["llama", "gemma3"])
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    make_tiny_model(args.out_dir, args.arch, args.seed)
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
