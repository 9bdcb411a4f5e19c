"""Probe of the transfer-engine binding on a GPU: which argument kinds and error paths work."""

import numpy as np
import torch

from lmcache_mp import _C
from lmcache_mp.layout import infer_layout

t = [torch.zeros((2, 64, 16, 2, 64), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
spec = infer_layout(t[0].shape, t[0].stride(), 2, "bfloat16", 2)
eng = _C.cuda.TransferEngine(0, spec.native([x.data_ptr() for x in t]), 64)
ob = spec.object_bytes(64)
host = torch.empty(2 * ob, dtype=torch.uint8, pin_memory=True)
ptrs = np.array([host.data_ptr(), host.data_ptr() + ob], dtype=np.uint64)


def step(name, fn):
    print(name, "...", flush=True)
    try:
        r = fn()
        print("   ok", r, flush=True)
    except Exception as e:
        print("   raised", type(e).__name__, e, flush=True)


step("numpy ids, good", lambda: eng.wait(eng.submit("gather", "staged", np.arange(8), ptrs, 64, ob)))
step("numpy ids, bad id", lambda: eng.submit("gather", "staged", np.array([0, 1, 2, 3, 4, 5, 6, 64]), ptrs, 64, ob))
step("validate only via python error path", lambda: _C.cpu_gather(spec.native([1, 2]), 64, [0, 1, 2, 99], ptrs, ob))
step("list ids, good", lambda: eng.wait(eng.submit("gather", "staged", list(range(8)), ptrs, 64, ob)))
step("list ids, bad id", lambda: eng.submit("gather", "staged", [0, 1, 2, 3, 4, 5, 6, 64], ptrs, 64, ob))
print("probe done", flush=True)
