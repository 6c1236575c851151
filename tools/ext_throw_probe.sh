#!/usr/bin/env bash
# Why does an exception thrown by megatron_peakflat._C kill the interpreter on the H200 image?
# The toolchain, the C++ runtime a torch process loads, the extension's links, four throwing calls in fresh
# interpreters, and four minimal load_inline extensions that throw. Results: docs/evidence/ext_cxx_runtime.txt.
# Run on the GPU machine after `python3 setup.py build_ext --inplace` (as it was, before the fix).
set -u
cd "$(dirname "$0")/.."
PY=python3
echo "== toolchain"
which g++ c++ gcc cc 2>&1; echo "CXX=${CXX:-} CC=${CC:-}"
g++ --version 2>&1 | head -1; /usr/bin/g++ --version 2>&1 | head -1; ls /opt/gcc/bin 2>&1 | head; ls /opt/gcc/lib64 2>&1 | grep -i "stdc\|gcc_s" | head
$PY -c "import torch; print(torch.__version__); print(torch.__config__.show())" 2>&1 | grep -iE "^2|gcc|compiler|cxx11|CXX_FLAGS" | cut -c1-300
$PY -c "import torch; print('cxx11abi', torch._C._GLIBCXX_USE_CXX11_ABI)"
echo "== which libstdc++ / libgcc_s does a torch process load"
$PY -c "import torch, megatron_peakflat._C as C; print(C.__file__); print(''.join(sorted({l.split()[-1]+chr(10) for l in open('/proc/self/maps') if 'stdc++' in l or 'gcc_s' in l or 'libgomp' in l})))"
so=$(ls megatron_peakflat/_C*.so); echo "$so"; ldd "$so" | grep -iE "stdc|gcc_s|gomp|cudart|c10"
readelf -d "$so" | grep -iE "rpath|runpath|needed" | head -20
strings "$so" | grep -E "^GCC: " | sort -u | head
echo "== probes (fresh interpreter each)"
probe() {  # name, python code
  echo "-- $1"
  timeout 60 $PY -X faulthandler -c "$2" > /tmp/probe.out 2>&1; echo "rc=$?"; tail -n 12 /tmp/probe.out | cut -c1-300
}
probe carve-no-torch-cuda "import torch, megatron_peakflat._C as C
p = C.HostPool(1 << 16, False)
try:
    p.carve(1 << 20, torch.float32)
except RuntimeError as e:
    print('raised OK:', str(e)[:80])"
probe carve-after-cuda-init "import torch; torch.cuda.init(); import megatron_peakflat._C as C
p = C.HostPool(1 << 16, False)
try:
    p.carve(1 << 20, torch.float32)
except RuntimeError as e:
    print('raised OK:', str(e)[:80])"
probe adamw-bad "import torch, megatron_peakflat._C as C
try:
    C.adamw_step(torch.zeros(8), torch.zeros(4), torch.zeros(8), torch.zeros(8), None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 1)
except RuntimeError as e:
    print('raised OK:', str(e)[:80])"
probe hostpool-bad-size "import torch, megatron_peakflat._C as C
try:
    C.HostPool(-5, False)
except RuntimeError as e:
    print('raised OK:', str(e)[:80])"
if command -v gdb >/dev/null; then
  echo "-- gdb backtrace of carve"
  timeout 120 gdb -q -batch -ex run -ex bt --args $PY -c "import torch, megatron_peakflat._C as C
C.HostPool(1 << 16, False).carve(1 << 20, torch.float32)" 2>&1 | grep -vE "^\[(New|Thread)" | tail -n 40 | cut -c1-250
else echo "no gdb"; fi
echo "== minimal inline extensions (torch.utils.cpp_extension.load_inline)"
cat > /tmp/inline_probe.py <<'PYEOF'
import sys, torch
from torch.utils.cpp_extension import load_inline
variant = sys.argv[1]
src = r'''
#include <torch/extension.h>
#include <stdexcept>
void std_throw() { throw std::runtime_error("std throw reached python"); }
void torch_check() { TORCH_CHECK(false, "TORCH_CHECK reached python"); }
'''
kw = dict(extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"]) if "omp" in variant else {}
if "cuda" in variant:
    kw["with_cuda"] = True
m = load_inline(f"probe_{variant}", [src], functions=["std_throw", "torch_check"], verbose=False, **kw)
for f in (m.std_throw, m.torch_check):
    try:
        f()
    except RuntimeError as e:
        print(variant, "raised OK:", e.__class__.__name__, str(e).splitlines()[0][:60])
PYEOF
for v in plain omp cuda cuda_omp; do
  ( timeout 300 $PY -X faulthandler /tmp/inline_probe.py $v > /tmp/inline_$v.out 2>&1; echo "rc=$?" >> /tmp/inline_$v.out ) &
done
wait
for v in plain omp cuda cuda_omp; do echo "-- inline $v"; tail -n 8 /tmp/inline_$v.out | cut -c1-300; done
