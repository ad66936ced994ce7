#!/usr/bin/env bash
# Compile-only check of everything csrc/ ships against the headers of several torch releases,
# without installing them (no GPU, no torch import needed).
#
# Usage: bash .ci/torch_headers_check.sh [VERSION|INCLUDE_DIR ...]
#        bash .ci/torch_headers_check.sh --fetch VERSION   (only fetch; prints the include dir)
#   VERSION      a torch release on PyPI, e.g. 2.11.0: its linux wheel (a CUDA build, ~0.5-0.9
#                GB) is downloaded once; only torch/include, torch/share/cmake and
#                torch/version.py are kept, in $MIXPREC_TORCH_HEADERS_CACHE (default
#                ~/.cache/mixprec/torch-headers/<version>, ~65 MB), the wheel is deleted.
#   INCLUDE_DIR  an existing torch include dir (.../torch/include, with ../share/cmake beside it).
#   Default: 2.11.0 2.12.0 (oldest supported, downloaded) and the torch of $PYTHON
#   (the venv's 2.13, the version CI builds and tests).
#
# What is compiled, per header set, with the flags CMakeLists.txt gives each file
# (build_support/compile_checks.sh reads them from CMakeLists.txt and torch's CMake config):
#  - every csrc/**/*.cpp, g++ -fsyntax-only, MIXPREC_WITH_CUDA=0: _C's defines
#    (_GLIBCXX_USE_CXX11_ABI, TORCH_EXTENSION_NAME=_C, TORCH_API_INCLUDE_EXTENSION_H,
#    MIXPREC_CPU_<cap>=1, NDEBUG), torch's own (USE_DISTRIBUTED, USE_C10D_GLOO, and
#    USE_C10D_NCCL for a CUDA build: its Caffe2Targets.cmake), -fopenmp, Python.h;
#  - csrc/kernels/cpu/simd/*.cpp again per x86 capability (AVX2, AVX512) as CMake's object
#    libraries compile them: -DCPU_CAPABILITY=<cap>, its -m flags, -O3 -ffp-contract=off,
#    compiled to an object (not -fsyntax-only: a target-option mismatch only shows in codegen);
#  - for a CUDA build's headers (c10/cuda/impl/cuda_cmake_macros.h; the CPU wheel lacks it),
#    with the CUDA toolkit's headers: the .cpp files that test MIXPREC_WITH_CUDA again with
#    MIXPREC_WITH_CUDA=1, and every csrc/**/*.cu with nvcc (PTX for the oldest and newest arch
#    of build_support/cuda_archs.cmake; .ci/cuda_compile_check.sh builds every arch).
# A release that cannot be downloaded, with no cached copy, is a failure, as is a CUDA header
# set without nvcc or the CUDA headers. Logs and the exact command of each compile are kept
# in $MIXPREC_COMPAT_LOGS (default build/compat-logs)/torch-<version>/. Files run $JOBS at a
# time (default 2).
set -uo pipefail
cd "$(dirname "$0")/.."
source build_support/compile_checks.sh
PY=${PYTHON:-.venv/bin/python}
JOBS=${JOBS:-2}
CACHE=${MIXPREC_TORCH_HEADERS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mixprec/torch-headers}
LOGS=${MIXPREC_COMPAT_LOGS:-build/compat-logs}
CXX=${CXX:-g++}
CXX_STD=${CXX_STD:-c++17}  # CMakeLists.txt's CMAKE_CXX_STANDARD; torch >= 2.14 needs c++20
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/bin/nvcc)}
CUDA_INCLUDE=${CUDA_INCLUDE:-}
if [ -z "$CUDA_INCLUDE" ]; then
  for d in /usr/local/cuda/include "$(dirname "$(readlink -f "$NVCC")")/../include"; do
    if [ -f "$d/cuda_runtime.h" ]; then CUDA_INCLUDE=$(cd "$d" && pwd); break; fi
  done
fi

# Prints the include dir of torch VERSION, downloading it into the cache if needed. Returns 2
# (and says why on stderr) when it cannot be had: no network and no cached copy.
fetch_headers() {
  local v=$1 dest="$CACHE/$1"
  if [ -f "$dest/torch/include/torch/headeronly/version.h" ] \
      && [ -f "$dest/torch/share/cmake/Caffe2/Caffe2Targets.cmake" ]; then
    echo "$dest/torch/include"; return 0
  fi
  mkdir -p "$CACHE" || return 2
  local tmp
  tmp=$(mktemp -d "${CACHE}/.dl-$v.XXXXXX") || return 2
  [ -d "$dest" ] && echo "the cached torch $v in $dest predates torch/share/cmake (torch's compile definitions): fetching it again" >&2
  echo "fetching torch==$v wheel headers into $dest ..." >&2
  # `===`: exactly this release, never a local "+cpu" build a find-links dir may hold
  # (pip ranks 2.13.0+cpu above 2.13.0 for ==2.13.0); PyPI's linux wheel is the CUDA build.
  if ! "$PY" -m pip download -q --no-deps "torch===$v" -d "$tmp" --python-version 3.11 \
      --platform manylinux_2_28_x86_64 --only-binary=:all: >"$tmp/pip.log" 2>&1; then
    local why="pip could not download its wheel" index
    index=${PIP_INDEX_URL:-https://pypi.org/simple}
    "$PY" -c "import sys, urllib.request as u; u.urlopen(sys.argv[1].rstrip('/') + '/torch/', timeout=10)" \
      "$index" >/dev/null 2>&1 || why="the package index is unreachable ($index/torch/ cannot be read)"
    echo "cannot fetch torch $v: $why, and there is no cached copy in $dest. Run" >&2
    echo "    bash .ci/torch_headers_check.sh --fetch $v" >&2
    echo "where the index is reachable (or copy a torch $v's include/ and share/cmake/ there)." >&2
    echo "Last lines of pip's output:" >&2
    grep -v '^WARNING' "$tmp/pip.log" | tail -n 2 | sed 's/^/    /' >&2
    rm -rf "$tmp"; return 2
  fi
  local whl
  whl=$(ls "$tmp"/torch-*.whl 2>/dev/null | head -n 1)
  if [ -z "$whl" ] || ! unzip -q -o "$whl" 'torch/include/*' 'torch/share/cmake/*' 'torch/version.py' -d "$tmp/x"; then
    echo "cannot fetch torch $v: could not unpack the headers of '$whl'" >&2
    rm -rf "$tmp"; return 2
  fi
  rm -rf "$dest" && mv "$tmp/x" "$dest" && rm -rf "$tmp"
  echo "$dest/torch/include"
}

if [ "${1:-}" = "--fetch" ]; then
  [ $# -eq 2 ] || { echo "usage: $0 --fetch VERSION (e.g. 2.11.0)"; exit 1; }
  fetch_headers "$2"
  exit $?
fi

PYTHON_INCLUDE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])" 2>/dev/null)
[ -n "$PYTHON_INCLUDE" ] && [ -f "$PYTHON_INCLUDE/Python.h" ] || {
  echo "FAIL: Python.h not found (python3's include dir: '${PYTHON_INCLUDE}'); install the Python dev headers"
  exit 1; }
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(2.11.0 2.12.0)
  venv_inc=$("$PY" -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))" 2>/dev/null) \
    && targets+=("$venv_inc") || echo "note: cannot import torch with $PY; its headers are not checked"
fi
sources=$(find csrc -name '*.cpp' | sort)
cuda_sources=$(grep -l 'MIXPREC_WITH_CUDA' $sources)
cu_sources=$(find csrc -name '*.cu' | sort)
simd_sources=$(ls csrc/kernels/cpu/simd/*.cpp | sort)
caps=""
if [ "$(uname -m)" = x86_64 ]; then
  caps=$(cpu_caps) || { echo "FAIL: cannot read the CPU capabilities from CMakeLists.txt"; exit 1; }
fi
start=$(date +%s)
fail=0; checked=(); failed=(); logdirs=()
for t in "${targets[@]}"; do
  if [ -d "$t" ]; then inc=$(cd "$t" && pwd)
  else inc=$(fetch_headers "$t") || { failed+=("$t (not fetched)"); fail=1; continue; }
  fi
  vh="$inc/torch/headeronly/version.h"
  [ -f "$vh" ] || { echo "FAIL: $inc has no torch/headeronly/version.h: not the include dir of a torch >= 2.11"; failed+=("$t"); fail=1; continue; }
  ver=$(for k in MAJOR MINOR PATCH; do sed -n "s/^#define TORCH_VERSION_$k \([0-9]*\).*/\1/p" "$vh"; done | paste -sd.)
  defines=$(torch_defines "$(dirname "$inc")") || { echo "FAIL: torch $ver"; failed+=("$ver"); fail=1; continue; }
  # Every wheel torch >= 2.7 publishes for linux uses the new libstdc++ ABI; an installed
  # torch says so itself.
  ABI=1
  if [ "$t" = "${venv_inc:-}" ]; then ABI=$("$PY" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"); fi
  cuda_build=0; [ -f "$inc/c10/cuda/impl/cuda_cmake_macros.h" ] && cuda_build=1
  if [ $cuda_build = 1 ]; then
    [ -n "$CUDA_INCLUDE" ] || { echo "FAIL: torch $ver is a CUDA build but no CUDA toolkit include dir was found (set CUDA_INCLUDE)"; failed+=("$ver"); fail=1; continue; }
    [ -x "$NVCC" ] || { echo "FAIL: torch $ver is a CUDA build but nvcc was not found (set NVCC): its .cu files cannot be checked"; failed+=("$ver"); fail=1; continue; }
    archs=$(cuda_archs) || { echo "FAIL: torch $ver: cannot resolve the CUDA archs"; failed+=("$ver"); fail=1; continue; }
  fi
  logdir="$LOGS/torch-$ver"
  rm -rf "$logdir" && mkdir -p "$logdir"
  logdirs+=("$logdir")
  mapfile -t tdefs <<<"$defines"
  # Include dirs and defines: `base` every file's, `ext` _C's (CMakeLists.txt's target_*
  # for _C and what linking torch adds); `cxx` the C++ flags (nvcc gets its own).
  base=(-Icsrc -isystem "$inc" -isystem "$inc/torch/csrc/api/include" -D_GLIBCXX_USE_CXX11_ABI="$ABI" -DNDEBUG)
  ext=("${base[@]}" "${tdefs[@]}" -isystem "$PYTHON_INCLUDE" -DTORCH_EXTENSION_NAME=_C
       -DTORCH_API_INCLUDE_EXTENSION_H -DMIXPREC_TORCH_VERSION="\"$ver\"")
  for c in $caps; do ext+=(-DMIXPREC_CPU_$c=1); done
  [ $cuda_build = 1 ] && ext+=(-isystem "$CUDA_INCLUDE")
  cxx=(-std="$CXX_STD" -fPIC -Wall -Wno-unused-parameter)
  for f in $sources; do
    add_job "$logdir" "$(echo "$f" | tr '/' '_').cuda0" "cuda=0 $f" \
      "$CXX" -fsyntax-only -fopenmp "${cxx[@]}" "${ext[@]}" -DMIXPREC_WITH_CUDA=0 -DMIXPREC_CUDA_ARCHS='""' "$f"
  done
  for c in $caps; do
    flags=$(cpu_cap_flags "$c") || { fail=1; continue; }
    for f in $simd_sources; do
      add_job "$logdir" "$(echo "$f" | tr '/' '_').$c" "$c $f" \
        "$CXX" -c -o /dev/null -O3 "${cxx[@]}" "${base[@]}" -ffp-contract=off $flags -DCPU_CAPABILITY="$c" \
        -DCPU_CAPABILITY_"$c" "$f"
    done
  done
  note="CPU build's headers: the .cu files and MIXPREC_WITH_CUDA=1 are built only against a CUDA torch (.ci/cuda_compile_check.sh: the venv's release)"
  if [ $cuda_build = 1 ]; then
    archs_csv=${archs//;/,}
    for f in $cuda_sources; do
      add_job "$logdir" "$(echo "$f" | tr '/' '_').cuda1" "cuda=1 $f" \
        "$CXX" -fsyntax-only -fopenmp "${cxx[@]}" "${ext[@]}" -DMIXPREC_WITH_CUDA=1 -DMIXPREC_CUDA_ARCHS="\"$archs_csv\"" "$f"
    done
    IFS=';' read -r -a arch_list <<<"$archs"
    lo=${arch_list[0]%%-*}; hi=${arch_list[${#arch_list[@]}-1]%%-*}
    if [ "$lo" = "$hi" ]; then mapfile -t gencode < <(gencode_flags "$lo-virtual")
    else mapfile -t gencode < <(gencode_flags "$lo-virtual" "$hi-virtual"); fi
    for f in $cu_sources; do
      add_job "$logdir" "$(echo "$f" | tr '/' '_').nvcc" "nvcc compute_$lo,compute_$hi $f" \
        "$NVCC" -c -o /dev/null "${gencode[@]}" -std="$CXX_STD" --expt-relaxed-constexpr \
        --expt-extended-lambda -O3 -Xcompiler=-fPIC "${ext[@]}" -DMIXPREC_WITH_CUDA=1 \
        -DMIXPREC_CUDA_ARCHS="\"$archs_csv\"" "$f"
    done
    note="CUDA build's headers: MIXPREC_WITH_CUDA=1 and $(echo $cu_sources | wc -w) .cu (nvcc) too"
  fi
  echo "== torch $ver headers ($inc); $note; torch's defines: $(echo $defines)"
  t0=$(date +%s)
  if run_jobs "$logdir" "$JOBS"; then
    checked+=("$ver ($(ls "$logdir"/*.cmd | wc -l) compiles, $(( $(date +%s) - t0 ))s)")
  else
    echo "FAIL: torch $ver"; failed+=("$ver"); fail=1
  fi
done
secs=$(( $(date +%s) - start ))
[ ${#logdirs[@]} -gt 0 ] && echo "logs and commands: ${logdirs[*]}"
if [ "$fail" -eq 0 ]; then
  echo "PASS: csrc compiles against torch ${checked[*]:-nothing}; total ${secs}s"
else
  echo "FAIL: torch headers check: ${failed[*]} (${secs}s)"
fi
exit "$fail"
