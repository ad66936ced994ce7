#!/usr/bin/env bash
# `make gpu-check`: what needs a CUDA device, for a GPU this project is lent. Not part of
# `make test` or CI (CI has no GPU; tests/test_gpu_check.py runs this script's CPU-side parts).
#
# Uses the machine's own CUDA build of torch as it is: no download, no nested venv.
# GPU_PYTHON (default python3) is the interpreter that has torch, scikit-build-core, cmake,
# ninja and pybind11. It may itself be a venv (a lent image's /opt/torch/.venv): a venv made
# from a venv with --system-site-packages sees the *base* interpreter's packages, not that
# venv's, so the build venv (.gpu-venv, or GPU_VENV) is made from the base interpreter
# (sys._base_executable) without pip and given a .pth file listing GPU_PYTHON's own
# site-packages directories (purelib, platlib and every site dir on its sys.path): torch and
# the build tools are seen from there, mixprec is installed editable into .gpu-venv only, and
# pip (also GPU_PYTHON's) runs offline (--no-index --no-build-isolation --no-deps).
#
# Then: the CUDA kernel tests (tests/kernels), and benchmarks/gpu_check.py (every backend on
# the GPU against the CPU run, parameters and optimizer state, with a negative control; each
# kernel against torch; host syncs under torch.cuda.set_sync_debug_mode("error"); timings).
# The report goes to GPU_CHECK_REPORT (default gpu-check-report.md); its path is printed last.
#
#   bash .ci/gpu_check.sh              # everything; exit 2 without a CUDA device, 1 on a failure
#   bash .ci/gpu_check.sh --venv-only  # only make/refresh the build venv and print its python
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-python3}
VENV=${GPU_VENV:-.gpu-venv}
REPORT=${GPU_CHECK_REPORT:-gpu-check-report.md}
MODE=${1:-all}
case "$MODE" in
  all|--venv-only) ;;
  *) echo "gpu-check: unknown argument '$MODE' (use no argument, or --venv-only)" >&2; exit 64 ;;
esac

if ! command -v "$PY" >/dev/null 2>&1 && [ ! -x "$PY" ]; then
  echo "gpu-check: GPU_PYTHON=$PY is not an interpreter here; point it at the python that has torch." >&2
  exit 2
fi

# Make (or reuse) the build venv. A stamp records which interpreter it was made for, so a
# venv left by another interpreter (or by the old --system-site-packages recipe) is replaced.
make_venv() {
  local info base stamp
  info=$("$PY" - <<'EOF'
import site, sys, sysconfig
base = getattr(sys, "_base_executable", None) or sys.executable
dirs = []
for d in [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]] + [
        p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]:
    if d not in dirs:
        dirs.append(d)
print(base)
print(sys.executable)
for d in dirs:
    print(d)
EOF
) || { echo "gpu-check: $PY could not describe its site-packages" >&2; return 1; }
  base=$(printf '%s\n' "$info" | sed -n 1p)
  stamp="$(printf '%s\n' "$info" | sed -n '2,$p')"
  if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.gpu-check-stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$VENV"
    "$base" -m venv --without-pip "$VENV" || { echo "gpu-check: '$base -m venv' failed" >&2; return 1; }
  fi
  local site_dir
  site_dir=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  # One `import site; site.addsitedir(...)` line per directory: unlike a bare path line this
  # also runs the .pth files inside it (namespace packages, editable installs of GPU_PYTHON).
  printf '%s\n' "$info" | sed -n '3,$p' | while IFS= read -r d; do
    printf 'import site; site.addsitedir(%s)\n' "$("$PY" -c 'import sys; print(repr(sys.argv[1]))' "$d")"
  done > "$site_dir/_gpu_check_parent_site.pth"
  printf '%s\n' "$stamp" > "$VENV/.gpu-check-stamp"
  # Everything the build and the checks import must now be visible from the venv.
  "$VENV/bin/python" -c "
import importlib, sys
missing = []
for name in ('torch', 'pip', 'scikit_build_core', 'pytest'):
    try:
        importlib.import_module(name)
    except Exception as error:
        missing.append(f'{name} ({type(error).__name__}: {error})')
if missing:
    sys.exit('gpu-check: the build venv $VENV cannot import ' + ', '.join(missing) +
             '; install them into $PY (GPU_PYTHON) first')
import torch
print('gpu-check: build venv', sys.prefix, 'python', sys.version.split()[0], 'torch', torch.__version__)
"
}

if [ "$MODE" = "--venv-only" ]; then
  make_venv || exit 1
  echo "$VENV/bin/python"
  exit 0
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: no CUDA device visible to $PY (torch.cuda.is_available() is False)." >&2
  echo "Run it on a machine with an NVIDIA GPU and a CUDA build of torch (GPU_PYTHON=...)." >&2
  exit 2
fi
"$PY" -c "import torch; print('gpu-check: torch', torch.__version__, 'on', torch.cuda.get_device_name(0))"
start=$(date +%s)
make_venv || exit 1
set -e
PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip install -q --no-index \
  --no-build-isolation --no-deps -e . \
  --config-settings=cmake.define.MIXPREC_CUDA=ON --config-settings=build-dir=build/gpu
"$VENV/bin/python" -c "
import sys, mixprec._C as C
info = C.build_info()
print('gpu-check: built', info)
sys.exit(0 if info['cuda'] else 'gpu-check: the extension was built without its CUDA kernels')"
set +e
echo "gpu-check: build took $(( $(date +%s) - start )) s"
status=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/kernels || status=1
"$VENV/bin/python" benchmarks/gpu_check.py --device cuda --report "$REPORT" || status=1
echo "gpu-check: $( [ $status = 0 ] && echo passed || echo FAILED ) in $(( $(date +%s) - start )) s; report: $(pwd)/$REPORT"
exit $status
