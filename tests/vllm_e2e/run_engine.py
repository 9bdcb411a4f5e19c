"""Run one vLLM engine (CPU build, in-process) over a batch of token prompts, greedy.

    python run_engine.py --model DIR --prompts prompts.json --out result.json \
        [--connector-url tcp://127.0.0.1:PORT] [--max-tokens 16]

prompts.json is a list of prompts: token-id lists, or {"tokens": [...], "lora": NAME,
"cache_salt": "...", "kv_transfer_params": {...}} (LoRA adapters named with --lora NAME=DIR).
result.json holds, per prompt, the generated token ids and vLLM's `num_cached_tokens`, plus the
engine's start-up and generation wall times.
With --pause-dir DIR, prompts.json is a list of batches run one after another by the same
engine; before batch i > 0 the engine creates DIR/paused-i and waits for DIR/resume-i (the
test changes the world in between, e.g. restarts the server). A resume file that says "up" or
"down" makes the engine wait until its connector sees the server so (the seconds it waited are
in the result, with each batch's connector counters).
With --connector-url the engine uses lmcache_mp.integration.vllm.LMCacheMPConnector.
With --kv-events ENDPOINT vLLM publishes KV events there (ZeroMQ); after each batch the engine
then reads the server's chunk events now and runs a one-token step, so that what the connector
has to announce is published before the next pause (an idle engine publishes nothing).
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


def inject_load_failures() -> None:
    """Test hook: every load asks for its second half of chunks under unknown keys, so the
    server loads only the leading half and the connector must report the rest as failed."""
    from lmcache_mp.integration import worker_core

    original = worker_core.WorkerCore.start_loads

    def start_loads(self, plan):
        for t in plan.loads:
            keep = len(t.hashes) // 2
            t.hashes = t.hashes[:keep] + [bytes(16)] * (len(t.hashes) - keep)
        return original(self, plan)

    worker_core.WorkerCore.start_loads = start_loads


def inject_state_fault(kind: str) -> None:
    """Test hooks for hybrid models, each of which must change the output (negative controls):
    "skip": the state groups' loads are dropped (the attention KV alone arrives; the state's
    block keeps what vLLM left in it); "late": loads are synchronous, so the state lands after
    vLLM copied its block into the running one for the step."""
    from lmcache_mp.integration import scheduler_core, worker_core
    from lmcache_mp.integration.connector_types import STATE

    if kind == "skip":
        original = worker_core.WorkerCore.start_loads

        def start_loads(self, plan):
            plan.loads = [t for t in plan.loads if self.groups[t.group].kind != STATE]
            return original(self, plan)

        worker_core.WorkerCore.start_loads = start_loads
    elif kind == "late":
        scheduler_core.SchedulerCore.async_loads = property(lambda self: False)
    else:
        raise ValueError(kind)


def wait_for_resume(pause_dir: str, i: int, timeout: float = 120.0) -> str:
    """What the test says of the server now: "up", "down" or ""."""
    open(os.path.join(pause_dir, f"paused-{i}"), "w").close()
    deadline = time.monotonic() + timeout
    resume = os.path.join(pause_dir, f"resume-{i}")
    while not os.path.exists(resume):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nobody resumed batch {i}")
        time.sleep(0.05)
    with open(resume) as f:
        return f.read().strip()


def of_type(cls) -> list:
    import gc

    gc.unfreeze()  # vLLM freezes its start-up objects, which hides them from get_objects()
    found = [obj for obj in gc.get_objects() if isinstance(obj, cls)]
    gc.freeze()  # as vLLM left it (else its shutdown spends a second collecting them)
    return found


def wait_for_connector(server: str, timeout: float = 60.0) -> float:
    """Until every connection of the connector in this process sees the server as the test says
    it is: "up" (a client handed out: connected, its KV caches registered) or "down" (none);
    returns the seconds waited. A store sent before a worker registered again is lost, as it
    would be in production: the test waits here so that it can count the stores."""
    from lmcache_mp.integration.link import ClientLink

    t0 = time.monotonic()
    if server not in ("up", "down"):
        return 0.0
    for link in of_type(ClientLink):
        while (link.get() is not None) != (server == "up"):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"the connector did not find the server {server} within {timeout} s")
            time.sleep(0.02)
    return time.monotonic() - t0


def time_connects() -> list[float]:
    """Test hook: the seconds each connection of the connector waited for the server at start-up."""
    from lmcache_mp.integration import link

    waits, connect = [], link.ClientLink.connect

    def timed(self, wait: float = 0.0):
        t0 = time.perf_counter()
        try:
            return connect(self, wait)
        finally:
            waits.append(time.perf_counter() - t0)

    link.ClientLink.connect = timed
    return waits


def connector_cores() -> list:
    """The connector cores in this process (workers of other processes, as with tensor
    parallelism, are not seen). Looked for once: a look at every object takes a while."""
    from lmcache_mp.integration.connector_core import SchedulerCore, WorkerCore

    return of_type((SchedulerCore, WorkerCore))


def connector_stats(cores: list) -> dict:
    """Sum of the cores' counters; maxima (*_max) are the largest."""
    total: dict = {}
    for core in cores:
        for k, v in core.stats.items():
            total[k] = max(total.get(k, 0), v) if k.endswith("_max") else total.get(k, 0) + v
    return total


def batch_stats(cores: list, before: dict) -> dict:
    """The cores' counters over one batch (from `before`, the totals at its start); its maxima
    are the batch's own (they start again from 0 for the next)."""
    now = connector_stats(cores)
    out = {k: v if k.endswith("_max") else v - before.get(k, 0) for k, v in now.items()}
    for core in cores:
        core.stats.update({k: 0 for k in core.stats if k.endswith("_max")})
    return out


def whole_run(totals: dict, per_batch: list[dict]) -> dict:
    """The counters of the run: the totals, with the maxima over every batch."""
    for k in totals:
        if k.endswith("_max"):
            totals[k] = max(b["connector"].get(k, 0) for b in per_batch)
    return totals


def publish_events(llm, params) -> None:
    """Read the server's chunk events now (every connector of this process) and run one step."""
    from lmcache_mp.integration.chunk_events import ChunkEvents

    trackers = of_type(ChunkEvents)
    deadline = time.monotonic() + 60
    for t in trackers:
        while not t.sync():  # a restarted server: until the client found it
            if time.monotonic() > deadline:
                raise TimeoutError("the connector could not read the server's events")
            time.sleep(0.1)
        # The batch's stores may still be on their way to the server (a loaded machine): read
        # again until it has them all, or a while has passed (a store may have found no room).
        settle = time.monotonic() + 20
        while t._pending and time.monotonic() < settle:
            time.sleep(0.1)
            t.sync()
    from vllm.inputs import TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=[3, 4, 5])], params, use_tqdm=False)


def request(p, params, loras: dict[str, str]):
    """(prompt, sampling params, LoRA request) of one prompt of prompts.json."""
    from vllm.inputs import TokensPrompt

    if not isinstance(p, dict):
        return TokensPrompt(prompt_token_ids=p), params, None
    prompt = TokensPrompt(prompt_token_ids=p["tokens"])
    if p.get("cache_salt"):
        prompt["cache_salt"] = p["cache_salt"]
    if p.get("kv_transfer_params"):
        params = params.clone()
        params.extra_args = {"kv_transfer_params": p["kv_transfer_params"]}
    adapter = None
    if p.get("lora"):
        from vllm.lora.request import LoRARequest

        names = sorted(loras)
        adapter = LoRARequest(p["lora"], names.index(p["lora"]) + 1, loras[p["lora"]])
    return prompt, params, adapter


def run(model: str, prompts: list[list[int]], connector_url: str | None, max_tokens: int,
        extra_config: dict | None = None, fail_loads: bool = False, tensor_parallel: int = 1,
        prefix_caching: bool = False, sequential: bool = False, kv_cache_bytes: int = 256 << 20,
        pause_dir: str | None = None, kv_events: str | None = None, log_stats: bool = False,
        loras: dict[str, str] | None = None, kv_role: str = "kv_both", dtype: str = "float32",
        block_size: int = 32, max_model_len: int = 1024, max_num_batched_tokens: int | None = None,
        reset_prefix_cache: bool = False, state_fault: str = "", logprobs: bool = False) -> dict:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if fail_loads:
        inject_load_failures()
    if state_fault:
        inject_state_fault(state_fault)
    connect_waits = time_connects() if connector_url else []
    from vllm import LLM, SamplingParams

    kwargs = {}
    if loras:
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=len(loras))
    if max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if kv_events:
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events)
    if connector_url:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_connector_module_path="lmcache_mp.integration.vllm",
            kv_role=kv_role,
            kv_connector_extra_config={"lmcache_mp.url": connector_url, **(extra_config or {})},
        )
    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=block_size,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_bytes,
        enable_prefix_caching=prefix_caching,
        seed=0,
        # float32, not the CPU build's bfloat16: in bfloat16 a prompt's greedy output depends on
        # which other requests share its steps (3 of the 11 test prompts change when run one at
        # a time), and a lookup answered a step later legitimately changes that. In float32 the
        # outputs are the same either way, so a token that differs means a wrong KV cache.
        # (hybrids whose CPU kernels want bfloat16 pass it: their prompts then run one at a time)
        dtype=dtype,
        tensor_parallel_size=tensor_parallel,
        disable_log_stats=not log_stats,
        **kwargs,
    )
    cores = connector_cores() if connector_url else []  # (a look at every object: not timed as generation)
    t1 = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True,
                            logprobs=1 if logprobs else None)
    if pause_dir:
        batches = prompts
    else:
        batches = [[p] for p in prompts] if sequential else [prompts]
    outs, per_batch = [], []
    for i, batch in enumerate(batches):
        waited = wait_for_connector(wait_for_resume(pause_dir, i)) if pause_dir and i else 0.0
        before = connector_stats(cores)
        if batch:
            if reset_prefix_cache:  # each batch cold as far as vLLM's own prefix cache goes
                llm.reset_prefix_cache()
            prompts_, params_, adapters = zip(*(request(p, params, loras or {}) for p in batch))
            outs += llm.generate(list(prompts_), list(params_), lora_request=list(adapters), use_tqdm=False)
        if kv_events:
            publish_events(llm, params)
        per_batch.append({"waited_s": waited, "connector": batch_stats(cores, before)})
    t2 = time.perf_counter()
    result = {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
        # (with --logprobs: the chosen tokens' logprobs)
        "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                     for o in outs] if logprobs else [],
        "engine_start_s": t1 - t0,
        "block_size": int(llm.llm_engine.vllm_config.cache_config.block_size),  # (as vLLM raised it for hybrids)
        "generate_s": t2 - t1,
        "connector": whole_run(connector_stats(cores), per_batch) if connector_url else {},
        "connect_s": connect_waits,
        "batches": per_batch,
    }
    if log_stats:  # the connector's counters on vLLM's Prometheus metrics
        result["metrics"] = {m.name: m.value for m in llm.get_metrics() if "lmcache_mp" in m.name}
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
    ap.add_argument("--inject-load-failures", action="store_true", help="test hook: see inject_load_failures")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="ranks (worker processes) of the engine")
    ap.add_argument("--prefix-caching", action="store_true", help="enable vLLM's own prefix cache")
    ap.add_argument("--sequential", action="store_true", help="one prompt per generate() call, in order")
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="vLLM's KV cache size (small: preemptions)")
    ap.add_argument("--pause-dir", default=None, help="prompts are batches; pause between them (see above)")
    ap.add_argument("--kv-events", default=None, help="publish vLLM's KV events at this ZeroMQ endpoint")
    ap.add_argument("--log-stats", action="store_true", help="vLLM's stats on: its metrics go into the result")
    ap.add_argument("--lora", action="append", default=[], help="NAME=DIR: a LoRA adapter prompts may name")
    ap.add_argument("--kv-role", default="kv_both", choices=["kv_both", "kv_producer", "kv_consumer"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, default=32, help="vLLM's block size (hybrids raise it)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--reset-prefix-cache", action="store_true", help="clear vLLM's own prefix cache before each batch")
    ap.add_argument("--state-fault", default="", choices=["", "skip", "late"], help="test hook: inject_state_fault")
    ap.add_argument("--logprobs", action="store_true", help="the chosen tokens' logprobs into the result")
    args = ap.parse_args(argv)
    with open(args.prompts) as f:
        prompts = json.load(f)
    result = run(args.model, prompts, args.connector_url, args.max_tokens, json.loads(args.extra_config),
                 fail_loads=args.inject_load_failures, tensor_parallel=args.tensor_parallel,
                 prefix_caching=args.prefix_caching, sequential=args.sequential,
                 kv_cache_bytes=args.kv_cache_bytes, pause_dir=args.pause_dir, kv_events=args.kv_events,
                 log_stats=args.log_stats, loras=dict(a.split("=", 1) for a in args.lora),
                 kv_role=args.kv_role, dtype=args.dtype, block_size=args.block_size,
                 max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                 reset_prefix_cache=args.reset_prefix_cache, state_fault=args.state_fault, logprobs=args.logprobs)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
