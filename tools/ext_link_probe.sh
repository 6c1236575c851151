#!/usr/bin/env bash
# Second probe: how setup.py links megatron_peakflat._C on the H200 image, and which link throws cleanly:
# as is, with LDSHARED="$CXX -shared", with CC and CXX unset, and the JIT build. Results:
# docs/evidence/ext_cxx_runtime.txt (run before the fix; after it, every build links torch's runtime).
# It rebuilds megatron_peakflat._C in place four times (rm -rf build first).
set -u
cd "$(dirname "$0")/.."
PY=python3
$PY -c "import sysconfig as s, setuptools; print('setuptools', setuptools.__version__); [print(k, '=', s.get_config_var(k)) for k in ('CC','CXX','LDSHARED','LDCXXSHARED','CFLAGS','LDFLAGS')]"
echo "CC=${CC:-} CXX=${CXX:-} LDSHARED=${LDSHARED:-} LDFLAGS=${LDFLAGS:-} CFLAGS=${CFLAGS:-}"
cat /opt/gcc/bin/g++ 2>/dev/null | head -20
# Two throwing calls on the module C: a bad pool size, and a carve past the pool's end.
THROWS="try:
    C.HostPool(-5, False)
except RuntimeError as e:
    print('raised OK:', str(e)[:70])
p = C.HostPool(1 << 16, False)
try:
    p.carve(1 << 20, torch.float32)
except RuntimeError as e:
    print('raised OK:', str(e)[:70])"
throw_probe() {  # label
  timeout 60 $PY -X faulthandler -c "import torch, megatron_peakflat._C as C
$THROWS" > /tmp/t.out 2>&1
  echo "-- $1: rc=$?"; grep -E "raised|Fatal|Error" /tmp/t.out | head -4 | cut -c1-200
}
so() { ls megatron_peakflat/_C*.so; }
syms() { readelf -d "$(so)" | grep NEEDED | sed 's/.*\[//;s/\]//' | tr '\n' ' '; echo; readelf --dyn-syms -W "$(so)" | grep -E "cxa_throw|gxx_personality|_Unwind_Resume|cxa_begin_catch" | awk '{print $7, $8}' | head -6; }
echo "== 1. setup.py as is (verbose link line)"
rm -rf build megatron_peakflat/_C*.so
$PY setup.py build_ext --inplace --force -v > /tmp/b1.log 2>&1; echo "build rc=$?"
grep -E "(-shared|-o [^ ]*_C[^ ]*\.so)" /tmp/b1.log | grep -v "\-c " | tail -2 | cut -c1-600
syms; throw_probe "setup.py as is"
echo "== 2. setup.py with LDSHARED=\"\$CXX -shared\""
rm -rf build megatron_peakflat/_C*.so
LDSHARED="${CXX:-g++} -shared" $PY setup.py build_ext --inplace --force -v > /tmp/b2.log 2>&1; echo "build rc=$?"
grep -E "(-shared|-o [^ ]*_C[^ ]*\.so)" /tmp/b2.log | grep -v "\-c " | tail -1 | cut -c1-600
syms; throw_probe "LDSHARED=CXX -shared"
echo "== 3. setup.py with CC and CXX unset (the PATH's gcc/g++)"
rm -rf build megatron_peakflat/_C*.so
env -u CC -u CXX $PY setup.py build_ext --inplace --force -v > /tmp/b3.log 2>&1; echo "build rc=$?"
grep -E "(-shared|-o [^ ]*_C[^ ]*\.so)" /tmp/b3.log | grep -v "\-c " | tail -1 | cut -c1-600
syms; throw_probe "CC, CXX unset"
echo "== 4. JIT build (PEAKFLAT_JIT=1, torch.utils.cpp_extension.load)"
rm -rf build megatron_peakflat/_C*.so
PEAKFLAT_JIT=1 timeout 300 $PY -X faulthandler -c "
import torch
from megatron_peakflat import _ext
C = _ext.load(); print('jit', C, _ext.reason())
$THROWS" > /tmp/t4.out 2>&1
echo "-- jit: rc=$?"; grep -E "jit|raised|Fatal|Error" /tmp/t4.out | head -6 | cut -c1-250
