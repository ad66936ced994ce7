#!/usr/bin/env bash
# Compile-only check of the CUDA build (no GPU, CPU torch wheel), against the headers of the
# CUDA wheel of the installed torch's release: what a CUDA build of mixprec compiles.
#
# What is checked:
# 1. every csrc/**/*.cu compiles with the installed nvcc for every arch a build would use
#    (MIXPREC_CUDA_ARCHS, default AUTO: build_support/cuda_archs.cmake resolves it against
#    this nvcc, e.g. sm_75/80/86/89/90/100/120 + PTX compute_120 with CUDA 13.0), with _C's
#    defines and torch's (USE_DISTRIBUTED, USE_C10D_GLOO, USE_C10D_NCCL: the CUDA wheel's
#    Caffe2Targets.cmake); the object is then read back (build_support/fatbin_archs.py) to
#    check it holds machine code / PTX for exactly those archs.
# 2. the host code under MIXPREC_WITH_CUDA (csrc/kernels/ops.cpp: device guard, current
#    stream, torch's foreach ops; csrc/bindings/module.cpp) compiles with g++
#    -DMIXPREC_WITH_CUDA=1 against the same headers (they have cuda_cmake_macros.h; the CPU
#    wheel's do not).
# The headers are fetched once (~0.5-0.9 GB download, ~65 MB kept) by
# .ci/torch_headers_check.sh --fetch into its cache; if they can be neither fetched nor found
# in the cache the check fails. Logs and each compile's command are kept in
# $MIXPREC_COMPAT_LOGS (default build/compat-logs)/cuda/. Other torch releases (2.11, 2.12):
# .ci/torch_headers_check.sh (every .cpp and .cu, one arch).
set -uo pipefail
cd "$(dirname "$0")/.."
source build_support/compile_checks.sh
PY=${PYTHON:-.venv/bin/python}
JOBS=${JOBS:-2}
LOGS=${MIXPREC_COMPAT_LOGS:-build/compat-logs}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/bin/nvcc)}
[ -x "$NVCC" ] || { echo "FAIL: nvcc not found (set NVCC)"; exit 1; }
start=$(date +%s)
read -r ABI TORCH_RELEASE < <("$PY" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI), torch.__version__.split('+')[0])")
[ -n "${TORCH_RELEASE:-}" ] || { echo "FAIL: cannot import torch with $PY"; exit 1; }
archs=$(cuda_archs) || { echo "FAIL: cannot resolve the CUDA archs for $NVCC"; exit 1; }
logdir="$LOGS/cuda"
rm -rf "$logdir" && mkdir -p "$logdir"
if ! inc=$(bash .ci/torch_headers_check.sh --fetch "$TORCH_RELEASE" 2>"$logdir/fetch.log"); then
  cat "$logdir/fetch.log"
  echo "FAIL: no CUDA torch $TORCH_RELEASE headers: the .cu files and MIXPREC_WITH_CUDA=1 cannot be checked"
  exit 1
fi
[ -f "$inc/c10/cuda/impl/cuda_cmake_macros.h" ] || {
  echo "FAIL: $inc is not a CUDA build's include dir (no c10/cuda/impl/cuda_cmake_macros.h)"; exit 1; }
defines=$(torch_defines "$(dirname "$inc")") || { echo "FAIL: cannot read torch's compile definitions"; exit 1; }
mapfile -t tdefs <<<"$defines"
CUDA_INCLUDE=$(cd "$(dirname "$(readlink -f "$NVCC")")/../include" 2>/dev/null && pwd)
[ -f "${CUDA_INCLUDE:-}/cuda_runtime.h" ] || CUDA_INCLUDE=/usr/local/cuda/include
[ -f "$CUDA_INCLUDE/cuda_runtime.h" ] || { echo "FAIL: no cuda_runtime.h next to $NVCC or in /usr/local/cuda/include"; exit 1; }
PY_INC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
caps=""
[ "$(uname -m)" = x86_64 ] && { caps=$(cpu_caps) || exit 1; }
# _C's include dirs and defines (CMakeLists.txt), as in .ci/torch_headers_check.sh.
ext=(-Icsrc -isystem "$inc" -isystem "$inc/torch/csrc/api/include" -isystem "$PY_INC"
     -isystem "$CUDA_INCLUDE" -D_GLIBCXX_USE_CXX11_ABI="$ABI" -DNDEBUG "${tdefs[@]}"
     -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H
     -DMIXPREC_TORCH_VERSION="\"$TORCH_RELEASE\"" -DMIXPREC_WITH_CUDA=1
     -DMIXPREC_CUDA_ARCHS="\"${archs//;/,}\"")
for c in $caps; do ext+=(-DMIXPREC_CPU_$c=1); done
IFS=';' read -r -a arch_list <<<"$archs"
mapfile -t gencode < <(gencode_flags "${arch_list[@]}")
cu_sources=$(find csrc -name '*.cu' | sort)
for cu in $cu_sources; do
  add_job "$logdir" "$(echo "$cu" | tr '/' '_')" "nvcc $archs $cu" \
    "$NVCC" -c "$cu" -o "$logdir/$(echo "$cu" | tr '/' '_').o" "${gencode[@]}" -std=c++17 -O3 \
    --expt-relaxed-constexpr --expt-extended-lambda -Xcompiler=-fPIC "${ext[@]}"
done
host_files=$(grep -rl 'MIXPREC_WITH_CUDA' csrc --include='*.cpp' | sort)
for f in $host_files; do
  add_job "$logdir" "host_$(echo "$f" | tr '/' '_')" "g++ MIXPREC_WITH_CUDA=1 $f" \
    g++ -fsyntax-only -std=c++17 -fPIC -fopenmp -Wall -Wno-unused-parameter "${ext[@]}" "$f"
done
fail=0
run_jobs "$logdir" "$JOBS" || fail=1
# The objects must hold exactly the archs asked for.
want=$(for e in "${arch_list[@]}"; do n=${e%-real}; n=${n%-virtual}
  case "$e" in *-real) echo "sm_$n" ;; *-virtual) echo "compute_$n" ;; *) echo "sm_$n"; echo "compute_$n" ;; esac
  done | sort | paste -sd' ')
if [ "$fail" -eq 0 ]; then
  for cu in $cu_sources; do
    obj="$logdir/$(echo "$cu" | tr '/' '_').o"
    held=$(python3 build_support/fatbin_archs.py "$obj")
    got=$(echo "$held" | tr ' ' '\n' | sort | paste -sd' ')
    if [ "$got" = "$want" ]; then echo "ok    $cu holds $held"
    else echo "ERROR $cu holds '$got', expected '$want'"; fail=1
    fi
  done
fi
secs=$(( $(date +%s) - start ))
echo "logs and commands: $logdir"
if [ "$fail" -eq 0 ]; then
  echo "PASS: $(echo $cu_sources | wc -w) .cu files compile for $archs with $("$NVCC" --version | tail -1)," \
    "and $(echo $host_files | wc -w) .cpp with MIXPREC_WITH_CUDA=1, against torch $TORCH_RELEASE's CUDA headers (${secs}s)"
else
  echo "FAIL: CUDA compile check (${secs}s)"
fi
exit "$fail"
