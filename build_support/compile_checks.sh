# Shared by .ci/torch_headers_check.sh and .ci/cuda_compile_check.sh (sourced, bash): what
# CMakeLists.txt gives each compile, read from CMakeLists.txt and from torch's own CMake
# config, so the compile-only checks use the build's flags rather than a copy of them.
#
#   torch_defines TORCH_ROOT   -D flags a real build gets from torch's targets (linking
#                              `torch` brings torch_cpu's and, in a CUDA build, torch_cuda's
#                              INTERFACE_COMPILE_DEFINITIONS: USE_DISTRIBUTED, USE_C10D_GLOO,
#                              USE_C10D_NCCL, ...), from TORCH_ROOT/share/cmake/Caffe2/Caffe2Targets.cmake
#   cpu_caps                   the x86 capabilities CMakeLists.txt compiles csrc/kernels/cpu/simd/ for
#   cpu_cap_flags CAP          CMakeLists.txt's -m flags for CAP (MIXPREC_CPU_FLAGS_<CAP>)
#   cuda_archs                 the CUDA archs a build with this nvcc compiles (build_support/cuda_archs.cmake)
#   gencode_flags ENTRY...     nvcc -gencode flags for CUDA_ARCHITECTURES entries (75-real, 120,
#                              120-virtual), one argument a line (mapfile -t)
#   add_job / run_jobs         one script per compile, run in parallel, logs kept (below)
# Each prints nothing and returns 1 (with the reason on stderr) when it cannot answer.

MIXPREC_ROOT=${MIXPREC_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}

torch_defines() {
  local targets="$1/share/cmake/Caffe2/Caffe2Targets.cmake"
  if [ ! -f "$targets" ]; then
    echo "no $targets: cannot read torch's compile definitions" >&2; return 1
  fi
  # Literal values only: the others are $<TARGET_PROPERTY:...> references to these.
  grep -h 'INTERFACE_COMPILE_DEFINITIONS "' "$targets" | grep -v '\$<' \
    | sed 's/.*INTERFACE_COMPILE_DEFINITIONS "\(.*\)".*/\1/' | tr ';' '\n' | sed '/^$/d' \
    | sort -u | sed 's/^/-D/'
}

cpu_caps() {
  local caps
  caps=$(sed -n 's/^ *set(MIXPREC_CPU_CAPS \([A-Z0-9 ]*\))$/\1/p' "$MIXPREC_ROOT/CMakeLists.txt")
  [ -n "$caps" ] || { echo "CMakeLists.txt has no 'set(MIXPREC_CPU_CAPS ...)' line to read" >&2; return 1; }
  echo "$caps"
}

cpu_cap_flags() {
  local flags
  flags=$(sed -n "s/^ *set(MIXPREC_CPU_FLAGS_$1 \\(.*\\))\$/\\1/p" "$MIXPREC_ROOT/CMakeLists.txt")
  [ -n "$flags" ] || { echo "CMakeLists.txt has no 'set(MIXPREC_CPU_FLAGS_$1 ...)' line to read" >&2; return 1; }
  echo "$flags"
}

cuda_archs() {
  command -v cmake >/dev/null || { echo "cmake not found (it builds mixprec)" >&2; return 1; }
  cmake -DNVCC="$NVCC" -DMIXPREC_CUDA_ARCHS="${MIXPREC_CUDA_ARCHS:-AUTO}" \
    -P "$MIXPREC_ROOT/build_support/cuda_archs.cmake"
}

gencode_flags() {
  local e n
  for e in "$@"; do
    n=${e%-real}; n=${n%-virtual}
    echo "-gencode"
    case "$e" in
      *-real) echo "arch=compute_$n,code=sm_$n" ;;
      *-virtual) echo "arch=compute_$n,code=compute_$n" ;;
      *) echo "arch=compute_$n,code=[sm_$n,compute_$n]" ;;
    esac
  done
}

# add_job DIR NAME LABEL CMD...: writes DIR/NAME.cmd, a script running CMD from the repo
# root (kept next to its log: the exact command of each check can be rerun by hand).
add_job() {
  local dir=$1 name=$2 label=$3; shift 3
  { echo "# $label"; printf 'cd %q &&' "$MIXPREC_ROOT"; printf ' %q' "$@"; echo; } >"$dir/$name.cmd"
}

# run_jobs DIR JOBS: runs DIR/*.cmd, JOBS at a time; each writes DIR/<name>.log (kept, pass
# or fail) and prints "ok    LABEL" or "ERROR LABEL" with the log's errors. Returns 1 if any failed.
run_jobs() {
  ls "$1"/*.cmd >/dev/null 2>&1 || { echo "no compile jobs in $1" >&2; return 1; }
  ls "$1"/*.cmd | xargs -P "$2" -n 1 bash -c '
    n=${0%.cmd}; label=$(head -n 1 "$0" | cut -c3-)
    if bash "$0" >"$n.log" 2>&1; then echo "ok    $label"; exit 0; fi
    echo "ERROR $label (log: $n.log)"
    grep -E "error|required from|note: candidate|inlining failed" "$n.log" | head -n 20 | sed "s/^/    /"
    exit 1'
}
