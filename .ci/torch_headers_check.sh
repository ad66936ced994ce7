#!/usr/bin/env bash
# Compile-only check of every csrc/**/*.cpp against the headers of several torch
# releases, without installing them (no GPU, no torch import needed).
#
# Usage: bash .ci/torch_headers_check.sh [VERSION|INCLUDE_DIR ...]
#        bash .ci/torch_headers_check.sh --fetch VERSION   (only fetch; prints the include dir)
#   VERSION      a torch release on PyPI, e.g. 2.11.0: its linux wheel (a CUDA build,
#                ~0.5 GB) is downloaded once, only torch/include and torch/version.py
#                are kept, in $MIXPREC_TORCH_HEADERS_CACHE
#                (default ~/.cache/mixprec/torch-headers/<version>), the wheel is deleted.
#   INCLUDE_DIR  an existing torch include dir (.../torch/include).
#   Default: 2.11.0 2.12.0 (oldest supported, downloaded) and the torch of $PYTHON
#   (the venv's 2.13, the version CI builds and tests).
#
# What is checked, per header set: g++ -fsyntax-only with the defines, include dirs and
# flags of CMakeLists.txt (_GLIBCXX_USE_CXX11_ABI, TORCH_EXTENSION_NAME=_C,
# TORCH_API_INCLUDE_EXTENSION_H, -fopenmp; pybind11 from torch's include dir) for every
# .cpp with MIXPREC_WITH_CUDA=0, and again with MIXPREC_WITH_CUDA=1 (+ the CUDA toolkit's
# include dir) for the .cpp files that test MIXPREC_WITH_CUDA, when the header set is a
# CUDA build's (it has c10/cuda/impl/cuda_cmake_macros.h; the CPU wheel lacks it) and a
# CUDA toolkit is found. The .cu files are checked by .ci/cuda_compile_check.sh.
# A release that cannot be downloaded (no network) is reported "skipped" and does not fail
# the check; a compile error does. Files run $JOBS at a time (default 2).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
JOBS=${JOBS:-2}
CACHE=${MIXPREC_TORCH_HEADERS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mixprec/torch-headers}
CXX=${CXX:-g++}
CXX_STD=${CXX_STD:-c++17}  # CMakeLists.txt's CMAKE_CXX_STANDARD; torch >= 2.14 needs c++20
PYTHON_INCLUDE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])" 2>/dev/null)
[ -n "$PYTHON_INCLUDE" ] && [ -f "$PYTHON_INCLUDE/Python.h" ] || {
  echo "FAIL: Python.h not found (python3's include dir: '${PYTHON_INCLUDE}'); install the Python dev headers"
  exit 1; }
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/bin/nvcc)}
CUDA_INCLUDE=${CUDA_INCLUDE:-}
if [ -z "$CUDA_INCLUDE" ]; then
  for d in /usr/local/cuda/include "$(dirname "$(readlink -f "$NVCC")")/../include"; do
    if [ -f "$d/cuda_runtime.h" ]; then CUDA_INCLUDE=$(cd "$d" && pwd); break; fi
  done
fi

# Prints the include dir of torch VERSION, downloading it into the cache if needed.
# Returns 2 (and says why on stderr) when it cannot be had.
fetch_headers() {
  local v=$1 dest="$CACHE/$1"
  if [ -f "$dest/torch/include/torch/headeronly/version.h" ]; then echo "$dest/torch/include"; return 0; fi
  local tmp
  tmp=$(mktemp -d "${CACHE}/.dl-$v.XXXXXX") || return 2
  echo "fetching torch==$v wheel headers into $dest ..." >&2
  # `===`: exactly this release, never a local "+cpu" build a find-links dir may hold
  # (pip ranks 2.13.0+cpu above 2.13.0 for ==2.13.0); PyPI's linux wheel is the CUDA build.
  if ! "$PY" -m pip download -q --no-deps "torch===$v" -d "$tmp" --python-version 3.11 \
      --platform manylinux_2_28_x86_64 --only-binary=:all: >"$tmp/pip.log" 2>&1; then
    local why="pip could not download its wheel"
    "$PY" -c "import urllib.request as u; u.urlopen('https://pypi.org/simple/torch/', timeout=10)" \
      >/dev/null 2>&1 || why="the network is unreachable (https://pypi.org cannot be reached)"
    echo "skipped torch $v: $why; last lines of pip's output:" >&2
    grep -v '^WARNING' "$tmp/pip.log" | tail -n 2 | sed 's/^/    /' >&2
    rm -rf "$tmp"; return 2
  fi
  local whl
  whl=$(ls "$tmp"/torch-*.whl 2>/dev/null | head -n 1)
  if [ -z "$whl" ] || ! unzip -q -o "$whl" 'torch/include/*' 'torch/version.py' -d "$tmp/x"; then
    echo "skipped torch $v: could not unpack the headers of '$whl'" >&2
    rm -rf "$tmp"; return 2
  fi
  rm -rf "$dest" && mv "$tmp/x" "$dest" && rm -rf "$tmp"
  echo "$dest/torch/include"
}

# One compile: FILE INCLUDE_DIR CUDA(0|1) LOGDIR
compile_one() {
  local f=$1 inc=$2 cuda=$3 logdir=$4
  local log="$logdir/$(echo "$f" | tr '/' '_').cuda$cuda.log"
  local extra=()
  [ "$cuda" = 1 ] && extra=(-isystem "$CUDA_INCLUDE")
  if "$CXX" -fsyntax-only -std="$CXX_STD" -fPIC -fopenmp -Wall -Wno-unused-parameter \
      -Icsrc -isystem "$inc" -isystem "$inc/torch/csrc/api/include" -isystem "$PYTHON_INCLUDE" \
      "${extra[@]}" -D_GLIBCXX_USE_CXX11_ABI="$ABI" -DTORCH_EXTENSION_NAME=_C \
      -DTORCH_API_INCLUDE_EXTENSION_H -DMIXPREC_TORCH_VERSION="\"check\"" \
      -DMIXPREC_WITH_CUDA="$cuda" "$f" >"$log" 2>&1; then
    echo "ok    cuda=$cuda $f"; rm -f "$log"
  else
    echo "ERROR cuda=$cuda $f"; sed 's/^/    /' "$log" | grep -E 'error|required from|note: candidate' | head -n 20
    return 1
  fi
}
export -f compile_one
export CXX CXX_STD PYTHON_INCLUDE CUDA_INCLUDE

if [ "${1:-}" = "--fetch" ]; then
  [ $# -eq 2 ] || { echo "usage: $0 --fetch VERSION (e.g. 2.11.0)"; exit 1; }
  mkdir -p "$CACHE" && fetch_headers "$2"
  exit $?
fi

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(2.11.0 2.12.0)
  venv_inc=$("$PY" -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))" 2>/dev/null) \
    && targets+=("$venv_inc") || echo "note: cannot import torch with $PY; its headers are not checked"
fi
mkdir -p "$CACHE"
sources=$(find csrc -name '*.cpp' | sort)
cuda_sources=$(grep -l 'MIXPREC_WITH_CUDA' $sources)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
start=$(date +%s)
fail=0; checked=(); skipped=()
for t in "${targets[@]}"; do
  if [ -d "$t" ]; then inc=$t
  else inc=$(fetch_headers "$t") || { skipped+=("$t"); continue; }
  fi
  vh="$inc/torch/headeronly/version.h"
  [ -f "$vh" ] || { echo "FAIL: $inc has no torch/headeronly/version.h: not the include dir of a torch >= 2.11"; fail=1; continue; }
  ver=$(for k in MAJOR MINOR PATCH; do sed -n "s/^#define TORCH_VERSION_$k \([0-9]*\).*/\1/p" "$vh"; done | paste -sd.)
  # Every wheel torch >= 2.7 publishes for linux uses the new libstdc++ ABI; an installed
  # torch says so itself.
  ABI=1
  if [ "$t" = "${venv_inc:-}" ]; then ABI=$("$PY" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"); fi
  export ABI
  jobs_file="$OUT/jobs.txt"; : >"$jobs_file"
  for f in $sources; do echo "$f $inc 0" >>"$jobs_file"; done
  cuda_note="MIXPREC_WITH_CUDA=1 not checked: "
  if [ ! -f "$inc/c10/cuda/impl/cuda_cmake_macros.h" ]; then
    cuda_note+="a CPU build's headers (no c10/cuda/impl/cuda_cmake_macros.h)"
  elif [ -z "$CUDA_INCLUDE" ]; then
    cuda_note+="no CUDA toolkit include dir found (set CUDA_INCLUDE)"
  else
    cuda_note="MIXPREC_WITH_CUDA=1 checked too (CUDA headers: $CUDA_INCLUDE)"
    for f in $cuda_sources; do echo "$f $inc 1" >>"$jobs_file"; done
  fi
  echo "== torch $ver headers ($inc); $cuda_note"
  t0=$(date +%s)
  if xargs -P "$JOBS" -L 1 bash -c 'compile_one "$0" "$1" "$2" '"$OUT" <"$jobs_file"; then
    checked+=("$ver ($(( $(date +%s) - t0 ))s)")
  else
    echo "FAIL: torch $ver"; fail=1
  fi
done
secs=$(( $(date +%s) - start ))
[ ${#skipped[@]} -gt 0 ] && echo "skipped (could not fetch): ${skipped[*]}"
if [ "$fail" -eq 0 ]; then
  echo "PASS: every csrc .cpp compiles against torch ${checked[*]:-nothing} (${secs}s)"
else
  echo "FAIL: torch headers check (${secs}s)"
fi
exit "$fail"
