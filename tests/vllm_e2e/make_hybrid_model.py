"""Tiny, randomly initialised HYBRID checkpoints (recurrent state + full attention) for tests.

No network, no tokenizer (run the engine with ``skip_tokenizer_init=True`` and token-id prompts).
The weights depend only on the seed.

    python make_hybrid_model.py OUT_DIR --arch qwen3_next|nemotron_h|granitemoehybrid [--seed N]

qwen3_next        Qwen3-Next, 4 layers (linear, linear, linear, full; x N with --layers 4N): Gated-DeltaNet
                  linear attention + gated full attention (2 heads, 1 KV head, head 64), dense MLPs
                  except the last layer's small MoE (4 experts, top 2: vLLM's Qwen3Next refuses a
                  model without any MoE layer, "No Qwen3Next layer found in the model.layers.").
                  Linear key/value head dims 128 (vLLM's CPU GDN kernel), saved in bfloat16 (the
                  CPU GDN kernel asserts "CPU GDN attention requires BF16.").
nemotron_h        NemotronH, 6 layers "M-*-M-": 2 Mamba2 mixers (4 heads x 64, state 64), 1 attention
                  (2 heads, 1 KV head, head 64), 3 relu2 MLPs, no MoE; float32.
granitemoehybrid  GraniteMoeHybrid, 4 layers (mamba, attention, mamba, mamba), dense shared MLP
                  (num_local_experts=0); float32.
Each recurrent layer becomes one MambaSpec KV-cache group in vLLM (conv state + SSM state).

STATE-SENSITIVE: with the stock initialisation the recurrent state forgets within a few tokens
(GDN: A = U(0.01, 16), dt_bias = 1 -> decay exp(-A * softplus(a + 1)) ~ e^-10 per token; Mamba2:
A = 1..H, dt ~ softplus(1) -> e^-1.3 per token), so a connector that loses or corrupts the state
would go unnoticed. Here the decay is slowed (A_log small, dt_bias negative; the input-dependent
parts of the gates, GDN's in_proj_ba and Mamba2's dt rows of in_proj, are shrunk so the decay
stays slow for every token), Mamba2's skip D is weakened and the mixers' output projections are
scaled up, so that the state from hundreds of tokens back changes the greedy output: the
end-to-end tests' negative controls (the state skipped, or loaded too late) show it through vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

VOCAB = 512
HIDDEN = 128

# Per-architecture knobs of the state sensitivity (see the module docstring).
GDN_A = (1e-4, 1e-3)        # A = exp(A_log) ~ U(lo, hi)  (stock: U(0.01, 16))
GDN_DT_BIAS = -2.0          # softplus(a + dt_bias); stock 1.0
MAMBA_A = (1e-3, 1e-2)      # A = exp(A_log) ~ U(lo, hi)  (stock: 1..num_heads)
MAMBA_DT = 0.05             # dt = softplus(dt_raw + dt_bias) ~ this (stock ~1.3)
MAMBA_D = 0.1               # skip connection (stock 1.0)
MIXER_OUT_SCALE = {"qwen3_next": 3.0, "nemotron_h": 6.0, "granitemoehybrid": 3.0}  # x mixer out_proj
WEIGHT_STD = 0.15           # matrices (as the tiny Llama of make_tiny_model.py)


# vLLM's CPU GDN kernel asserts "CPU GDN attention requires BF16." (ops/cpu/gdn_attention.py):
# Qwen3-Next is saved in bfloat16 so that vLLM's dtype "auto" picks it; the Mamba2 ones in float32.
DTYPE = {"qwen3_next": "bfloat16", "nemotron_h": "float32", "granitemoehybrid": "float32"}


def _common() -> dict:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, max_position_embeddings=4096, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _config(arch: str, num_layers: int):
    import transformers

    if arch == "qwen3_next":
        # Qwen3-Next's 3:1 pattern (linear, linear, linear, full) repeated.
        reps = max(1, num_layers // 4)
        layers = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * reps
        cfg = transformers.Qwen3NextConfig(
            **_common(), intermediate_size=256, num_hidden_layers=len(layers), layer_types=layers,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, mlp_only_layers=list(range(len(layers) - 1)), decoder_sparse_step=1,
            rms_norm_eps=1e-6, full_attention_interval=4)
        return transformers.Qwen3NextForCausalLM, cfg
    if arch == "nemotron_h":
        # Mamba, MLP, attention, MLP, Mamba, MLP ... : "M-*-M-" (each NemotronH layer is one mixer).
        pattern = ("M-*-M-" * max(1, num_layers // 4))
        cfg = transformers.NemotronHConfig(
            **_common(), hybrid_override_pattern=pattern, num_hidden_layers=len(pattern),
            num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=256,
            mlp_hidden_act="relu2", ssm_state_size=64, mamba_num_heads=4, mamba_head_dim=64, n_groups=1,
            conv_kernel=4, expand=2, chunk_size=128, use_conv_bias=True, mamba_proj_bias=False,
            time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4, layer_norm_epsilon=1e-5,
            n_routed_experts=0, num_nextn_predict_layers=0)
        return transformers.NemotronHForCausalLM, cfg
    if arch == "granitemoehybrid":
        layers = ["mamba", "attention", "mamba", "mamba"] * max(1, num_layers // 4)
        cfg = transformers.GraniteMoeHybridConfig(
            **_common(), intermediate_size=256, num_hidden_layers=len(layers), layer_types=layers,
            num_attention_heads=2, num_key_value_heads=1, num_local_experts=0, num_experts_per_tok=0,
            shared_intermediate_size=256, position_embedding_type="rope",
            mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=64, mamba_d_head=64, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=128, mamba_conv_bias=True, mamba_proj_bias=False, rms_norm_eps=1e-5)
        return transformers.GraniteMoeHybridForCausalLM, cfg
    raise ValueError(f"unknown arch {arch!r}")


def _is_mixer(module) -> str | None:
    """'gdn' or 'mamba2' for the recurrent mixers of the three families."""
    name = type(module).__name__
    if "GatedDeltaNet" in name:
        return "gdn"
    if hasattr(module, "A_log") and hasattr(module, "dt_bias") and hasattr(module, "out_proj"):
        return "mamba2"
    return None


def _make_state_sensitive(model, gen, out_scale: float) -> None:
    import torch

    for module in model.modules():
        kind = _is_mixer(module)
        if kind is None:
            continue
        h = module.A_log.numel()
        if kind == "gdn":
            lo, hi = GDN_A
            module.A_log.copy_(torch.empty(h).uniform_(lo, hi, generator=gen).log())
            module.dt_bias.fill_(GDN_DT_BIAS)
            # in_proj_ba's rows are num_k_heads groups of [b x ratio, a x ratio] (no bias). Shrinking
            # them makes beta = sigmoid(b) ~ 0.5 and the decay ~ A * softplus(dt_bias) steady from
            # token to token instead of swinging with the input.
            module.in_proj_ba.weight.mul_(0.05)
        else:
            lo, hi = MAMBA_A
            module.A_log.copy_(torch.empty(h).uniform_(lo, hi, generator=gen).log())
            module.dt_bias.fill_(math.log(math.expm1(MAMBA_DT)))  # softplus^-1(MAMBA_DT)
            # in_proj's rows are [z, xBC, dt]: shrink the dt rows so dt stays ~ MAMBA_DT, and
            # weaken the skip connection D * x so that C . state carries the output.
            module.in_proj.weight[-h:].mul_(0.05)
            module.D.fill_(MAMBA_D)
        module.out_proj.weight.mul_(out_scale)


def make_hybrid_model(out_dir: str, arch: str = "qwen3_next", seed: int = 1234, num_layers: int = 4,
                      state_sensitive: bool = True) -> str:
    """Write the checkpoint (config.json + model.safetensors) into ``out_dir``; returns it."""
    import torch

    torch.manual_seed(seed)
    model_cls, config = _config(arch, num_layers)
    model = model_cls(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name:
                p.normal_(0.0, WEIGHT_STD, generator=gen)
        if state_sensitive:
            _make_state_sensitive(model, gen, MIXER_OUT_SCALE[arch])
    dtype = DTYPE[arch]
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    # transformers 5 writes `dtype`; older readers look for torch_dtype.
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = dtype
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="qwen3_next", choices=["qwen3_next", "nemotron_h", "granitemoehybrid"])
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--stock", action="store_true", help="keep the stock (fast-forgetting) state init")
    args = parser.parse_args(argv)
    make_hybrid_model(args.out_dir, args.arch, args.seed, args.layers, state_sensitive=not args.stock)
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
