// CPU multi-tensor launcher: lists of tensors -> (tensor, chunk) work items ->
// one at::parallel_for over all items.
//
// [Note: chunking]
// Every tensor is cut into chunks of kChunkElems elements; the chunks of all
// tensors form one flat list of work items that a single parallel region
// splits between threads. A 4M-element embedding and 300 bias vectors thus
// balance across threads, and small tensors cost no parallel region each.
// 64K elements (256 KiB of fp32) keeps per-item overhead under 0.1% while
// giving enough items to balance a few large tensors over many cores.
//
// [Note: vectorisation and FMA]
// The per-element code of every op is written once, on at::vec::Vectorized
// <float> (all maths in fp32; bf16/fp16 inputs are upcast on load and rounded
// to nearest-even on store). The extension is built with baseline x86-64
// flags, so each op's item loop is compiled twice: a baseline clone and an
// avx2+fma clone picked at run time (MIXPREC_CPU_CLONES). Where torch's own
// CPU kernels round once through a fused multiply-add (add with alpha, lerp,
// addcmul: at::vec::fmadd and GCC-contracted scalar code) we call fma_exact,
// and every TU including this header turns implicit contraction off, so each
// op rounds exactly where the op sequence of torch.optim rounds.
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off", "no-math-errno")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <array>
#include <cmath>
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
template <int N>
struct Plan {
  std::vector<std::array<Slot, N>> slots;
  std::vector<WorkItem> items;
  int64_t total = 0;
};

// Items for tensors of the given sizes, in list order (empty tensors: none).
std::vector<WorkItem> make_items(const std::vector<int64_t>& numels, int64_t* total);

// lists[k][i] is tensor i of list k; a list may be empty (slot left null).
template <int N>
Plan<N> make_plan(const std::array<const std::vector<at::Tensor>*, N>& lists) {
  Plan<N> plan;
  const auto& first = *lists[0];
  plan.slots.resize(first.size());
  std::vector<int64_t> numels(first.size());
  for (size_t i = 0; i < first.size(); ++i) {
    numels[i] = first[i].numel();
    for (int k = 0; k < N; ++k) {
      if (!lists[k]->empty()) {
        const at::Tensor& t = (*lists[k])[i];
        plan.slots[i][k] = Slot{t.data_ptr(), t.scalar_type()};
      }
    }
  }
  plan.items = make_items(numels, &plan.total);
  return plan;
}

// Runs body(first_item, last_item) over all items in one parallel region. The
// grain keeps ~32K elements per task so tiny workloads stay on one thread.
template <class Body>
void parallel_items(const std::vector<WorkItem>& items, int64_t total, const Body& body) {
  if (items.empty()) return;
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t grain = std::max<int64_t>(1, (n * 32768) / std::max<int64_t>(total, 1));
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) { body(b, e); });
}

bool cpu_has_avx2_fma();

// Defines `ret name(args)` that calls the avx2+fma clone when the CPU has it.
// The body must only call C10_ALWAYS_INLINE code so it is compiled per clone.
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define MIXPREC_CPU_CLONES(name, params, args, ...)                       \
  static void name##_base params __VA_ARGS__                                \
  __attribute__((target("avx2,fma"))) static void name##_avx2 params __VA_ARGS__ \
  static void name params {                                                 \
    if (::mixprec::kernels::cpu::cpu_has_avx2_fma()) name##_avx2 args;       \
    else name##_base args;                                                  \
  }
#else
#define MIXPREC_CPU_CLONES(name, params, args, ...) static void name params __VA_ARGS__
#endif

// ---- fp32 vector helpers -----------------------------------------------------
using fVec = at::vec::Vectorized<float>;
constexpr int64_t kW = fVec::size();

// n lanes from p upcast to fp32 (remaining lanes 0); n == kW on the fast path.
template <class T>
C10_ALWAYS_INLINE fVec load_f(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return n == kW ? fVec::loadu(p) : fVec::loadu(p, n);
  } else {
    alignas(64) float buf[kW] = {};
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
    return fVec::loadu(buf);
  }
}

// First n lanes of v to p, rounded to nearest-even for bf16/fp16 (as Tensor.to).
template <class T>
C10_ALWAYS_INLINE void store_f(T* p, const fVec& v, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p, static_cast<int>(n));
  } else {
    alignas(64) float buf[kW];
    v.store(buf);
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(buf[i]);
  }
}

// a * b + c rounded once, lane-wise (see [Note: vectorisation and FMA]).
C10_ALWAYS_INLINE fVec fma_exact(const fVec& a, const fVec& b, const fVec& c) {
  alignas(64) float x[kW], y[kW], z[kW];
  a.store(x);
  b.store(y);
  c.store(z);
  for (int64_t i = 0; i < kW; ++i) x[i] = std::fma(x[i], y[i], z[i]);
  return fVec::loadu(x);
}

// NaN in a lane once any value added to it was inf or nan (x - x is 0 otherwise).
C10_ALWAYS_INLINE fVec nonfinite_acc(const fVec& acc, const fVec& x) { return acc + (x - x); }

C10_ALWAYS_INLINE bool any_nonfinite(const fVec& acc) {
  alignas(64) float x[kW];
  acc.store(x);
  bool bad = false;
  for (int64_t i = 0; i < kW; ++i) bad |= !std::isfinite(x[i]);
  return bad;
}

// switch over the float dtypes with `using T = <type>;` in scope of the body.
#define MIXPREC_FLOAT_SWITCH(dtype, T, ...)                                   \
  switch (dtype) {                                                            \
    case at::kFloat: { using T = float; __VA_ARGS__; break; }                 \
    case at::kBFloat16: { using T = c10::BFloat16; __VA_ARGS__; break; }      \
    case at::kHalf: { using T = c10::Half; __VA_ARGS__; break; }              \
    default: TORCH_INTERNAL_ASSERT(false, "unchecked dtype ", dtype);         \
  }

}  // namespace mixprec::kernels::cpu

