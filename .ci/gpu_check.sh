#!/usr/bin/env bash
# `make gpu-check`: what needs a CUDA device, for the first GPU this project gets. Not part
# of `make test` or CI (CI has no GPU). Uses the machine's own CUDA build of torch
# (GPU_PYTHON, default python3): builds mixprec with MIXPREC_CUDA=ON into .gpu-venv (system
# site-packages, so no download is needed), runs the CUDA kernel tests, then
# benchmarks/gpu_check.py (every backend on the GPU vs the CPU, scalar reads per step, and a
# step-time comparison with AdamW(fused=True) + GradScaler).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: no CUDA device visible to $PY (torch.cuda.is_available() is False)." >&2
  echo "Run it on a machine with an NVIDIA GPU and a CUDA build of torch (GPU_PYTHON=...)." >&2
  exit 2
fi
"$PY" -c "import torch; print('gpu-check: torch', torch.__version__, 'on', torch.cuda.get_device_name(0))"
set -e
[ -x .gpu-venv/bin/python ] || "$PY" -m venv --system-site-packages .gpu-venv
.gpu-venv/bin/pip install -q --no-build-isolation --no-deps -e . \
  --config-settings=cmake.define.MIXPREC_CUDA=ON --config-settings=build-dir=build/gpu
.gpu-venv/bin/python -c "
import sys, mixprec._C as C
info = C.build_info()
print('gpu-check: built', info)
sys.exit(0 if info['cuda'] else 'gpu-check: the extension was built without its CUDA kernels')"
status=0
.gpu-venv/bin/python -m pytest -q -p no:cacheprovider tests/kernels || status=1
.gpu-venv/bin/python benchmarks/gpu_check.py || status=1
exit $status
