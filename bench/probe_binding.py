"""Probe of C++ error paths on a GPU machine: each case in its own process, with and without torch
imported first, so that one crash does not hide the others."""

import subprocess
import sys

CASES = {
    "cpu_gather bad id": """
import numpy as np
from lmcache_mp import _C
from lmcache_mp.layout import infer_layout
buf = np.zeros(1 << 16, dtype=np.uint8)
s = infer_layout((2, 8, 4, 1, 16), (512, 64, 16, 16, 1), 1, "uint8", 1)
objs = np.zeros((2, 4096), dtype=np.uint8)
ptrs = np.array([objs[0].ctypes.data, objs[1].ctypes.data], dtype=np.uint64)
_C.cpu_gather(s.native([buf.ctypes.data]), 8, np.array([0, 1, 2, 8]), ptrs, 4096)
""",
    "arena bad free": """
from lmcache_mp import _C
a = _C.HostArena(1 << 22, 1 << 20)
a.free(12345)
""",
    "engine bad id": """
import numpy as np, torch
from lmcache_mp import _C
from lmcache_mp.layout import infer_layout
t = [torch.zeros((2, 64, 16, 2, 64), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
spec = infer_layout(t[0].shape, t[0].stride(), 2, "bfloat16", 2)
eng = _C.cuda.TransferEngine(0, spec.native([x.data_ptr() for x in t]), 64)
ob = spec.object_bytes(64)
host = torch.empty(2 * ob, dtype=torch.uint8, pin_memory=True)
ptrs = np.array([host.data_ptr(), host.data_ptr() + ob], dtype=np.uint64)
eng.wait(eng.submit("gather", "staged", list(range(8)), ptrs, 64, ob))
print("list ids ok", flush=True)
eng.submit("gather", "staged", np.array([0, 1, 2, 3, 4, 5, 6, 64]), ptrs, 64, ob)
""",
}

for name, code in CASES.items():
    for pre in ("", "import torch\n"):
        r = subprocess.run([sys.executable, "-c", pre + code], capture_output=True, text=True, timeout=120)
        last = (r.stderr.strip().splitlines() or [""])[-1]
        print(f"{name:20s} torch-first={bool(pre)!s:5s} rc={r.returncode:4d} {r.stdout.strip()} | {last}")
