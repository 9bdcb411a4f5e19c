"""Create a tiny randomly initialised Llama checkpoint for end-to-end tests.

No network access and no tokenizer: the engine is run with
``skip_tokenizer_init=True`` and token-id prompts. The weights depend only on
the seed, so every run of this script produces the same model.

Usage: python make_tiny_llama.py OUTPUT_DIR [--seed N]
"""

from __future__ import annotations

import argparse
import os
import sys

# Shape of the model. Head size is hidden // heads = 32, which vLLM's CPU
# attention supports; the vocabulary is small so random prompts repeat little.
TINY_LLAMA = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    head_dim=32,
)


def make_tiny_llama(out_dir: str, seed: int = 1234) -> str:
    """Write the checkpoint (config.json + safetensors) into ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        **TINY_LLAMA,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
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
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    make_tiny_llama(args.out_dir, args.seed)
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
