"""Run one vLLM engine (CPU build, in-process) over a batch of token prompts, greedy.

    python run_engine.py --model DIR --prompts prompts.json --out result.json \
        [--connector-url tcp://127.0.0.1:PORT] [--max-tokens 16]

prompts.json is a list of token-id lists. result.json holds, per prompt, the generated token
ids and vLLM's `num_cached_tokens`, plus the engine's start-up and generation wall times.
With --connector-url the engine uses lmcache_mp.integration.vllm.LMCacheMPConnector.
Meant to run in a fresh process: an engine per process, as in production.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # scheduler and worker in this process: starts in seconds
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",  # else vLLM probes an outside address for its own IP
}


def run(model: str, prompts: list[list[int]], connector_url: str | None, max_tokens: int,
        extra_config: dict | None = None) -> dict:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if connector_url:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_connector_module_path="lmcache_mp.integration.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"lmcache_mp.url": connector_url, **(extra_config or {})},
        )
    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=32,
        max_model_len=1024,
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=False,
        seed=0,
        **kwargs,
    )
    t1 = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    t2 = time.perf_counter()
    result = {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
        "engine_start_s": t1 - t0,
        "generate_s": t2 - t1,
    }
    # Shut the engine down here (not at interpreter exit): the connector then delivers the
    # stores still in flight before this process ends.
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001 - best effort; the connector also flushes at exit
        print(f"engine shutdown: {exc!r}", file=sys.stderr)
    result["shutdown_s"] = time.perf_counter() - t2
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--connector-url", default=None)
    ap.add_argument("--extra-config", default="{}", help="JSON of more kv_connector_extra_config keys")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    with open(args.prompts) as f:
        prompts = json.load(f)
    result = run(args.model, prompts, args.connector_url, args.max_tokens, json.loads(args.extra_config))
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
