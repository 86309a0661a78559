// Weight-only int4 and int8 matmuls for the CPU: y[M, N] = x[M, K] W^T, W kept quantized.
//
// PyTorch's _weight_int4pack_mm_for_cpu decodes the weights again for every few rows of x, so
// on an AVX2 CPU a 32-row decode step costs ~14x a 1-row one. Here each tile of W is decoded
// once per call, to fp32 in a cache-resident buffer, and every row of x is multiplied against
// it there:
//   - int4: the column block of PyTorch's packed layout (BN = 32 or 64 outputs), one quant
//     group of K at a time (outer products, vectorized over the outputs);
//   - int8: a few output rows at a time, the whole of K (dot products, vectorized over K).
// Each output is one FMA chain in a fixed order over K, and the same code runs for every row
// count, so a row's result does not depend on how many rows share the call (the
// batch-invariance `--deterministic` relies on). fp32 throughout: x in bf16 is widened exactly.
#pragma once

#include <ATen/Parallel.h>
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
// and output b*BN + BN/2 + j in its high one. scales_and_zeros: bf16 [K / g, N, 2].
// w = (q - 8) * scale + zero, as one fma.

// Decode inputs [k0, k0 + kc) of one column block into dst[kc][BN].
inline void decode_int4_tile(const uint8_t* block, int64_t k0, int64_t kc, int64_t bn,
                             const float* scale, const float* zero, float* dst) {
  const int64_t half = bn / 2;
  for (int64_t kk = 0; kk < kc; ++kk) {
    const uint8_t* src = block + (k0 + kk) * half;
    float* out = dst + kk * bn;
    int64_t j = 0;
#ifdef TOKENMILL_QGEMM_AVX2
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m256 eight = _mm256_set1_ps(8.f);
    for (; j + 16 <= half; j += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
      const __m128i lo = _mm_and_si128(b, low4);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      const int64_t cols[4] = {j, j + 8, half + j, half + j + 8};
      for (int p = 0; p < 4; ++p) {
        const __m256 q = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p])), eight);
        _mm256_storeu_ps(out + cols[p], _mm256_fmadd_ps(q, _mm256_loadu_ps(scale + cols[p]),
                                                        _mm256_loadu_ps(zero + cols[p])));
      }
    }
#endif
    for (; j < half; ++j) {
      const float lo = static_cast<float>(src[j] & 15) - 8.f;
      const float hi = static_cast<float>(src[j] >> 4) - 8.f;
      out[j] = std::fma(lo, scale[j], zero[j]);
      out[half + j] = std::fma(hi, scale[half + j], zero[half + j]);
    }
  }
}

// acc[m][0, bn) += sum over kk < kc of x[m][k0 + kk] * tile[kk][0, bn), for rows [0, M),
// each output one fma chain in kk order.
inline void tile_outer_products(const float* x, int64_t ldx, int64_t M, int64_t k0, int64_t kc,
                                const float* tile, int64_t bn, float* acc) {
  int64_t m = 0;
#ifdef TOKENMILL_QGEMM_AVX2
  // 6 rows x 16 columns: 12 accumulators, 2 tile loads and 6 broadcasts per input.
  for (; m + 6 <= M; m += 6) {
    for (int64_t c = 0; c + 16 <= bn; c += 16) {
      __m256 a[6][2];
      for (int r = 0; r < 6; ++r) {
        a[r][0] = _mm256_loadu_ps(acc + (m + r) * bn + c);
        a[r][1] = _mm256_loadu_ps(acc + (m + r) * bn + c + 8);
      }
      for (int64_t kk = 0; kk < kc; ++kk) {
        const __m256 w0 = _mm256_loadu_ps(tile + kk * bn + c);
        const __m256 w1 = _mm256_loadu_ps(tile + kk * bn + c + 8);
        for (int r = 0; r < 6; ++r) {
          const __m256 xv = _mm256_broadcast_ss(x + (m + r) * ldx + k0 + kk);
          a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
          a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
        }
      }
      for (int r = 0; r < 6; ++r) {
        _mm256_storeu_ps(acc + (m + r) * bn + c, a[r][0]);
        _mm256_storeu_ps(acc + (m + r) * bn + c + 8, a[r][1]);
      }
    }
  }
  // The remaining rows one at a time, 32 columns per pass: the same chain per output.
  for (; m < M; ++m) {
    float* arow = acc + m * bn;
    const float* xrow = x + m * ldx + k0;
    for (int64_t c = 0; c + 32 <= bn; c += 32) {
      __m256 a0 = _mm256_loadu_ps(arow + c), a1 = _mm256_loadu_ps(arow + c + 8);
      __m256 a2 = _mm256_loadu_ps(arow + c + 16), a3 = _mm256_loadu_ps(arow + c + 24);
      for (int64_t kk = 0; kk < kc; ++kk) {
        const __m256 xv = _mm256_broadcast_ss(xrow + kk);
        const float* w = tile + kk * bn + c;
        a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w), a0);
        a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 8), a1);
        a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 16), a2);
        a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 24), a3);
      }
      _mm256_storeu_ps(arow + c, a0);
      _mm256_storeu_ps(arow + c + 8, a1);
      _mm256_storeu_ps(arow + c + 16, a2);
      _mm256_storeu_ps(arow + c + 24, a3);
    }
  }
#else
  for (; m < M; ++m) {
    float* arow = acc + m * bn;
    const float* xrow = x + m * ldx + k0;
    for (int64_t kk = 0; kk < kc; ++kk) {
      const float* w = tile + kk * bn;
      for (int64_t c = 0; c < bn; ++c) arow[c] = std::fma(xrow[kk], w[c], arow[c]);
    }
  }
#endif
}

#ifdef TOKENMILL_QGEMM_AVX2
// For 1 or 2 rows: decode each input's 32 weights (bytes [16p, 16p + 16) of the block: outputs
// 16p.. and half + 16p..) straight into registers, no tile. The same values and chains as
// decode_int4_tile + tile_outer_products, so the bits match theirs.
template <int R>
inline void int4_rows_direct(const float* x, int64_t ldx, const uint8_t* block, int64_t K,
                             int64_t group_size, int64_t bn, const float* scales,
                             const float* zeros, float* acc) {
  const int64_t half = bn / 2;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256 eight = _mm256_set1_ps(8.f);
  for (int64_t p = 0; p < half; p += 16) {
    const int64_t cols[4] = {p, p + 8, half + p, half + p + 8};
    __m256 a[R][4];
    for (auto& row : a) for (auto& v : row) v = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += group_size) {
      const float* sc = scales + (k0 / group_size) * bn;
      const float* zc = zeros + (k0 / group_size) * bn;
      __m256 s[4], z[4];
      for (int i = 0; i < 4; ++i) {
        s[i] = _mm256_loadu_ps(sc + cols[i]);
        z[i] = _mm256_loadu_ps(zc + cols[i]);
      }
      for (int64_t k = k0; k < k0 + group_size; ++k) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + k * half + p));
        const __m128i lo = _mm_and_si128(b, low4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        __m256 w[4];
        for (int i = 0; i < 4; ++i) {
          const __m256 q = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), eight);
          w[i] = _mm256_fmadd_ps(q, s[i], z[i]);
        }
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
          for (int i = 0; i < 4; ++i) a[r][i] = _mm256_fmadd_ps(xv, w[i], a[r][i]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc + r * bn + cols[i], a[r][i]);
    }
  }
}
#endif

// y = x W^T for W in PyTorch's int4 CPU packing with output blocks of `bn` (32 or 64).
inline at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& packed,
                              const at::Tensor& scales_and_zeros, int64_t group_size,
                              int64_t bn) {
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
  const at::Tensor x = fp32_rows(x_in);
  at::Tensor y = at::empty({M, N}, x_in.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* szp = reinterpret_cast<const uint16_t*>(scales_and_zeros.data_ptr());
  const int64_t num_blocks = N / bn;
  const int64_t kc = group_size;
  const bool out_bf16 = x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(out_bf16 || x_in.scalar_type() == at::kFloat, "int4_linear: x must be fp32 or bf16");
  at::parallel_for(0, num_blocks, 1, [&](int64_t b0, int64_t b1) {
    const int64_t groups = K / group_size;
    std::vector<float> tile(kc * bn), acc(M * bn), scale(groups * bn), zero(groups * bn);
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* block = wp + b * K * (bn / 2);
      for (int64_t g = 0; g < groups; ++g) {
        const uint16_t* sz = szp + (g * N + b * bn) * 2;
        for (int64_t j = 0; j < bn; ++j) {
          scale[g * bn + j] = bf16_bits_to_f(sz[2 * j]);
          zero[g * bn + j] = bf16_bits_to_f(sz[2 * j + 1]);
        }
      }
#ifdef TOKENMILL_QGEMM_AVX2
      if (M == 1) {
        int4_rows_direct<1>(xp, K, block, K, group_size, bn, scale.data(), zero.data(), acc.data());
      } else if (M == 2) {
        int4_rows_direct<2>(xp, K, block, K, group_size, bn, scale.data(), zero.data(), acc.data());
      } else
#endif
      {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
          const int64_t g = k0 / group_size;
          decode_int4_tile(block, k0, kc, bn, scale.data() + g * bn, zero.data() + g * bn,
                           tile.data());
          tile_outer_products(xp, K, M, k0, kc, tile.data(), bn, acc.data());
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        const float* a = acc.data() + m * bn;
        if (out_bf16) {
          c10::BFloat16* out = y.data_ptr<c10::BFloat16>() + m * N + b * bn;
          for (int64_t j = 0; j < bn; ++j) out[j] = c10::BFloat16(a[j]);
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
  at::parallel_for(0, num_tiles, 1, [&](int64_t t0, int64_t t1) {
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

}  // namespace qgemm
}  // namespace tokenmill
