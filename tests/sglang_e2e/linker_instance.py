"""A second SGLang instance, in a process of its own, for test_sglang_linker.py: it matches a
prompt, loads what the linker finds into its own pools and compares the bytes with the first
instance's (rebuilt here from the same seed). Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sglang_kit as kit  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--source-seed", type=int, required=True)
    ap.add_argument("--prompt-seed", type=int, required=True)
    ap.add_argument("--pages", type=int, required=True)
    ap.add_argument("--slots", required=True, help="the first instance's KV slots (JSON list)")
    ap.add_argument("--state-slot", type=int, default=-1)
    args = ap.parse_args()
    me = kit.Instance(args.url, seed=args.source_seed + 100)
    source = kit.Instance.reference(hybrid=True, seed=args.source_seed)
    tokens = kit.prompt(args.prompt_seed, args.pages)
    try:
        req, match = me.match(tokens + [7])
        loaded, dst = me.load_back(req)
        failed = [r.rid for r in me.run_batch([req])] if loaded else []
        out = {"hit_tokens": match.host_hit_length, "loaded": loaded, "failed": failed}
        if loaded:
            slots = torch.tensor(json.loads(args.slots))
            out["kv_equal"] = all(torch.equal(x, y) for x, y in zip(me.kv_at(dst), source.kv_at(slots)))
            out["state_equal"] = all(torch.equal(x, y) for x, y in zip(me.state_at(req.kv.mamba_pool_idx),
                                                                       source.state_at(args.state_slot)))
    finally:
        me.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
