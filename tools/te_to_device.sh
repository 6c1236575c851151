#!/usr/bin/env bash
# Bring Transformer Engine to an offline GPU machine that takes at most 64 MiB of files per command, and
# build its PyTorch extension there (TE 2.20.2 by default, for tests/gpu/test_te_gpu.py and bench/e2e.py).
#
#   here:   bash tools/te_to_device.sh fetch      # .tep1 ... .tep5 (ignored): TE's 276 MB core wheel in 5 parts,
#                                                 # its torch extension's sdist and the wheels TE needs
#   there:  one run per part, with .tepN copied:   bash tools/te_to_device.sh receive N   (the machine keeps
#                                                 # /tmp between runs, not a copied folder that the next run lacks)
#   there:  bash tools/te_to_device.sh build      # assemble, install into /tmp/site, build for sm_90 (~100 s);
#                                                 # the run that has .tep5 copied can receive and build at once
#
# A part with the working tree stays under the 64 MiB a run may copy (58 MB each; .tep5 61 MB): copy nothing
# else beside one, and run the parts back to back, since a machine left idle loses its /tmp.
# `build` is a no-op where TE already imports from /tmp/site, and refuses with the missing parts named.
#
# Then: export PYTHONPATH=/tmp/site:$PWD; python3 -m pytest tests/gpu/test_te_gpu.py
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
TE=${TE_VERSION:-2.20.2}
CORE=transformer_engine_cu13-$TE-py3-none-manylinux_2_28_x86_64.whl
case "${1:-}" in
  fetch)
    PY=${PYTHON:-python3}
    tmp=$(mktemp -d)
    $PY -m pip download -q --no-deps -d "$tmp" "transformer_engine_cu13==$TE" "transformer_engine==$TE" \
      "transformer_engine_torch==$TE"
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp" \
      pydantic pydantic-core annotated-types typing-inspection "typing_extensions>=4.16" nvdlfw-inspect \
      "nvidia-cudnn-frontend>=1.29.0"
    for i in 1 2 3 4 5; do mkdir -p .tep$i; grep -qx "/.tep$i/" .git/info/exclude || echo "/.tep$i/" >> .git/info/exclude; done
    split -b 58000000 -d -a 1 "$tmp/$CORE" "$tmp/cu13.part" && rm "$tmp/$CORE"
    for i in 0 1 2 3; do mv "$tmp/cu13.part$i" .tep$((i + 1))/; done
    mv "$tmp/cu13.part4" "$tmp"/*.whl "$tmp"/*.tar.gz .tep5/
    du -sh .tep*
    ;;
  receive)
    n=${2:?usage: $0 receive N (1-5)}
    mkdir -p /tmp/teparts && cp .tep$n/* /tmp/teparts/ && ls /tmp/teparts
    ;;
  build)
    if PYTHONPATH=/tmp/site python3 -c "import transformer_engine.pytorch" >/dev/null 2>&1; then
      echo "TE already built in /tmp/site"; exit 0
    fi
    mkdir -p /tmp/teparts /tmp/tew /tmp/tebuild
    [[ -d .tep5 ]] && cp .tep5/cu13.part4 /tmp/teparts/
    missing=$(for i in 0 1 2 3 4; do [[ -f /tmp/teparts/cu13.part$i ]] || echo -n "cu13.part$i (.tep$((i + 1))) "; done)
    [[ -z "$missing" ]] || { echo "missing on this machine: $missing- receive them first (this machine's /tmp may have been cleared)" >&2; exit 1; }
    [[ -d .tep5 ]] || { echo "build needs .tep5 beside the tree (its wheels and TE's torch sdist)" >&2; exit 1; }
    cat /tmp/teparts/cu13.part{0,1,2,3,4} > /tmp/tew/$CORE
    shopt -s nullglob  # .whl/ (megatron-core and the peers) may have been installed by an earlier run
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .tep5/*.whl /tmp/tew/$CORE
    export PYTHONPATH=/tmp/site:$PWD
    # CUDA's toolkit lacks cuDNN's headers: add every nvidia/*/include of the torch install.
    INC=$(python3 -c "import glob, os, nvidia; print(':'.join(d for r in nvidia.__path__ for d in glob.glob(os.path.join(r, '*', 'include'))))")
    cd /tmp/tebuild
    [[ -d transformer_engine_torch-$TE ]] || tar xzf "$REPO/.tep5/transformer_engine_torch-$TE.tar.gz"
    cd transformer_engine_torch-$TE
    CPLUS_INCLUDE_PATH=$INC NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=90 NVTE_WITH_NCCL_EP=0 MAX_JOBS=${MAX_JOBS:-16} \
      python3 setup.py -q bdist_wheel > /tmp/te_build.log 2>&1 || { tail -40 /tmp/te_build.log; exit 1; }
    # pip --target will not merge into the transformer_engine/ the core wheel made: copy the extension in.
    cp build/lib.*/transformer_engine/wheel_lib/transformer_engine_torch*.so /tmp/site/transformer_engine/wheel_lib/
    python3 -c "import transformer_engine, transformer_engine.pytorch as te; print('TE', transformer_engine.__version__)"
    ;;
  *) echo "usage: $0 fetch|receive N|build" >&2; exit 2 ;;
esac
