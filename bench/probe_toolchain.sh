#!/usr/bin/env bash
# Builds the extension (CPU only, fast) several ways and probes C++ exceptions in each: finds a
# toolchain setting under which C++ errors surface as Python exceptions. Args: LOG_DIR.
set -u
LOG=$1
{
  echo "== toolchain"; which -a g++ c++ gcc 2>&1; g++ --version | head -1; ls /usr/bin/g++* 2>&1
  python3 -c "import sys; print(sys.version)"; ldd "$(python3 -c 'import sys; print(sys.executable)')" 2>&1
  nm -D --defined-only "$(python3 -c 'import sys; print(sys.executable)')" 2>/dev/null | grep -c -E "_Unwind|__cxa" || true
} >"$LOG/toolchain.txt" 2>&1
for variant in default static system; do
  dir=/tmp/probe-$variant
  args=(-DLMCACHE_MP_CUDA=OFF)
  [ $variant = static ] && args+=(-DLMCACHE_MP_STATIC_CXX_RUNTIME=ON)
  env=()
  [ $variant = system ] && { [ -x /usr/bin/g++ ] || { echo "$variant: no /usr/bin/g++" >>"$LOG/toolchain.txt"; continue; }; env=(CXX=/usr/bin/g++); }
  rm -rf $dir; mkdir -p $dir
  env "${env[@]}" python3 -m pip install -q --no-build-isolation --no-deps --target $dir/site \
    $(printf -- '-Ccmake.define.%s ' "${args[@]#-D}") . >"$LOG/build-$variant.log" 2>&1 || { echo "$variant: build failed"; continue; }
  echo "== $variant" >>"$LOG/toolchain.txt"
  ldd $dir/site/lmcache_mp/_C*.so >>"$LOG/toolchain.txt" 2>&1
  PYTHONPATH=$dir/site:${PYTHONPATH:-} python3 bench/probe_binding.py 2>&1 | sed "s/^/$variant: /" | tee -a "$LOG/toolchain.txt"
done
