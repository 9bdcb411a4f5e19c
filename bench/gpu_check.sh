#!/usr/bin/env bash
# The whole GPU check in one call: build, the gpu-marked tests, the kernel tests under
# compute-sanitizer, and a short transfer benchmark. Every log lands in one folder.
#
#   bash bench/gpu_check.sh [LOG_DIR]        (default: $OUT, else ./gpu-check-logs)
#
# Environment: CMAKE_CUDA_ARCHITECTURES (default 90), GPU_CHECK_STEPS (default
# "build tests sanitizer bench"; add "peer" for LMCache's self-test, "server" for bench_server,
# "latency" for 1-chunk requests, "crossproc" for them while the engine process uses the GPU,
# "l1sizes" for L1 shared by two object sizes, "l2" for the disk tier on L2_BENCH_DIR, "l2net" for
# Valkey (one server, and a cluster of 3 primaries) and Mooncake started on loopback; "l2tests" runs
# the L2 tests, which start them too; "contention" for the engine's throughput and our transfers
# while it computes, each transfer path ("contentionquick": shorter windows); "persist" for
# 64-chunk stores with and without --l1-persist; "segments" for the copy engines' rate by copy size,
# which sets auto's threshold; "contentionpacked" for block-outermost caches next to per-layer ones
# under auto; "sglang" for SGLang-shaped pools through the unified cache linker and through HiCache's
# host pool and storage backend, against memcpy). TESTS_LIMIT bounds the gpu tests (seconds, default
# 600). "install" instead of "build" installs a wheel built elsewhere (.whl/lmcache_mp-*.whl, same
# Python) with this tree's Python files.
set -uo pipefail
LOG=${1:-${OUT:-$PWD/gpu-check-logs}}
mkdir -p "$LOG"
export CMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES:-90}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
STEPS=${GPU_CHECK_STEPS:-build tests sanitizer bench}
declare -A STATUS
run() {  # run NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  STATUS[$name]="rc=$rc $((SECONDS - t0))s"
  echo "== $name: ${STATUS[$name]}"
  tail -n 4 "$LOG/$name.log"
  return $rc
}
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
  --format=csv >"$LOG/gpu.txt" 2>&1; cat "$LOG/gpu.txt"
for step in $STEPS; do
  case $step in
    build) run build 400 python3 -m pip install -v --no-build-isolation --no-deps . || break ;;
    install)
      run install 120 python3 -m pip install --no-deps --no-index --force-reinstall .whl/lmcache_mp-*.whl || break
      site=$(python3 -c "import lmcache_mp, os; print(os.path.dirname(lmcache_mp.__file__))")
      (cd python/lmcache_mp && find . -name '*.py' -exec cp --parents {} "$site" \;)
      python3 -c "from lmcache_mp import _C; assert _C.build_info()['cuda']; _C.cuda.device_count()" \
        || { echo "== the wheel does not run here: building"; run build 400 python3 -m pip install -v \
             --no-build-isolation --no-deps . || break; } ;;
    segments) run segments 300 python3 bench/bench_transfer.py --quick --no-peer --arms dma,staged,auto \
        --chunks 1,64 --layouts pages-1,pages-2,pages-4,pages-8,pages-12,pages-16,pages-24,pages-32,mla-packed \
        --json "$LOG/bench_transfer_segments.json" ;;
    contentionpacked) run contentionpacked 560 python3 bench/bench_engine_contention.py --paths server-auto,in-process \
        --layouts mha-packed,mla-packed,mha,mla --json "$LOG/bench_engine_contention_packed.json" ;;
    latency)  # small requests: 400 each (every other one traced), next to the raw copy and a bare round trip
      for spec in "llama1 --chunks 1 --trace" "llama1direct --chunks 1 --transfer-mode direct --trace" \
          "mla8 --layout mla --layers 8 --chunks 1 --trace" "llama4 --chunks 4 --requests 200"; do
        set -- $spec
        name=$1; shift
        run "latency_$name" 300 python3 bench/bench_server.py --requests 400 --workers 1 --lookups 1000 \
          --repeat 50 "$@" --json "$LOG/bench_server_latency_$name.json"
      done ;;
    crossproc)  # a small request while the engine's process uses the GPU (other CUDA context)
      run crossproc_mla 300 python3 bench/bench_cross_process.py --json "$LOG/bench_cross_process_mla.json"
      run crossproc_mha 300 python3 bench/bench_cross_process.py --layout mha --layers 32 \
        --json "$LOG/bench_cross_process_mha.json" ;;
    l2) run l2 500 python3 bench/bench_l2.py --dir "${L2_BENCH_DIR:-/tmp/lmcache-bench-l2}" --device cuda \
        --json "$LOG/bench_l2.json" ;;
    l2net)
      for backend in valkey mooncake; do
        run "l2_$backend" 300 python3 bench/bench_l2.py --backend $backend --device cuda --objects 16 \
          --prefix-tokens 8192 --repeat 2 --json "$LOG/bench_l2_$backend.json"
      done
      run l2_valkey_cluster3 300 python3 bench/bench_l2.py --backend valkey --cluster 3 --objects 48 \
        --tier-runs 5 --tier-only --json "$LOG/bench_l2_valkey_cluster3.json" ;;
    l2tests) run l2tests 300 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider tests/test_l2_valkey.py \
        tests/test_l2_mooncake.py tests/test_l2_nodes.py ;;
    l1sizes) run l1sizes 400 python3 bench/bench_l1_sizes.py --device cuda --l1-size 16GiB \
        --json "$LOG/bench_l1_sizes.json" ;;
    servermla) run servermla 300 python3 bench/bench_server.py --layout mla --requests 1 --workers 1,2 \
        --json "$LOG/bench_server_mla.json" ;;
    tests) run tests "${TESTS_LIMIT:-600}" python3 -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider tests \
        tests/test_native_errors.py
      grep -E "^(FAILED|ERROR) " "$LOG/tests.log" ;;
    contention) run contention 540 python3 bench/bench_engine_contention.py --json "$LOG/bench_engine_contention.json" ;;
    contentionquick) run contentionquick 300 python3 bench/bench_engine_contention.py --quick \
        --json "$LOG/bench_engine_contention_quick.json" ;;
    persist)  # the same 64-chunk requests without and with the journal's checksums
      run persist_off 200 python3 bench/bench_server.py --requests 4 --workers 1 --chunks 64 --lookups 50 \
        --json "$LOG/bench_server_persist_off.json"
      run persist_on 200 python3 bench/bench_server.py --requests 4 --workers 1 --chunks 64 --lookups 50 \
        --l1-persist /dev/shm --json "$LOG/bench_server_persist_on.json" ;;
    sanitizer) run sanitizer 600 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 -m pytest -q -p no:cacheprovider tests/test_gpu_transfer.py \
        -k "(test_gather or test_scatter) and random and (mha- or mla-) or many_launches" ;;
    bench) run bench 600 python3 bench/bench_transfer.py --quick --gemm \
        --json "$LOG/bench_transfer.json" --png "$LOG/bench_transfer.png" ;;
    benchfull) run benchfull 600 python3 bench/bench_transfer.py --gemm \
        --json "$LOG/bench_transfer.json" --png "$LOG/bench_transfer.png" ;;
    sglang) run sglang 300 python3 bench/bench_sglang_gpu.py --quick --json "$LOG/bench_sglang_gpu.json" ;;
    peer) run peer 300 python3 bench/peers/lmcache_peer.py --json "$LOG/lmcache_peer.json" ;;
    server) run server 400 python3 bench/bench_server.py --requests 1 --workers 1,2,4 --json "$LOG/bench_server.json" ;;
    server2) run server2 400 python3 bench/bench_server.py --gpus 2 --requests 1 --workers 2,4 \
        --json "$LOG/bench_server_2gpu.json" ;;
  esac
done
echo "== summary"
for k in "${!STATUS[@]}"; do echo "$k ${STATUS[$k]}"; done
