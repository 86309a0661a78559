// Hand-written loops for one decode step (one new token per sequence): the small element-wise
// and attention work between the matmuls, where an ATen call costs more in dispatch than the
// arithmetic itself. Every loop computes in fp32; for bf16 activations the results are rounded
// at the same points as the eager PyTorch code in tokenmill/models/layers.py, so both agree.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "thread_pool.h"

namespace tokenmill {

inline float to_f(float x) { return x; }
// bf16 -> fp32: the 16 bits become the top half of the float (exact).
inline float to_f(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_f(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_f(float x) { return static_cast<T>(x); }

// fp32 -> bf16 rounded to nearest even, NaN to 0x7FC0: the bits of c10::BFloat16(x), without
// its branch, so that the loops around it vectorize (the glue of a batch-32 step ran scalar).
template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(x != x ? 0x7FC0u : rounded),
                       c10::BFloat16::from_bits());
}

// Round to T's precision and back: where eager PyTorch stores an intermediate in T.
template <typename T>
inline float round_to(float x) { return to_f(from_f<T>(x)); }

template <>
inline float round_to<float>(float x) { return x; }

// exp(x), Cephes' range reduction and polynomial (~2 ulp). Branch-free so that gcc vectorizes
// the loops it sits in; std::exp stays scalar without -ffast-math, and softmax and SiLU call it
// once per element.
inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// exp_poly lane by lane, on any width of float vector V (I: its int32 twin): the same bits.
template <typename V, typename I>
inline V exp_lanes(V x) {
  const V lo = V{} - 87.0f, hi = V{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const V y = x * 1.44269504088896341f + 0.5f;
  V n = __builtin_convertvector(__builtin_convertvector(y, I), V);
  n = n > y ? n - 1.0f : n;  // truncation -> floor
  V r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  return p * reinterpret_cast<const V&>(bits);
}

// The glue's explicit vectors (GCC vector extensions): one AVX-512 register, or an AVX2 one.
// GCC's own vectorization of the SiLU loop below (exp_poly, then a division) ran at ~5.5 ns an
// element on a Xeon, 18x these lanes, which compute the same bits.
namespace lanes {
#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;
typedef float F __attribute__((vector_size(64)));
typedef int32_t I __attribute__((vector_size(64)));
typedef uint32_t U __attribute__((vector_size(64)));
typedef uint16_t H __attribute__((vector_size(32)));
#else
constexpr int64_t kWidth = 8;
typedef float F __attribute__((vector_size(32)));
typedef int32_t I __attribute__((vector_size(32)));
typedef uint32_t U __attribute__((vector_size(32)));
typedef uint16_t H __attribute__((vector_size(16)));
#endif

inline F load(const float* p) {
  F v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// bf16 -> fp32 (exact), as to_f.
inline F load(const c10::BFloat16* p) {
  H h;
  std::memcpy(&h, p, sizeof(h));
  const U w = __builtin_convertvector(h, U) << 16;
  return reinterpret_cast<const F&>(w);
}

// fp32 -> bf16 bits, as from_f<c10::BFloat16>: nearest even, NaN to 0x7FC0.
inline U bf16_bits(F v) {
  const U u = reinterpret_cast<const U&>(v);
  const U rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const U nan = U{} + 0x7FC0u;
  const I is_nan = v != v;
  return is_nan ? nan : rounded;
}

inline void store(float* p, F v) { std::memcpy(p, &v, sizeof(v)); }

inline void store(c10::BFloat16* p, F v) {
  const H h = __builtin_convertvector(bf16_bits(v), H);
  std::memcpy(p, &h, sizeof(h));
}

// round_to<T> lane by lane.
template <typename T>
inline F round(F v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>, "fp32 or bf16 activations");
    const U w = bf16_bits(v) << 16;
    return reinterpret_cast<const F&>(w);
  }
}
}  // namespace lanes

// Rows [0, rows) in parallel chunks of at least `min_elems` elements' worth of rows: the glue
// of a batch-32 step is worth two threads, that of a single sequence is not.
template <typename F>
void for_rows(int64_t rows, int64_t row_elems, F&& f, int64_t min_elems = 16384) {
  // A range within one grain runs inline, on the calling thread (tmpool::parallel_for).
  tmpool::parallel_for(0, rows, std::max<int64_t>(1, min_elems / std::max<int64_t>(1, row_elems)),
                       f);
}

// RMSNorm of `rows` rows of `n` (T: the activation dtype, whose rounding the math follows; O: the
// output's storage, bf16 when it feeds a quantized matmul); x and y may alias when O is T. As
// RMSNorm.forward: fp32 statistics, and for bf16 the normalized value is rounded before the
// weight multiply (Hugging Face's order).
// I: the input's storage (a projection's bf16 output under a sandwich norm), widened exactly.
template <typename T, typename O = T, typename I = T>
void rms_norm_rows(const I* x, const T* w, O* y, int64_t rows, int64_t n, float eps) {
  for_rows(rows, n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const I* xr = x + r * n;
      O* yr = y + r * n;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) {
        const float v = to_f(xr[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        yr[i] = from_f<O>(round_to<T>(to_f(xr[i]) * inv) * to_f(w[i]));
      }
    }
  });
}

// Rotate-half rope of one head in place, from the model's fp32 half-width tables. Eager code
// widens the tables to T first and computes addcmul(x * cos, swap(x), ±sin): same roundings.
template <typename T>
void rope_head(T* x, const float* cos_half, const float* sin_half, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float c = round_to<T>(cos_half[i]);
    const float s = round_to<T>(sin_half[i]);
    const float a = to_f(x[i]);
    const float b = to_f(x[i + half]);
    x[i] = from_f<T>(round_to<T>(a * c) - b * s);
    x[i + half] = from_f<T>(round_to<T>(b * c) + a * s);
  }
}

// y[i] += x[i] over rows of n elements (the residual adds); x is a matmul's output, exact in T.
template <typename T, typename I>
void add_rows(T* y, const I* x, int64_t rows, int64_t n) {
  for_rows(rows, n, [&](int64_t begin, int64_t end) {
    T* yb = y + begin * n;
    const I* xb = x + begin * n;
    const int64_t m = (end - begin) * n;
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) yb[i] = from_f<T>(to_f(yb[i]) + to_f(xb[i]));
  });
}

// out[r] = silu(gate_up[r, :n]) * gate_up[r, n:], rows of the fused gate/up projection: read
// from I (the matmul's output), rounded as T computes, stored as O.
template <typename T, typename I, typename O>
void silu_mul_rows(const I* gate_up, O* out, int64_t rows, int64_t n) {
  for_rows(rows, 3 * n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const I* g = gate_up + r * 2 * n;
      const I* u = g + n;
      O* o = out + r * n;
      int64_t i = 0;
      for (; i + lanes::kWidth <= n; i += lanes::kWidth) {
        const lanes::F x = lanes::load(g + i);
        const lanes::F silu = x / (1.f + exp_lanes<lanes::F, lanes::I>(-x));
        lanes::store(o + i, lanes::round<T>(silu) * lanes::load(u + i));
      }
      for (; i < n; ++i) {  // the same bits, one at a time
        const float x = to_f(g[i]);
        o[i] = from_f<O>(round_to<T>(x / (1.f + exp_poly(-x))) * to_f(u[i]));
      }
    }
  });
}

// out[r] = gelu_tanh(gate_up[r, :n]) * gate_up[r, n:] (GELU's tanh form, PyTorch's
// approximate="tanh"), as silu_mul_rows: tanh(u) = 1 - 2 / (1 + exp(2u)) on exp_poly's lanes.
template <typename T, typename I, typename O>
void gelu_tanh_mul_rows(const I* gate_up, O* out, int64_t rows, int64_t n) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  for_rows(rows, 3 * n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const I* g = gate_up + r * 2 * n;
      const I* u = g + n;
      O* o = out + r * n;
      int64_t i = 0;
      for (; i + lanes::kWidth <= n; i += lanes::kWidth) {
        const lanes::F x = lanes::load(g + i);
        const lanes::F inner = kBeta * (x + kKappa * x * x * x);
        const lanes::F e = exp_lanes<lanes::F, lanes::I>(2.f * inner);
        const lanes::F gelu = 0.5f * x * (2.f - 2.f / (1.f + e));
        lanes::store(o + i, lanes::round<T>(gelu) * lanes::load(u + i));
      }
      for (; i < n; ++i) {  // the same bits, one at a time
        const float x = to_f(g[i]);
        const float e = exp_poly(2.f * (kBeta * (x + kKappa * x * x * x)));
        o[i] = from_f<O>(round_to<T>(0.5f * x * (2.f - 2.f / (1.f + e))) * to_f(u[i]));
      }
    }
  });
}

// y[i] = y[i] * s over rows of n elements, rounded as T (an embedding scale).
template <typename T>
void scale_rows(T* y, float s, int64_t rows, int64_t n) {
  const float st = round_to<T>(s);
  for_rows(rows, n, [&](int64_t begin, int64_t end) {
    T* yb = y + begin * n;
    const int64_t m = (end - begin) * n;
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) yb[i] = from_f<T>(to_f(yb[i]) * st);
  });
}

}  // namespace tokenmill
