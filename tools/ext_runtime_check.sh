#!/usr/bin/env bash
# The extension built by setup.py and by the JIT path on the H200 image (CXX=/opt/gcc/bin/g++), after the
# fix: which C++ runtime it needs, tests/test_ext.py and the GPU optimizer/SCO tests, and a JIT build that
# throws. Needs .whl/ in the tree (tools/gpu_run.sh setup). Results: docs/evidence/ext_cxx_runtime.txt.
set -u
cd "$(dirname "$0")/.."
S=$(date +%s)
bash tools/gpu_run.sh setup 2>&1 | grep -E "building megatron|=== .* rc=|torch .* mcore"
export PYTHONPATH=/tmp/site:$PWD PYTHONWARNINGS=ignore
so=$(ls megatron_peakflat/_C*.so)
echo "NEEDED: $(readelf -d "$so" | grep NEEDED | sed 's/.*\[//;s/\]//' | tr '\n' ' ')"
readelf --dyn-syms -W "$so" | grep -E " __cxa_throw(@|$)| __gxx_personality_v0(@|$)" | awk '{print $7, $8}'
python3 -m pytest -q -ra -p no:cacheprovider tests/test_ext.py tests/gpu/test_optimizer_gpu.py tests/gpu/test_sco_gpu.py 2>&1 | tail -n 6
echo "== JIT build (PEAKFLAT_JIT=1), the prebuilt module moved aside"
mv "$so" /tmp/prebuilt_C.so
PEAKFLAT_JIT=1 timeout 300 python3 -X faulthandler -c "
import torch
from megatron_peakflat import _ext
C = _ext.load(); print('jit', C.__file__, _ext.reason(), 'cuda', C.with_cuda)
for f in (lambda: C.HostPool(-5, False), lambda: C.HostPool(1 << 16, False).carve(1 << 20, torch.float32)):
    try:
        f()
    except RuntimeError as e:
        print('raised OK:', str(e)[:90])" 2>&1 | tail -n 4
echo "JIT rc=${PIPESTATUS[0]}"
jso=$(ls ~/.cache/torch_extensions/*/megatron_peakflat_C/*.so 2>/dev/null | head -1)
[[ -n "$jso" ]] && echo "JIT NEEDED: $(readelf -d "$jso" | grep NEEDED | sed 's/.*\[//;s/\]//' | tr '\n' ' ')"
mv /tmp/prebuilt_C.so "$so"
echo "total $(( $(date +%s) - S )) s"
