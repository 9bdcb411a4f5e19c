"""The load generator behind `lmcache-mp-bench` (and bench/bench_server.py).

cli      the lmcache-mp-bench command
runs     one run: spawn the workers, collect, summarize, print the table
worker   one worker process: a synthetic KV cache, timed phases, a bit-for-bit check
mix      --mix: two layouts at once, hit ratios against an ideal LRU
trace    --trace: per-stage times of traced requests; the bare pyzmq echo
tails    slow requests against garbage collections and machine stalls (--stall-probe)

Kept apart from the library: nothing in lmcache_mp imports it.
"""
