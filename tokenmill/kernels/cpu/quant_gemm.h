// Weight-only int4 and int8 matmuls for the CPU: y[M, N] = x[M, K] W^T, W kept quantized.
//
// PyTorch's _weight_int4pack_mm_for_cpu decodes the weights again for every few rows of x, so
// on an AVX2 CPU a 32-row decode step costs ~14x a 1-row one. Here each tile of W is decoded
// once per call, to fp32 in a cache-resident buffer, and every row of x is multiplied against
// it there (a single row widens the weights in registers instead):
//   - int4: the column block of PyTorch's packed layout (BN = 32 or 64 outputs), one quant
//     group of K at a time (outer products, vectorized over the outputs), the group's scale and
//     zero applied once per group, not per weight;
//   - int8: a few output rows at a time, the whole of K (dot products, vectorized over K).
// Each output is one FMA chain in a fixed order over K, and the same code runs for every row
// count, so a row's result does not depend on how many rows share the call (the
// batch-invariance `--deterministic` relies on). fp32 throughout: x in bf16 is widened exactly.
#pragma once

#include <ATen/record_function.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKENMILL_QGEMM_AVX2 1
#endif

#include "decode_kernels.h"
#include "thread_pool.h"

namespace tokenmill {
namespace qgemm {

inline float bf16_bits_to_f(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// x as contiguous fp32 [M, K] (a copy when it is bf16 or strided).
inline at::Tensor fp32_rows(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
}

// ---- int4 ------------------------------------------------------------------------------
// PyTorch's CPU packing (_convert_weight_to_int4pack_for_cpu, when N % BN == 0): uint8
// [N / BN, K, BN / 2]; in block b at input k, byte j holds output b*BN + j in its low nibble
// and output b*BN + BN/2 + j in its high one. scales_and_zeros: bf16 [K / g, N, 2], and
// w = (q - 8) * scale + zero.
//
// Per quant group of g inputs, with z8 = zero - 8 * scale (one fma):
//   y += scale * (sum_k q x_k) + z8 * (sum_k x_k),  as  y = fma(scale, dot, fma(z8, xsum, y)),
// dot one fma chain over the group's inputs in k order, xsum the row's plain sum over them
// (once per call). The nibbles only need widening to float, not scaling, in the inner loop.

// Scales and z8 of one block for every group: s[g][bn], z8[g][bn].
inline void block_scales(const uint16_t* sz, int64_t groups, int64_t N, int64_t n0, int64_t bn,
                         float* s, float* z8) {
  for (int64_t g = 0; g < groups; ++g) {
    const uint16_t* pairs = sz + (g * N + n0) * 2;
    float* sg = s + g * bn;
    float* zg = z8 + g * bn;
    int64_t j = 0;
#ifdef TOKENMILL_QGEMM_AVX2
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m256 minus8 = _mm256_set1_ps(-8.f);
    for (; j + 8 <= bn; j += 8) {  // 8 (scale, zero) pairs: scale in the low half of each word
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 2 * j));
      const __m256 sv = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 zv = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      _mm256_storeu_ps(sg + j, sv);
      _mm256_storeu_ps(zg + j, _mm256_fmadd_ps(minus8, sv, zv));
    }
#endif
    for (; j < bn; ++j) {
      sg[j] = bf16_bits_to_f(pairs[2 * j]);
      zg[j] = std::fma(-8.f, sg[j], bf16_bits_to_f(pairs[2 * j + 1]));
    }
  }
}

// xsum[m][g]: each row's sum over each group, in k order.
inline void group_sums(const float* x, int64_t M, int64_t K, int64_t group_size, float* xsum) {
  const int64_t groups = K / group_size;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xr = x + m * K + g * group_size;
      float acc = 0.f;
      for (int64_t k = 0; k < group_size; ++k) acc += xr[k];
      xsum[m * groups + g] = acc;
    }
  }
}

// The nibbles of inputs [k0, k0 + kc) of one block as floats: dst[kc][bn].
inline void widen_int4_tile(const uint8_t* block, int64_t k0, int64_t kc, int64_t bn,
                            float* dst) {
  const int64_t half = bn / 2;
  for (int64_t kk = 0; kk < kc; ++kk) {
    const uint8_t* src = block + (k0 + kk) * half;
    float* out = dst + kk * bn;
    int64_t j = 0;
#ifdef TOKENMILL_QGEMM_AVX2
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (; j + 16 <= half; j += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
      const __m128i lo = _mm_and_si128(b, low4);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
      _mm256_storeu_ps(out + j, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
      _mm256_storeu_ps(out + j + 8,
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
      _mm256_storeu_ps(out + half + j, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
      _mm256_storeu_ps(out + half + j + 8,
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
    }
#endif
    for (; j < half; ++j) {
      out[j] = static_cast<float>(src[j] & 15);
      out[half + j] = static_cast<float>(src[j] >> 4);
    }
  }
}

// For one group of every row: dot = x[m][k0..k0+kc) . tile columns, then
// y[m][c] = fma(s[c], dot, fma(z8[c], xsum[m], y[m][c])). y and xsum are [M][bn] / [M]
// (xsum strided by xs_stride).
inline void tile_group(const float* x, int64_t ldx, int64_t M, int64_t k0, int64_t kc,
                       const float* tile, int64_t bn, const float* s, const float* z8,
                       const float* xsum, int64_t xs_stride, float* y) {
  int64_t m = 0;
#ifdef TOKENMILL_QGEMM_AVX2
  // 6 rows x 16 columns: 12 accumulators, 2 tile loads and 6 broadcasts per input.
  for (; m + 6 <= M; m += 6) {
    for (int64_t c = 0; c + 16 <= bn; c += 16) {
      __m256 a[6][2];
      for (auto& row : a) for (auto& v : row) v = _mm256_setzero_ps();
      for (int64_t kk = 0; kk < kc; ++kk) {
        const __m256 w0 = _mm256_loadu_ps(tile + kk * bn + c);
        const __m256 w1 = _mm256_loadu_ps(tile + kk * bn + c + 8);
        for (int r = 0; r < 6; ++r) {
          const __m256 xv = _mm256_broadcast_ss(x + (m + r) * ldx + k0 + kk);
          a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
          a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 sv = _mm256_loadu_ps(s + c + 8 * h);
        const __m256 zv = _mm256_loadu_ps(z8 + c + 8 * h);
        for (int r = 0; r < 6; ++r) {
          float* yp = y + (m + r) * bn + c + 8 * h;
          const __m256 xs = _mm256_broadcast_ss(xsum + (m + r) * xs_stride);
          _mm256_storeu_ps(yp, _mm256_fmadd_ps(sv, a[r][h],
                                               _mm256_fmadd_ps(zv, xs, _mm256_loadu_ps(yp))));
        }
      }
    }
  }
  // The remaining rows one at a time, 32 columns per pass: the same chain per output.
  for (; m < M; ++m) {
    const float* xrow = x + m * ldx + k0;
    const __m256 xs = _mm256_broadcast_ss(xsum + m * xs_stride);
    for (int64_t c = 0; c + 32 <= bn; c += 32) {
      __m256 a[4];
      for (auto& v : a) v = _mm256_setzero_ps();
      for (int64_t kk = 0; kk < kc; ++kk) {
        const __m256 xv = _mm256_broadcast_ss(xrow + kk);
        const float* w = tile + kk * bn + c;
        for (int i = 0; i < 4; ++i) a[i] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 8 * i), a[i]);
      }
      for (int i = 0; i < 4; ++i) {
        float* yp = y + m * bn + c + 8 * i;
        const __m256 sv = _mm256_loadu_ps(s + c + 8 * i);
        const __m256 zv = _mm256_loadu_ps(z8 + c + 8 * i);
        _mm256_storeu_ps(yp, _mm256_fmadd_ps(sv, a[i],
                                             _mm256_fmadd_ps(zv, xs, _mm256_loadu_ps(yp))));
      }
    }
  }
#else
  for (; m < M; ++m) {
    const float* xrow = x + m * ldx + k0;
    for (int64_t c = 0; c < bn; ++c) {
      float dot = 0.f;
      for (int64_t kk = 0; kk < kc; ++kk) dot = std::fma(xrow[kk], tile[kk * bn + c], dot);
      float& out = y[m * bn + c];
      out = std::fma(s[c], dot, std::fma(z8[c], xsum[m * xs_stride], out));
    }
  }
#endif
}

#ifdef TOKENMILL_QGEMM_AVX2
// R (1-3) rows: each input's 32 nibbles (bytes [16p, 16p + 16) of the block: outputs 16p.. and
// half + 16p..) widened in registers, no tile. The same chains as tile_group, so the same bits.
// y [R][bn] starts at zero.
template <int R>
inline void int4_rows_direct(const float* x, int64_t ldx, const uint8_t* block, int64_t K,
                             int64_t group_size, int64_t bn, const float* s, const float* z8,
                             const float* xsum, int64_t xs_stride, float* y) {
  const int64_t half = bn / 2;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t p = 0; p < half; p += 16) {
    const int64_t cols[4] = {p, p + 8, half + p, half + p + 8};
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += group_size, ++g) {
      __m256 a[R][4];
      for (auto& row : a) for (auto& v : row) v = _mm256_setzero_ps();
      for (int64_t k = k0; k < k0 + group_size; ++k) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + k * half + p));
        const __m128i lo = _mm_and_si128(b, low4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
        const __m256 q[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
          for (int i = 0; i < 4; ++i) a[r][i] = _mm256_fmadd_ps(xv, q[i], a[r][i]);
        }
      }
      for (int i = 0; i < 4; ++i) {
        const __m256 sv = _mm256_loadu_ps(s + g * bn + cols[i]);
        const __m256 zv = _mm256_loadu_ps(z8 + g * bn + cols[i]);
        for (int r = 0; r < R; ++r) {
          float* yp = y + r * bn + cols[i];
          const __m256 xs = _mm256_broadcast_ss(xsum + r * xs_stride + g);
          _mm256_storeu_ps(yp, _mm256_fmadd_ps(sv, a[r][i],
                                               _mm256_fmadd_ps(zv, xs, _mm256_loadu_ps(yp))));
        }
      }
    }
  }
}
#endif

// From this many rows the int4 weights are widened once into a tile that every row reads.
constexpr int64_t kInt4TileRows = 6;

// y = x W^T for W in PyTorch's int4 CPU packing with output blocks of `bn` (32 or 64).
inline at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& packed,
                              const at::Tensor& scales_and_zeros, int64_t group_size,
                              int64_t bn) {
  // Named for torch.profiler, as an ATen op would be (benchmarks/step_profile.py).
  RECORD_FUNCTION("tokenmill::int4_linear", std::vector<c10::IValue>());
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(), "int4_linear: x must be [M, K] on CPU");
  TORCH_CHECK(bn == 32 || bn == 64, "int4_linear: block width must be 32 or 64, got ", bn);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "int4_linear: packed weight must be contiguous uint8");
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 && scales_and_zeros.dim() == 3 &&
                  scales_and_zeros.size(2) == 2 && scales_and_zeros.is_contiguous(),
              "int4_linear: scales_and_zeros must be contiguous bf16 [K / g, N, 2]");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const int64_t N = scales_and_zeros.size(1);
  TORCH_CHECK(group_size > 0 && K % group_size == 0 &&
                  scales_and_zeros.size(0) == K / group_size,
              "int4_linear: ", K, " inputs do not make ", scales_and_zeros.size(0),
              " groups of ", group_size);
  TORCH_CHECK(N % bn == 0 && packed.numel() == N * K / 2,
              "int4_linear: packed weight does not hold ", N, " x ", K, " nibbles in blocks of ",
              bn);
  const bool out_bf16 = x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(out_bf16 || x_in.scalar_type() == at::kFloat, "int4_linear: x must be fp32 or bf16");
  const at::Tensor x = fp32_rows(x_in);
  at::Tensor y = at::empty({M, N}, x_in.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* szp = reinterpret_cast<const uint16_t*>(scales_and_zeros.data_ptr());
  const int64_t groups = K / group_size;
  std::vector<float> xsum(M * groups);
  group_sums(xp, M, K, group_size, xsum.data());
  tmpool::parallel_for(0, N / bn, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> tile(group_size * bn), acc(M * bn);
    std::vector<float> s(groups * bn), z8(groups * bn);
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* block = wp + b * K * (bn / 2);
      block_scales(szp, groups, N, b * bn, bn, s.data(), z8.data());
      std::fill(acc.begin(), acc.end(), 0.f);
#ifdef TOKENMILL_QGEMM_AVX2
      if (M < kInt4TileRows) {
        // 1-5 rows: in chunks of 3 and 2, each decoding the block again in registers.
        for (int64_t m = 0; m < M;) {
          const int64_t r = M - m == 4 ? 2 : std::min<int64_t>(3, M - m);
          const float* xr = xp + m * K;
          const float* xs = xsum.data() + m * groups;
          float* yr = acc.data() + m * bn;
          if (r == 3) {
            int4_rows_direct<3>(xr, K, block, K, group_size, bn, s.data(), z8.data(), xs, groups, yr);
          } else if (r == 2) {
            int4_rows_direct<2>(xr, K, block, K, group_size, bn, s.data(), z8.data(), xs, groups, yr);
          } else {
            int4_rows_direct<1>(xr, K, block, K, group_size, bn, s.data(), z8.data(), xs, groups, yr);
          }
          m += r;
        }
      } else
#endif
      {
        for (int64_t g = 0; g < groups; ++g) {
          widen_int4_tile(block, g * group_size, group_size, bn, tile.data());
          tile_group(xp, K, M, g * group_size, group_size, tile.data(), bn, s.data() + g * bn,
                     z8.data() + g * bn, xsum.data() + g, groups, acc.data());
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        const float* a = acc.data() + m * bn;
        if (out_bf16) {
          c10::BFloat16* out = y.data_ptr<c10::BFloat16>() + m * N + b * bn;
          for (int64_t j = 0; j < bn; ++j) out[j] = from_f<c10::BFloat16>(a[j]);
        } else {
          std::memcpy(y.data_ptr<float>() + m * N + b * bn, a, bn * sizeof(float));
        }
      }
    }
  });
  return y;
}

// ---- int8 ------------------------------------------------------------------------------
// weight int8 [N, K] with one scale per output row: y[m, n] = (sum_k x[m, k] w[n, k]) * s[n].
// Each dot product keeps 8 partial sums (input k in lane k % 8, in k order), added up in a
// fixed order at the end; K's tail past a multiple of 8 goes on lane 0's chain.

constexpr int64_t kInt8Rows = 16;  // output rows decoded to fp32 at a time

inline void decode_int8_rows(const int8_t* w, int64_t rows, int64_t K, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* src = w + r * K;
    float* out = dst + r * K;
    int64_t k = 0;
#ifdef TOKENMILL_QGEMM_AVX2
    for (; k + 8 <= K; k += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + k));
      _mm256_storeu_ps(out + k, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    }
#endif
    for (; k < K; ++k) out[k] = static_cast<float>(src[k]);
  }
}

// The sum of 8 lanes in a fixed order: (l0 + l4) + (l2 + l6), (l1 + l5) + (l3 + l7).
inline float sum_lanes(const float* l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

// dots[m][r] = x[m] . w[r] over [0, K8) in 8 lanes, then K's tail on lane 0.
inline void dot_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t rows,
                     float* out, int64_t ldo, const float* scales) {
  const int64_t K8 = K - K % 8;
  int64_t m = 0;
  float lanes[8];
#ifdef TOKENMILL_QGEMM_AVX2
  // 2 rows of x x 4 rows of w: 8 accumulators, 6 loads per 8 fmas.
  for (; m + 2 <= M; m += 2) {
    const float* x0 = x + m * K;
    const float* x1 = x0 + K;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      const float* w0 = w + r * K;
      __m256 a[2][4];
      for (auto& row : a) for (auto& v : row) v = _mm256_setzero_ps();
      for (int64_t k = 0; k < K8; k += 8) {
        const __m256 xa = _mm256_loadu_ps(x0 + k), xb = _mm256_loadu_ps(x1 + k);
        for (int j = 0; j < 4; ++j) {
          const __m256 wv = _mm256_loadu_ps(w0 + j * K + k);
          a[0][j] = _mm256_fmadd_ps(xa, wv, a[0][j]);
          a[1][j] = _mm256_fmadd_ps(xb, wv, a[1][j]);
        }
      }
      for (int i = 0; i < 2; ++i) {
        const float* xi = i == 0 ? x0 : x1;
        for (int j = 0; j < 4; ++j) {
          _mm256_storeu_ps(lanes, a[i][j]);
          for (int64_t k = K8; k < K; ++k) lanes[0] = std::fma(xi[k], w0[j * K + k], lanes[0]);
          out[(m + i) * ldo + r + j] = sum_lanes(lanes) * scales[r + j];
        }
      }
    }
    for (; r < rows; ++r) {
      for (int i = 0; i < 2; ++i) {
        const float* xi = x + (m + i) * K;
        const float* wr = w + r * K;
        __m256 a = _mm256_setzero_ps();
        for (int64_t k = 0; k < K8; k += 8) {
          a = _mm256_fmadd_ps(_mm256_loadu_ps(xi + k), _mm256_loadu_ps(wr + k), a);
        }
        _mm256_storeu_ps(lanes, a);
        for (int64_t k = K8; k < K; ++k) lanes[0] = std::fma(xi[k], wr[k], lanes[0]);
        out[(m + i) * ldo + r] = sum_lanes(lanes) * scales[r];
      }
    }
  }
  for (; m < M; ++m) {
    const float* xi = x + m * K;
    for (int64_t r = 0; r < rows; ++r) {
      const float* wr = w + r * K;
      __m256 a = _mm256_setzero_ps();
      for (int64_t k = 0; k < K8; k += 8) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(xi + k), _mm256_loadu_ps(wr + k), a);
      }
      _mm256_storeu_ps(lanes, a);
      for (int64_t k = K8; k < K; ++k) lanes[0] = std::fma(xi[k], wr[k], lanes[0]);
      out[m * ldo + r] = sum_lanes(lanes) * scales[r];
    }
  }
#else
  for (; m < M; ++m) {
    const float* xi = x + m * K;
    for (int64_t r = 0; r < rows; ++r) {
      const float* wr = w + r * K;
      for (float& l : lanes) l = 0.f;
      for (int64_t k = 0; k < K8; ++k) lanes[k % 8] = std::fma(xi[k], wr[k], lanes[k % 8]);
      for (int64_t k = K8; k < K; ++k) lanes[0] = std::fma(xi[k], wr[k], lanes[0]);
      out[m * ldo + r] = sum_lanes(lanes) * scales[r];
    }
  }
#endif
}

#ifdef TOKENMILL_QGEMM_AVX2
// dot_rows for 1 or 2 rows of x with the int8 weights widened in registers, no tile: the same
// lanes, chains and final sums, so the same bits.
inline void int8_rows_direct(const float* x, int64_t M, int64_t K, const int8_t* w,
                             int64_t rows, float* out, int64_t ldo, const float* scales) {
  const int64_t K8 = K - K % 8;
  float lanes[8];
  auto widen = [](const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  };
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    __m256 a[2][4];
    for (auto& row : a) for (auto& v : row) v = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
      const __m256 xa = _mm256_loadu_ps(x + k);
      const __m256 xb = M == 2 ? _mm256_loadu_ps(x + K + k) : xa;
      for (int j = 0; j < 4; ++j) {
        const __m256 wv = widen(w + (r + j) * K + k);
        a[0][j] = _mm256_fmadd_ps(xa, wv, a[0][j]);
        if (M == 2) a[1][j] = _mm256_fmadd_ps(xb, wv, a[1][j]);
      }
    }
    for (int i = 0; i < M; ++i) {
      for (int j = 0; j < 4; ++j) {
        _mm256_storeu_ps(lanes, a[i][j]);
        const int8_t* wr = w + (r + j) * K;
        for (int64_t k = K8; k < K; ++k) {
          lanes[0] = std::fma(x[i * K + k], static_cast<float>(wr[k]), lanes[0]);
        }
        out[i * ldo + r + j] = sum_lanes(lanes) * scales[r + j];
      }
    }
  }
  for (; r < rows; ++r) {
    const int8_t* wr = w + r * K;
    for (int i = 0; i < M; ++i) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t k = 0; k < K8; k += 8) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + k), widen(wr + k), a);
      }
      _mm256_storeu_ps(lanes, a);
      for (int64_t k = K8; k < K; ++k) {
        lanes[0] = std::fma(x[i * K + k], static_cast<float>(wr[k]), lanes[0]);
      }
      out[i * ldo + r] = sum_lanes(lanes) * scales[r];
    }
  }
}
#endif

// y = x (w * scales[:, None])^T for int8 w [N, K] and bf16 or fp32 scales [N].
inline at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& weight,
                              const at::Tensor& scales_in) {
  RECORD_FUNCTION("tokenmill::int8_linear", std::vector<c10::IValue>());
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(), "int8_linear: x must be [M, K] on CPU");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "int8_linear: weight must be contiguous int8 [N, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "int8_linear: weight has ", weight.size(1),
              " inputs, x has ", K);
  TORCH_CHECK(scales_in.numel() == N, "int8_linear: ", scales_in.numel(), " scales for ", N,
              " outputs");
  const bool out_bf16 = x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(out_bf16 || x_in.scalar_type() == at::kFloat, "int8_linear: x must be fp32 or bf16");
  const at::Tensor x = fp32_rows(x_in);
  const at::Tensor scales = scales_in.to(at::kFloat).contiguous();
  // fp32 results, rounded to bf16 once at the end when x is bf16.
  at::Tensor y = at::empty({M, N}, x_in.options().dtype(at::kFloat));
  if (M == 0) return y.to(x_in.scalar_type());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t num_tiles = (N + kInt8Rows - 1) / kInt8Rows;
  tmpool::parallel_for(0, num_tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> tile(M <= 2 ? 0 : kInt8Rows * K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = t * kInt8Rows, rows = std::min(kInt8Rows, N - r0);
#ifdef TOKENMILL_QGEMM_AVX2
      if (M <= 2) {
        int8_rows_direct(xp, M, K, wp + r0 * K, rows, yp + r0, N, sp + r0);
        continue;
      }
#endif
      decode_int8_rows(wp + r0 * K, rows, K, tile.data());
      dot_rows(xp, M, K, tile.data(), rows, yp + r0, N, sp + r0);
    }
  });
  return out_bf16 ? y.to(at::kBFloat16) : y;
}

// The whole weight, transposed and dequantized: w_t[k][n] = (q - 8) * scale + zero in bf16,
// rounded once from one fp32 fma, for one dense bf16 matmul (prefill: many rows). One pass over
// the packed bytes in place of the ~8 ATen ops (and their temporaries) it takes in PyTorch;
// parallel over k on OpenMP, as it runs between PyTorch's own ops.
inline at::Tensor dequantize_int4_t(const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                                    int64_t group_size, int64_t N, int64_t K, int64_t block_n) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == N * K / 2,
              "dequantize_int4_t: packed must be contiguous uint8 with N * K / 2 bytes");
  TORCH_CHECK(block_n > 0 && block_n % 2 == 0 && N % block_n == 0,
              "dequantize_int4_t: N must be whole blocks of block_n outputs");
  TORCH_CHECK(group_size > 0 && K % group_size == 0,
              "dequantize_int4_t: K must be whole groups");
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 &&
                  scales_and_zeros.is_contiguous() && scales_and_zeros.dim() == 3 &&
                  scales_and_zeros.size(0) == K / group_size && scales_and_zeros.size(1) == N &&
                  scales_and_zeros.size(2) == 2,
              "dequantize_int4_t: scales_and_zeros must be contiguous bf16 [K / g, N, 2]");
  at::Tensor out = at::empty({K, N}, packed.options().dtype(at::kBFloat16));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales_and_zeros.data_ptr());
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  const int64_t half = block_n / 2, blocks = N / block_n;
  at::parallel_for(0, K, 16, [&](int64_t k0, int64_t k1) {
    std::vector<float> scale(static_cast<size_t>(N)), zero(static_cast<size_t>(N));
    int64_t group = -1;
    for (int64_t k = k0; k < k1; ++k) {
      if (k / group_size != group) {
        group = k / group_size;
        const uint16_t* row = sz + group * N * 2;
        for (int64_t n = 0; n < N; ++n) {
          scale[n] = bf16_bits_to_f(row[2 * n]);
          zero[n] = bf16_bits_to_f(row[2 * n + 1]);
        }
      }
      c10::BFloat16* out_row = dst + k * N;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* bytes = src + (b * K + k) * half;
        const int64_t n0 = b * block_n;
        for (int64_t j = 0; j < half; ++j) {
          const float lo = static_cast<float>(static_cast<int>(bytes[j] & 15) - 8);
          out_row[n0 + j] = from_f<c10::BFloat16>(std::fma(lo, scale[n0 + j], zero[n0 + j]));
        }
        for (int64_t j = 0; j < half; ++j) {
          const float hi = static_cast<float>(static_cast<int>(bytes[j] >> 4) - 8);
          const int64_t n = n0 + half + j;
          out_row[n] = from_f<c10::BFloat16>(std::fma(hi, scale[n], zero[n]));
        }
      }
    }
  });
  return out;
}

}  // namespace qgemm
}  // namespace tokenmill
