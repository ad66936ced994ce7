// Per-element helpers of the CPU kernels, compiled once per capability (see
// [Note: CPU capabilities] in ../items.h). Include this first in simd/ TUs.
//
// [Note: vectorisation and FMA]
// The per-element code of every op is written once, on at::vec::Vectorized
// <float> (all maths in fp32; bf16/fp16 inputs are upcast on load and rounded
// to nearest-even on store). Where torch's own CPU kernels round once through
// a fused multiply-add (add with alpha, lerp, addcmul: at::vec::fmadd and
// GCC-contracted scalar code) we call fma_exact: one vfmadd in the AVX2 and
// AVX512 copies, std::fma per lane in the DEFAULT copy. Implicit contraction
// is off in every TU including this header (the pragma below, and
// -ffp-contract=off on the per-capability objects), so each op rounds exactly
// where the op sequence of torch.optim rounds, whatever the ISA.
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off", "no-math-errno")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif

// The DEFAULT copy is compiled as part of _C, without -DCPU_CAPABILITY.
#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "kernels/cpu/items.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace mixprec::kernels::cpu::CPU_CAPABILITY {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kW = fVec::size();

struct NoLowp {};

// kW lanes from p upcast to fp32.
template <class T>
C10_ALWAYS_INLINE fVec load_full(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return fVec::loadu(p);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    __m512 o;
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<T, c10::BFloat16>) at::vec::cvtbf16_fp32(x, o);
    else at::vec::cvtfp16_fp32(x, o);
    return o;
#elif defined(CPU_CAPABILITY_AVX2)
    __m256 o;
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<T, c10::BFloat16>) at::vec::cvtbf16_fp32(x, o);
    else at::vec::cvtfp16_fp32(x, o);
    return o;
#else
    alignas(64) float buf[kW];
    for (int64_t i = 0; i < kW; ++i) buf[i] = static_cast<float>(p[i]);
    return fVec::loadu(buf);
#endif
  }
}

// kW lanes of v to p, rounded to nearest-even for bf16/fp16 (as Tensor.to).
template <class T>
C10_ALWAYS_INLINE void store_full(T* p, const fVec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i x = std::is_same_v<T, c10::BFloat16> ? at::vec::cvtfp32_bf16(__m512(v))
                                                       : at::vec::cvtfp32_fp16(__m512(v));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i x = std::is_same_v<T, c10::BFloat16> ? at::vec::cvtfp32_bf16(__m256(v))
                                                       : at::vec::cvtfp32_fp16(__m256(v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x);
#else
    alignas(64) float buf[kW];
    v.store(buf);
    for (int64_t i = 0; i < kW; ++i) p[i] = static_cast<T>(buf[i]);
#endif
  }
}

// n lanes from p upcast to fp32 (remaining lanes 0); n == kW on the fast path.
template <class T>
C10_ALWAYS_INLINE fVec load_f(const T* p, int64_t n) {
  if (n == kW) return load_full(p);
  alignas(64) float buf[kW] = {};
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
  return fVec::loadu(buf);
}

// First n lanes of v to p (the tail of a chunk: scalar rounding, same results).
template <class T>
C10_ALWAYS_INLINE void store_f(T* p, const fVec& v, int64_t n) {
  if (n == kW) {
    store_full(p, v);
    return;
  }
  alignas(64) float buf[kW];
  v.store(buf);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(buf[i]);
}

// a * b + c rounded once, lane-wise (see [Note: vectorisation and FMA]).
C10_ALWAYS_INLINE fVec fma_exact(const fVec& a, const fVec& b, const fVec& c) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_fmadd_ps(a, b, c);
#else
  alignas(64) float x[kW], y[kW], z[kW];
  a.store(x);
  b.store(y);
  c.store(z);
  for (int64_t i = 0; i < kW; ++i) x[i] = std::fma(x[i], y[i], z[i]);
  return fVec::loadu(x);
#endif
}

// The arithmetic policy of kernels/functors.h for this capability ([Note: shared functors]).
struct VecArith {
  using V = fVec;
  static C10_ALWAYS_INLINE V splat(float x) { return fVec(x); }
  static C10_ALWAYS_INLINE V mul(const V& a, const V& b) { return a * b; }
  static C10_ALWAYS_INLINE V add(const V& a, const V& b) { return a + b; }
  static C10_ALWAYS_INLINE V sub(const V& a, const V& b) { return a - b; }
  static C10_ALWAYS_INLINE V div(const V& a, const V& b) { return a / b; }
  static C10_ALWAYS_INLINE V fma(const V& a, const V& b, const V& c) { return fma_exact(a, b, c); }
  static C10_ALWAYS_INLINE V neg(const V& a) { return a.neg(); }
  static C10_ALWAYS_INLINE V sqrt(const V& a) { return a.sqrt(); }
};

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
    default: break; /* dtypes are checked in ops.cpp */                       \
  }

// d[i] = s[i] * scale in fp32, one rounding (as at::mul with a float scalar), in place
// when d == s; true when a source value was inf/nan (checked before scaling, as torch's
// _amp_foreach_non_finite_check_and_unscale_). The unscale and the Reducer's copy-in.
template <class T>
bool scale_copy_range(T* d, const T* s, int64_t n, const fVec& scale) {
  fVec acc0(0.f), acc1(0.f);
  int64_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    const fVec x0 = load_full(s + i), x1 = load_full(s + i + kW);
    acc0 = nonfinite_acc(acc0, x0);
    acc1 = nonfinite_acc(acc1, x1);
    store_full(d + i, x0 * scale);
    store_full(d + i + kW, x1 * scale);
  }
  for (; i < n; i += kW) {
    const int64_t w = std::min(kW, n - i);
    const fVec x = load_f(s + i, w);
    acc0 = nonfinite_acc(acc0, x);
    store_f(d + i, x * scale, w);
  }
  return any_nonfinite(acc0 + acc1);
}

}  // namespace mixprec::kernels::cpu::CPU_CAPABILITY
