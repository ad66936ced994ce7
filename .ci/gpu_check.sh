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
# Then, each phase timed and the times printed and added to the report (the whole is meant
# to fit 6 minutes on one H100/H200, build included):
#   build        mixprec with its CUDA kernels, for this GPU's architecture only (GPU_CHECK_CUDA_ARCHS,
#                default the device's capability, e.g. 90; AUTO builds every generation), ninja
#                on every core; build/gpu is reused by a later run on the same machine
#   cuda tests   the tests marked `cuda` (tests/kernels/test_kernels_cuda.py, tests/test_gpu_*.py):
#                none of the CPU kernel tests, which `make test` runs
#   gpu_check    benchmarks/gpu_check.py --device cuda: every backend x precision at world 1 and 2
#                judged per tensor against float64, with its negative controls; the kernels
#                against torch; peak memory and step time against plain AMP. It starts nothing
#                new after GPU_CHECK_BUDGET_S (default 240) seconds: what is left is reported FAILED.
# The report goes to GPU_CHECK_REPORT (default gpu-check-report.md); its path is printed last.
# Every phase has a time limit (timeout), so a hang costs minutes, not the device session.
#
#   bash .ci/gpu_check.sh              # everything; exit 2 without a CUDA device, 1 on a failure
#   bash .ci/gpu_check.sh --venv-only  # only make/refresh the build venv and print its python
#   bash .ci/gpu_check.sh --dry-run    # no GPU needed: every phase prints its command instead of
#                                      # running it, and the report gets the phase table (the CPU
#                                      # test of this script's own logic, tests/test_gpu_check.py)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-python3}
VENV=${GPU_VENV:-.gpu-venv}
REPORT=${GPU_CHECK_REPORT:-gpu-check-report.md}
case "$REPORT" in /*) ;; *) REPORT="$(pwd)/$REPORT" ;; esac
MODE=${1:-all}
case "$MODE" in
  all|--venv-only|--dry-run) ;;
  *) echo "gpu-check: unknown argument '$MODE' (use no argument, --venv-only or --dry-run)" >&2; exit 64 ;;
esac
DRY=()  # --dry-run: the phases' commands are printed, not run
[ "$MODE" = "--dry-run" ] && DRY=(echo "gpu-check: would run:")

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

if [ "$MODE" = "--dry-run" ]; then
  echo "gpu-check: dry run: nothing is built or run, each phase prints its command"
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: no CUDA device visible to $PY (torch.cuda.is_available() is False)." >&2
  echo "Run it on a machine with an NVIDIA GPU and a CUDA build of torch (GPU_PYTHON=...)." >&2
  exit 2
else
  "$PY" -c "import torch; print('gpu-check: torch', torch.__version__, 'on', torch.cuda.get_device_name(0))"
fi

PHASES=()   # "name seconds status" lines, in order
start=$(date +%s)
phase_start=$start
end_phase() {  # end_phase NAME STATUS: record and print the phase's time
  local now; now=$(date +%s)
  PHASES+=("$1 $(( now - phase_start )) $2")
  echo "gpu-check: phase $1: $(( now - phase_start )) s ($2)"
  phase_start=$now
}
append_phases() {  # the shell's phases at the end of the report (written by gpu_check.py, or here)
  if [ ! -f "$REPORT" ]; then
    if [ "$MODE" = "--dry-run" ]; then
      printf '# gpu-check report (dry run: nothing was built or run)\n' > "$REPORT"
    else
      printf '# gpu-check report (FAILED before benchmarks/gpu_check.py wrote one)\n' > "$REPORT"
    fi
  fi
  {
    printf '\n## Phases of .ci/gpu_check.sh\n\n| phase | seconds | status |\n|---|---|---|\n'
    for p in "${PHASES[@]}"; do set -- $p; printf '| %s | %s | %s |\n' "$1" "$2" "$3"; done
    printf '| total | %s | |\n' "$(( $(date +%s) - start ))"
  } >> "$REPORT"
}
finish() {  # finish STATUS
  append_phases
  echo "gpu-check: phases: ${PHASES[*]}"
  echo "gpu-check: $( [ "$1" = 0 ] && echo passed || echo FAILED ) in $(( $(date +%s) - start )) s; report: $REPORT"
  exit "$1"
}
rm -f "$REPORT"

if [ "$MODE" = "--dry-run" ]; then
  echo "gpu-check: would make the build venv $VENV from $PY (bash .ci/gpu_check.sh --venv-only does it)"
elif ! make_venv; then
  end_phase venv failed; finish 1
fi
end_phase venv ok

# This GPU's architecture only, unless told otherwise: one nvcc pass instead of one per generation.
if [ -z "${GPU_CHECK_CUDA_ARCHS:-}" ] && [ "$MODE" != "--dry-run" ]; then
  if ! GPU_CHECK_CUDA_ARCHS=$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(0); print(f'{m}{n}')"); then
    echo "gpu-check: could not read the device's compute capability; set GPU_CHECK_CUDA_ARCHS (e.g. 90)" >&2
    end_phase build failed; finish 1
  fi
fi
ARCHS=${GPU_CHECK_CUDA_ARCHS:-90}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
echo "gpu-check: building for CUDA archs $ARCHS with $CMAKE_BUILD_PARALLEL_LEVEL jobs"
if ! PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 ${DRY[@]+"${DRY[@]}"} timeout "${GPU_CHECK_BUILD_TIMEOUT_S:-900}" \
    "$VENV/bin/python" -m pip install -q --no-index --no-build-isolation --no-deps -e . \
    --config-settings=cmake.define.MIXPREC_CUDA=ON --config-settings=cmake.define.MIXPREC_CUDA_ARCHS="$ARCHS" \
    --config-settings=build-dir=build/gpu; then
  echo "gpu-check: the build failed (or ran past GPU_CHECK_BUILD_TIMEOUT_S)" >&2
  end_phase build failed; finish 1
fi
if [ "$MODE" != "--dry-run" ] && ! "$VENV/bin/python" -c "
import sys, mixprec._C as C
info = C.build_info()
print('gpu-check: built', info)
sys.exit(0 if info['cuda'] else 'gpu-check: the extension was built without its CUDA kernels')"; then
  end_phase build failed; finish 1
fi
end_phase build ok

status=0
# Only the tests marked `cuda` (the CPU kernel tests run in `make test`, not on the device's time).
if ${DRY[@]+"${DRY[@]}"} timeout "${GPU_CHECK_TESTS_TIMEOUT_S:-300}" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m cuda \
    tests/kernels tests/test_gpu_paths.py; then
  end_phase cuda-tests ok
else
  status=1; end_phase cuda-tests FAILED
fi

BUDGET=${GPU_CHECK_BUDGET_S:-240}
if ${DRY[@]+"${DRY[@]}"} timeout $(( BUDGET + 180 )) "$VENV/bin/python" benchmarks/gpu_check.py --device cuda --budget-s "$BUDGET" \
    --report "$REPORT"; then
  end_phase gpu_check ok
else
  status=1; end_phase gpu_check FAILED
fi
finish $status
