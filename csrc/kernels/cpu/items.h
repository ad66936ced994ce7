// What the CPU launcher hands to the per-capability kernels: the work items,
// the raw tensor slots, each op's fp32 scalars, and the item functions of
// every compiled capability. Light on purpose (no Tensor.h, no ATen vec): it
// is included by the baseline launcher and by the simd/ TUs alike.
//
// [Note: CPU capabilities]
// csrc/kernels/cpu/simd/*.cpp hold the per-element code of every op. CMake
// compiles them once per capability, the way ATen compiles its native/cpu
// kernels: DEFAULT with the extension's baseline flags (as part of _C), AVX2
// with -mavx2 -mfma -mf16c -DCPU_CAPABILITY=AVX2 -DCPU_CAPABILITY_AVX2, AVX512
// with -mavx512{f,bw,vl,dq} -mfma -DCPU_CAPABILITY=AVX512 -DCPU_CAPABILITY_AVX512
// (see the "per-capability CPU kernels" block of CMakeLists.txt). So in each
// copy at::vec::Vectorized<float> is the intrinsics implementation of that
// ISA, fmadd is one hardware FMA and bf16/fp16 go through ATen's vectorised
// converters. Every copy lives in namespace cpu::<CAPABILITY> (no symbol
// clashes); item_fns() picks one copy per process from cpuid
// (__builtin_cpu_supports, which also checks that the OS saves the wider
// registers), capped by the MIXPREC_CPU_CAPABILITY (or ATEN_CPU_CAPABILITY)
// environment variable: default, avx2 or avx512.
#pragma once

#include <c10/core/ScalarType.h>

#include "kernels/functors.h"

#include <array>
#include <cstdint>
#include <vector>

namespace mixprec::kernels::cpu {

constexpr int64_t kChunkElems = int64_t{1} << 16;

struct WorkItem {
  int64_t tensor;  // index into the lists
  int64_t begin;   // element range [begin, end) of that tensor
  int64_t end;
};

// One raw view per tensor: kernels index lists by position, not by at::Tensor.
struct Slot {
  void* ptr = nullptr;
  at::ScalarType dtype = at::kFloat;
};

// The tensors of N parallel lists (e.g. params, grads, exp_avgs, ...), and the
// chunks they are cut into. Lists after the first must match its numels.
// passes[k]: how often the op moves an element of list k through memory (1: read
// or written, 2: read and written back); the launcher weighs a call's work by it
// ([Note: inline below the parallel threshold] in launcher.h).
template <int N>
struct Plan {
  std::vector<std::array<Slot, N>> slots;
  std::vector<WorkItem> items;
  int64_t total = 0;
  std::array<int, N> passes{};
};

// AdamScalars / SgdScalars: kernels/functors.h (shared with the CUDA kernels).

// The item functions: each runs items [b, e) of a plan on the calling thread.
using AdamItemsFn = void (*)(const Plan<5>&, int64_t, int64_t, const AdamScalars&);
using SgdItemsFn = void (*)(const Plan<4>&, int64_t, int64_t, const SgdScalars&);
using UnscaleItemsFn = void (*)(const Plan<1>&, int64_t, int64_t, float, uint8_t*);
using SumsqItemsFn = void (*)(const Plan<1>&, int64_t, int64_t, float*);
using CopyItemsFn = void (*)(const Plan<2>&, int64_t, int64_t);  // slot 0 dst, slot 1 src
using ScaleCopyItemsFn = void (*)(const Plan<2>&, int64_t, int64_t, float, uint8_t*);

#define MIXPREC_DECLARE_CPU_ITEMS(CAP)                                              \
  namespace CAP {                                                                   \
  void adam_items(const Plan<5>& plan, int64_t b, int64_t e, const AdamScalars& s); \
  void sgd_items(const Plan<4>& plan, int64_t b, int64_t e, const SgdScalars& s);   \
  void unscale_items(const Plan<1>& plan, int64_t b, int64_t e, float inv_scale,    \
                     uint8_t* found);                                               \
  void sumsq_items(const Plan<1>& plan, int64_t b, int64_t e, float* partial);      \
  void copy_items(const Plan<2>& plan, int64_t b, int64_t e);                       \
  void scale_copy_items(const Plan<2>& plan, int64_t b, int64_t e, float scale,     \
                        uint8_t* found);                                            \
  }

MIXPREC_DECLARE_CPU_ITEMS(DEFAULT)
#if MIXPREC_CPU_AVX2
MIXPREC_DECLARE_CPU_ITEMS(AVX2)
#endif
#if MIXPREC_CPU_AVX512
MIXPREC_DECLARE_CPU_ITEMS(AVX512)
#endif

struct ItemFns {
  const char* capability;  // "DEFAULT", "AVX2" or "AVX512"
  AdamItemsFn adam;
  SgdItemsFn sgd;
  UnscaleItemsFn unscale;
  SumsqItemsFn sumsq;
  CopyItemsFn copy;
  ScaleCopyItemsFn scale_copy;
};

// The copy for this CPU (chosen on first call; see [Note: CPU capabilities]).
const ItemFns& item_fns();

}  // namespace mixprec::kernels::cpu
