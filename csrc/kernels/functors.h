// The per-element arithmetic of the optimizer kernels, written once for the CPU and the
// CUDA paths.
//
// [Note: shared functors]
// Each function below is one op sequence of [Note: Adam op order] (cpu/adam.cpp) or
// [Note: SGD op order] (cpu/sgd.cpp), templated on an arithmetic policy A that supplies
// the value type and its correctly rounded operations:
//   A::V                      the value: at::vec::Vectorized<float> on CPU (kW lanes),
//                             float on CUDA (one element per thread)
//   A::splat(float)           a scalar as a value
//   A::mul/add/sub/div(a, b)  one IEEE operation, rounded once
//   A::fma(a, b, c)           a * b + c rounded once (a hardware FMA)
//   A::neg(a), A::sqrt(a)     negation, correctly rounded square root
// The CPU policy is in cpu/simd/vec_io.h (contraction off, so nothing else fuses), the
// CUDA one in cuda/optim.cu (__fmul_rn, __fmaf_rn, ...: nvcc would otherwise contract a
// multiply and an add into an FMA on its own). Loads, stores and dtype conversions stay
// in the callers: they are what differs between the paths. So the arithmetic that the CPU
// tests compare bit for bit with torch.optim (tests/kernels/test_kernels_optim.py) is the
// arithmetic the GPU runs.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MIXPREC_FUNCTOR __device__ __forceinline__
#else
#define MIXPREC_FUNCTOR inline __attribute__((always_inline))
#endif

namespace mixprec::kernels {

// fp32 scalars of one Adam step, computed once per call from the hyper-parameters (see
// cpu/adam.cpp; on CUDA the bias terms may come from a device step counter instead).
struct AdamScalars {
  float inv_scale, decay, wd, w1, one_minus_w1, beta2, w2, bc2_sqrt, eps, neg_step_size;
  bool has_inv_scale, maximize, decoupled, has_wd, w1_small;
};

struct SgdScalars {
  float inv_scale, wd, momentum, one_minus_dampening, neg_lr;
  bool has_inv_scale, maximize, has_wd, has_momentum, nesterov, first_step;
};

namespace functors {

// g = grad * inv_scale; g = -g if maximize.
template <class A>
MIXPREC_FUNCTOR typename A::V scaled_grad(typename A::V g, bool has_inv_scale, float inv_scale,
                                          bool maximize) {
  if (has_inv_scale) g = A::mul(g, A::splat(inv_scale));
  if (maximize) g = A::neg(g);
  return g;
}

// One Adam / AdamW update of (p, m, v) from the raw gradient g ([Note: Adam op order]).
template <class A>
MIXPREC_FUNCTOR void adam(typename A::V& p, typename A::V g, typename A::V& m, typename A::V& v,
                          const AdamScalars& s) {
  using V = typename A::V;
  g = scaled_grad<A>(g, s.has_inv_scale, s.inv_scale, s.maximize);
  if (s.has_wd) {
    if (s.decoupled) {
      p = A::mul(p, A::splat(s.decay));
    } else {
      g = A::fma(p, A::splat(s.wd), g);
    }
  }
  const V diff = A::sub(g, m);
  m = s.w1_small ? A::fma(A::splat(s.w1), diff, m)
                 : A::fma(A::neg(diff), A::splat(s.one_minus_w1), g);
  v = A::fma(A::mul(A::splat(s.w2), g), g, A::mul(v, A::splat(s.beta2)));
  const V denom = A::add(A::div(A::sqrt(v), A::splat(s.bc2_sqrt)), A::splat(s.eps));
  p = A::add(p, A::div(A::mul(A::splat(s.neg_step_size), m), denom));
}

// SGD ([Note: SGD op order]) in three parts, so that a caller loads the momentum buffer
// only when it is read (not on the first step) and stores it in between:
//   g = sgd_grad(g, p); buf = first_step ? g : sgd_momentum(g, buf); store buf;
//   p = sgd_param(p, sgd_direction(g, buf))
template <class A>
MIXPREC_FUNCTOR typename A::V sgd_grad(typename A::V g, typename A::V p, const SgdScalars& s) {
  g = scaled_grad<A>(g, s.has_inv_scale, s.inv_scale, s.maximize);
  return s.has_wd ? A::fma(p, A::splat(s.wd), g) : g;
}

template <class A>
MIXPREC_FUNCTOR typename A::V sgd_momentum(typename A::V g, typename A::V buf, const SgdScalars& s) {
  return A::fma(g, A::splat(s.one_minus_dampening), A::mul(buf, A::splat(s.momentum)));
}

template <class A>
MIXPREC_FUNCTOR typename A::V sgd_direction(typename A::V g, typename A::V buf, const SgdScalars& s) {
  if (!s.has_momentum) return g;
  return s.nesterov ? A::fma(buf, A::splat(s.momentum), g) : buf;
}

template <class A>
MIXPREC_FUNCTOR typename A::V sgd_param(typename A::V p, typename A::V d, const SgdScalars& s) {
  return A::fma(d, A::splat(s.neg_lr), p);
}

}  // namespace functors
}  // namespace mixprec::kernels
