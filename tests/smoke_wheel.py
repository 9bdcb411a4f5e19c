"""Smoke test of an installed wheel (not collected by pytest; CI runs it in a fresh virtualenv
with only the wheel, torch and their dependencies): the build info, then a server started from
the installed console script and one CPU round trip through it, byte-exact.

    python tests/smoke_wheel.py [--expect-cuda]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--expect-cuda", action="store_true", help="fail unless the CUDA data plane is compiled in")
    args = ap.parse_args()
    import torch

    import lmcache_mp
    from lmcache_mp import Client, chunk_hashes, shared_cpu_tensor

    assert "site-packages" in lmcache_mp.__file__, f"not the installed package: {lmcache_mp.__file__}"
    info = lmcache_mp.build_info()
    print("build info:", info)
    if args.expect_cuda and not info["cuda"]:
        print("FAIL: the wheel has no CUDA data plane")
        return 1
    sock = Path(tempfile.mkdtemp()) / "s.sock"
    server = subprocess.Popen([str(Path(sys.executable).parent / "lmcache-mp-server"), "--url", f"ipc://{sock}",
                               "--device", "cpu", "--l1-size", "64MiB", "--chunk-size", "16", "--http-addr", "off"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        for line in server.stdout:
            print("server:", line.rstrip())
            if "ready: serving on" in line:
                break
        else:
            print("FAIL: the server did not start")
            return 1
        c = Client(f"ipc://{sock}")
        kv = [shared_cpu_tensor((2, 8, 16, 2, 8), torch.float16) for _ in range(2)]  # [K/V, blocks, tokens, heads, dim]
        for t in kv:
            t.copy_(torch.randn(t.shape, dtype=torch.float16))
        want = [t[:, :2].clone() for t in kv]
        h = c.register_kv_cache(kv, model="smoke")
        hashes = chunk_hashes(list(range(32)), 16)
        assert c.store(h, hashes, [0, 1]).result(10).stored == 2
        for t in kv:
            t[:, 4:6].zero_()
        assert c.retrieve(h, hashes, [4, 5]).result(10).loaded == 2
        exact = all(torch.equal(t[:, 4:6], w) for t, w in zip(kv, want))
        c.close()
        print("CPU round trip byte-exact:", exact)
        return 0 if exact else 1
    finally:
        server.terminate()
        server.wait(30)
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
