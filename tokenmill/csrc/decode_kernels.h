// Hand-written loops for one decode step (one new token per sequence): the small element-wise
// and attention work between the matmuls, where an ATen call costs more in dispatch than the
// arithmetic itself. Every loop computes in fp32; for bf16 activations the results are rounded
// at the same points as the eager PyTorch code in tokenmill/models/layers.py, so both agree.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tokenmill {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline T from_f(float x) { return static_cast<T>(x); }

// Round to T's precision and back: where eager PyTorch stores an intermediate in T.
template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

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

// RMSNorm of `rows` rows of `n`; x and y may alias. As RMSNorm.forward: fp32 statistics, and for
// bf16 the normalized value is rounded before the weight multiply (Hugging Face's order).
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) {
      const float v = to_f(xr[i]);
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      yr[i] = from_f<T>(round_to<T>(to_f(xr[i]) * inv) * to_f(w[i]));
    }
  }
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

// y[i] += x[i] over n elements (the residual adds).
template <typename T>
void add_inplace(T* y, const T* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = from_f<T>(to_f(y[i]) + to_f(x[i]));
}

// out[r] = silu(gate_up[r, :n]) * gate_up[r, n:], rows of the fused gate/up projection.
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * n;
    const T* u = g + n;
    T* o = out + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float x = to_f(g[i]);
      o[i] = from_f<T>(round_to<T>(x / (1.f + exp_poly(-x))) * to_f(u[i]));
    }
  }
}

// Where one decode step's attention reads: the paged cache and each sequence's block table.
template <typename T>
struct PagedView {
  const T* k;  // [num_slots, Hkv, D]
  const T* v;
  const int32_t* seq_lens;  // [B]
  const int32_t* tables;  // [B, table_stride]
  int64_t table_stride;
  int64_t block_size;
};

// Attention of the G query heads sharing KV head g of sequence b over its seq_lens[b] cached
// tokens: softmax(scale * q k^T) v in fp32, each key and value row read once for all G heads.
template <typename T>
void attend_group(const T* q, int64_t q_stride, const PagedView<T>& kv, int64_t b, int64_t g,
                  int64_t G, int64_t Hkv, int64_t D, float scale, T* out, int64_t out_stride,
                  std::vector<float>& scores) {
  const int64_t L = kv.seq_lens[b];
  const int32_t* table = kv.tables + b * kv.table_stride;
  const T* qh = q + b * q_stride + g * G * D;
  scores.resize(static_cast<size_t>(G * L));
  std::vector<float> qf(G * D);
  for (int64_t i = 0; i < G * D; ++i) qf[i] = to_f(qh[i]);
  for (int64_t t = 0; t < L; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / kv.block_size]) * kv.block_size +
                         t % kv.block_size;
    const T* krow = kv.k + (slot * Hkv + g) * D;
    for (int64_t j = 0; j < G; ++j) {
      const float* qj = qf.data() + j * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qj[d] * to_f(krow[d]);
      scores[j * L + t] = dot * scale;
    }
  }
  std::vector<float> acc(G * D, 0.f);
  std::vector<float> total(G, 0.f);
  for (int64_t j = 0; j < G; ++j) {
    float* sj = scores.data() + j * L;
    const float mx = *std::max_element(sj, sj + L);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) {
      sj[t] = exp_poly(sj[t] - mx);
      sum += sj[t];
    }
    total[j] = sum;
  }
  for (int64_t t = 0; t < L; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / kv.block_size]) * kv.block_size +
                         t % kv.block_size;
    const T* vrow = kv.v + (slot * Hkv + g) * D;
    for (int64_t j = 0; j < G; ++j) {
      const float p = scores[j * L + t];
      float* aj = acc.data() + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) aj[d] += p * to_f(vrow[d]);
    }
  }
  for (int64_t j = 0; j < G; ++j) {
    T* o = out + b * out_stride + (g * G + j) * D;
    const float inv = 1.f / total[j];
    for (int64_t d = 0; d < D; ++d) o[d] = from_f<T>(acc[j * D + d] * inv);
  }
}

// Decode attention of every (sequence, KV head) pair; threads only when the contexts are long
// enough to pay for waking them (batch 32 at a few thousand tokens, not batch 1 at a hundred).
template <typename T>
void paged_decode_attention(const T* q, int64_t q_stride, const PagedView<T>& kv, int64_t B,
                            int64_t Hq, int64_t Hkv, int64_t D, float scale, T* out,
                            int64_t max_len) {
  const int64_t G = Hq / Hkv;
  const int64_t work_per_item = std::max<int64_t>(1, 2 * G * max_len * D);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / work_per_item);
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      attend_group(q, q_stride, kv, i / Hkv, i % Hkv, G, Hkv, D, scale, out, Hq * D, scores);
    }
  });
}

}  // namespace tokenmill
