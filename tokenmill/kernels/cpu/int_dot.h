// Weight-only matmuls on integer activations for the CPU: the activations of each row are
// quantized once per call, and the products run as integer dot products (vpmaddubsw /
// vpmaddwd), several times as many per instruction as the fp32 FMAs of quant_gemm.h.
//   - int4_q8_linear: int4 weights in a layout of tokenmill's own ("q8 tiles") times int16
//     activations (the default: vpmaddwd) or int8 ones (vpmaddubsw, what ggml computes
//     for Q4_1 x Q8_1), quantized per block of 32 inputs;
//   - int8_q16_linear: int8 weights (the plain [N, K] layout) times int16 activations, one scale
//     a row: the output head, whose logits must stay as close to fp32 as the fp32 kernel's.
//
// ---- int4 x int8 / int16 ---------------------------------------------------------------
//
// The fp32 kernels of quant_gemm.h widen every nibble to a float and spend one FMA lane on it:
// on an AVX2 CPU a single-row decode step then runs at ~5 GB/s of weights, a third of what the
// memory delivers. Here each row of x is first quantized in blocks of 32 inputs (one fp32 scale
// a block, absmax / 32767 or / 127), and the nibbles are multiplied by the activations 16
// (vpmaddwd) or 32 (vpmaddubsw) at a time into integer pair sums.
//
// Weight layout ("q8 tiles", packed by tokenmill.quant.packing.pack_int4_q8): outputs in tiles
// of 16, inputs in steps of 4. Tile t, step s is 32 bytes; byte 4 * j + i holds input 4 s + i
// of output 16 t + j in its low nibble and of output 16 t + 8 + j in its high nibble (j < 8,
// i < 4). For int8 activations one 32-byte load gives two registers of [8 outputs][4 inputs]
// bytes, which vpmaddubsw against the 4 activations broadcast turns into 16-bit sums of input
// pairs, and vpmaddwd against ones into one 32-bit sum per output; for int16 ones, shifts and
// masks of the same load give four registers of [8 outputs][2 inputs] words (see block_dots).
// Scales: bf16 [tiles][groups][2][16], the tile's 16 scales then its 16 zeros,
// w = (q - 8) * scale + zero as in quant_gemm.h.
//
// Per output and group of inputs: y += scale * dot + (zero - 8 scale) * xsum, dot the sum over
// the group's 32-blocks of (integer dot) * (block's activation scale) in block order, xsum the
// sum of the dequantized activations. Integer sums are exact and the float steps run in a fixed
// order per row, so a row's result does not depend on the other rows of the call.
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
#define TOKENMILL_Q8_AVX2 1
// VNNI's fused multiply-add of byte quads / word pairs into 32-bit lanes (vpdpbusd, vpdpwssd),
// on 256-bit registers: AVX512-VNNI with VL (Ice Lake, Zen 4 and later) or AVX-VNNI (Alder
// Lake). Integer sums wrap as the vpmaddwd + vpaddd pairs they replace do, so the results are
// the same bits; only the instruction count changes.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TOKENMILL_VNNI 1
#define TOKENMILL_DPWSSD _mm256_dpwssd_epi32
#define TOKENMILL_DPBUSD _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define TOKENMILL_VNNI 1
#define TOKENMILL_DPWSSD _mm256_dpwssd_avx_epi32
#define TOKENMILL_DPBUSD _mm256_dpbusd_avx_epi32
#endif
#endif

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "decode_kernels.h"
#include "thread_pool.h"

namespace tokenmill {
namespace intdot {

constexpr int64_t kTileN = 16;  // outputs per weight tile
constexpr int64_t kBlock = 32;  // inputs per activation block (one int8 scale)
constexpr int64_t kTileBytesPerInput = kTileN / 2;
constexpr int64_t kQ8PrefetchTiles = 2;  // how far ahead the weights are fetched, in tiles

// How the kernels fetch weights ahead of use. A model larger than the last-level cache is read
// once a step and has left the caches before the next one: its lines are fetched
// non-temporally (prefetchnta), so that they do not evict what the step does read again (the
// KV cache, the activations, the engine's own data between steps), as they would through the
// normal path. A batch-1 decode of the embedded model (92 MiB) with a 500-token context: ~10%
// faster on a Zen 5 with a 32 MiB L3. A model that fits keeps the normal fetch (it is read
// from cache in the next step). Set by tokenmill.kernels.cpu.note_model_weights; off by default.
// Set it between calls only: the pool hands each call to its workers through an
// acquire/release ticket, which orders the write before their reads.
inline bool g_stream_weights = false;

inline void prefetch_weight(const void* p) {
  if (g_stream_weights) {
    __builtin_prefetch(p, 0, 0);  // non-temporal (x86: prefetchnta)
  } else {
    __builtin_prefetch(p, 0, 3);  // into every level (prefetcht0)
  }
}

inline float bf16_to_f(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Activations quantized per block of 32 inputs to Q: int8 (levels 127: the product runs on
// vpmaddubsw) or int16 (levels 32767: vpmaddwd, twice the instructions, 256x finer steps).
template <typename Q>
struct ActLevels;
template <>
struct ActLevels<int8_t> { static constexpr float kMax = 127.f; };
template <>
struct ActLevels<int16_t> { static constexpr float kMax = 32767.f; };

// Where input k of a row is stored: int16 rows keep each 4 inputs as (0, 2, 1, 3), so that
// one 32-bit broadcast gives the pair (k0, k2) and the next (k1, k3) (see tile_rows).
template <typename Q>
inline int64_t act_slot(int64_t k) {
  if constexpr (sizeof(Q) == 1) {
    return k;
  } else {
    constexpr int64_t kSlot[4] = {0, 2, 1, 3};
    return (k & ~int64_t{3}) | kSlot[k & 3];
  }
}

// Rows of x quantized per block of 32: q [M][K] (in act_slot order), d (scale) [M][K / 32],
// and per group of `group` inputs the sum of the dequantized activations, gsum [M][K / group].
template <typename Q>
struct QuantizedRows {
  std::vector<Q> q;
  std::vector<float> d;
  std::vector<float> gsum;
};

#if defined(__AVX512F__)
// 16 inputs as fp32 lanes.
inline __m512 load16_ps(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16_ps(const c10::BFloat16* x) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// One block of 32 inputs of quantize_rows_into (below) in two registers: the same scale, the same
// levels (round to nearest even, as nearbyint) and the same act_slot order, so the same bits.
// Returns the block's integer sum; writes the quantized block to q and its scale to d.
template <typename Q, typename X>
inline int32_t quantize_block_avx512(const X* x, float k_max, Q* q, float* d) {
  __m512 lo = load16_ps(x), hi = load16_ps(x + 16);
  if constexpr (sizeof(Q) == 2) {  // act_slot's (0, 2, 1, 3) within each 4, its own inverse
    const __m512i perm = _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    lo = _mm512_permutexvar_ps(perm, lo);
    hi = _mm512_permutexvar_ps(perm, hi);
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float inv = amax > 0.f ? k_max / amax : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(lo, vinv), kRound));
  const __m512i qhi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(hi, vinv), kRound));
  if constexpr (sizeof(Q) == 2) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(qlo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtepi32_epi16(qhi));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
  }
  *d = amax / k_max;
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
}
#endif

// X: fp32 or bf16 rows, read as they are (no widened copy: a decode step's calls are small
// enough for an extra ATen op to show).
template <typename Q, typename X>
inline void quantize_rows_into(const X* x, int64_t M, int64_t K, int64_t group,
                               QuantizedRows<Q>& out) {
  constexpr float kMax = ActLevels<Q>::kMax;
  const int64_t nb = K / kBlock, bpg = group / kBlock, groups = K / group;
  out.q.resize(M * K);
  out.d.resize(M * nb);
  out.gsum.resize(M * groups);
  tmpool::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<int32_t> bsum(nb);
    for (int64_t m = m0; m < m1; ++m) {
      Q* qr = out.q.data() + m * K;
      for (int64_t b = 0; b < nb; ++b) {
#if defined(__AVX512F__)
        if constexpr (kBlock == 32) {
          bsum[b] = quantize_block_avx512<Q>(x + m * K + b * kBlock, kMax, qr + b * kBlock,
                                             &out.d[m * nb + b]);
          continue;
        }
#endif
        float xb[kBlock];
        for (int64_t k = 0; k < kBlock; ++k) xb[k] = to_f(x[m * K + b * kBlock + k]);
        float amax = 0.f;
        for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
        const float inv = amax > 0.f ? kMax / amax : 0.f;
        int32_t sum = 0;
        for (int64_t k = 0; k < kBlock; ++k) {
          const int32_t v = static_cast<int32_t>(std::nearbyint(xb[k] * inv));
          qr[act_slot<Q>(b * kBlock + k)] = static_cast<Q>(v);
          sum += v;
        }
        out.d[m * nb + b] = amax / kMax;
        bsum[b] = sum;
      }
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.f;
        for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
          s = std::fma(static_cast<float>(bsum[b]), out.d[m * nb + b], s);
        }
        out.gsum[m * groups + g] = s;
      }
    }
  });
}

// This thread's QuantizedRows, kept between calls.
template <typename Q>
inline QuantizedRows<Q>& thread_rows() {
  static thread_local QuantizedRows<Q> rows;
  return rows;
}

#ifdef TOKENMILL_Q8_AVX2
// VNNI from this many rows a pass: a fused multiply-add chains its accumulator through a
// multiply's latency where vpmaddwd + vpaddd chain it through an add's, and with fewer rows
// there are too few independent accumulators to hide it (a one-row call ran ~12% slower
// with VNNI on a Zen 5, four rows ~10% faster).
constexpr int kVnniMinRows = 4;

// The integer dots of one 32-block for R rows: ia[r][0] outputs 0-7, ia[r][1] outputs 8-15,
// as 32-bit sums. wb: the block's 8 steps of 32 bytes; xb: row 0's block, rows K apart.
template <int R, typename Q>
inline void block_dots(const uint8_t* wb, const Q* xb, int64_t K, __m256i (*ia)[2]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
#ifdef TOKENMILL_VNNI
  if constexpr (sizeof(Q) == 1 && R >= kVnniMinRows) {
    // Unsigned nibbles times signed activations, four products a lane.
    for (int r = 0; r < R; ++r) ia[r][0] = ia[r][1] = _mm256_setzero_si256();
    for (int s = 0; s < kBlock / 4; ++s) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * s));
      const __m256i lo = _mm256_and_si256(v, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xb + r * K + 4 * s, sizeof(four));
        const __m256i xv = _mm256_set1_epi32(four);
        ia[r][0] = TOKENMILL_DPBUSD(ia[r][0], lo, xv);
        ia[r][1] = TOKENMILL_DPBUSD(ia[r][1], hi, xv);
      }
    }
    return;
  }
#endif
  if constexpr (sizeof(Q) == 1) {
    __m256i a16[R][2];
    for (auto& row : a16) for (auto& v : row) v = _mm256_setzero_si256();
    for (int s = 0; s < kBlock / 4; ++s) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * s));
      const __m256i lo = _mm256_and_si256(v, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xb + r * K + 4 * s, sizeof(four));
        const __m256i xv = _mm256_set1_epi32(four);
        // |pair| <= 2 * 15 * 127: eight steps stay inside int16
        a16[r][0] = _mm256_add_epi16(a16[r][0], _mm256_maddubs_epi16(lo, xv));
        a16[r][1] = _mm256_add_epi16(a16[r][1], _mm256_maddubs_epi16(hi, xv));
      }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) ia[r][h] = _mm256_madd_epi16(a16[r][h], ones);
    }
  } else {
    // Each 16-bit word of a step holds inputs (k0, k1) or (k2, k3) of output j (low nibbles)
    // and 8 + j (high): four shifts and masks give [8 outputs][(k0, k2) or (k1, k3)] words.
    const __m256i low4w = _mm256_set1_epi16(0x000F);
    for (int r = 0; r < R; ++r) ia[r][0] = ia[r][1] = _mm256_setzero_si256();
    for (int s = 0; s < kBlock / 4; ++s) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * s));
      const __m256i q02_lo = _mm256_and_si256(v, low4w);
      const __m256i q02_hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4w);
      const __m256i q13_lo = _mm256_and_si256(_mm256_srli_epi16(v, 8), low4w);
      const __m256i q13_hi = _mm256_srli_epi16(v, 12);
      for (int r = 0; r < R; ++r) {
        int32_t x02, x13;
        std::memcpy(&x02, xb + r * K + 4 * s, sizeof(x02));
        std::memcpy(&x13, xb + r * K + 4 * s + 2, sizeof(x13));
        const __m256i a = _mm256_set1_epi32(x02), c = _mm256_set1_epi32(x13);
        // |lane| <= 8 steps * 4 * 15 * 32767: far inside int32
#ifdef TOKENMILL_VNNI
        if constexpr (R >= kVnniMinRows) {
          ia[r][0] = TOKENMILL_DPWSSD(TOKENMILL_DPWSSD(ia[r][0], q02_lo, a), q13_lo, c);
          ia[r][1] = TOKENMILL_DPWSSD(TOKENMILL_DPWSSD(ia[r][1], q02_hi, a), q13_hi, c);
          continue;
        }
#endif
        ia[r][0] = _mm256_add_epi32(ia[r][0], _mm256_add_epi32(_mm256_madd_epi16(q02_lo, a),
                                                               _mm256_madd_epi16(q13_lo, c)));
        ia[r][1] = _mm256_add_epi32(ia[r][1], _mm256_add_epi32(_mm256_madd_epi16(q02_hi, a),
                                                               _mm256_madd_epi16(q13_hi, c)));
      }
    }
  }
  (void)low4;
}
#endif

// One tile (16 outputs) for R rows of quantized x: y [R][16] = those rows times the tile.
// w: the tile's K * 8 bytes; sz: its [groups][2][16] bf16 scales and zeros.
template <int R, typename Q>
inline void tile_rows(const uint8_t* w, const uint16_t* sz, const Q* xq, const float* xd,
                      const float* xg, int64_t K, int64_t group, float* y) {
  const int64_t nb = K / kBlock, bpg = group / kBlock, groups = K / group;
  const int64_t prefetch = kQ8PrefetchTiles * K * kTileBytesPerInput;
  float acc[R][kTileN];
  for (auto& row : acc) for (float& v : row) v = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    float dot[R][kTileN];
#ifdef TOKENMILL_Q8_AVX2
    __m256 fd[R][2];
    for (auto& row : fd) for (auto& v : row) v = _mm256_setzero_ps();
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      const uint8_t* wb = w + b * kBlock * kTileBytesPerInput;
      // The next tiles ahead of the hardware prefetcher (as in int8_q16_dots below).
      for (int64_t line = 0; line < kBlock * kTileBytesPerInput; line += 64) {
        prefetch_weight(reinterpret_cast<const char*>(wb + prefetch + line));
      }
      __m256i ia[R][2];
      block_dots<R, Q>(wb, xq + b * kBlock, K, ia);
      for (int r = 0; r < R; ++r) {
        const __m256 d = _mm256_set1_ps(xd[r * nb + b]);
        for (int h = 0; h < 2; ++h) {
          fd[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][h]), d, fd[r][h]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(dot[r], fd[r][0]);
      _mm256_storeu_ps(dot[r] + 8, fd[r][1]);
    }
#else
    for (auto& row : dot) for (float& v : row) v = 0.f;
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      const uint8_t* wb = w + b * kBlock * kTileBytesPerInput;
      for (int r = 0; r < R; ++r) {
        int32_t idot[kTileN] = {};
        for (int s = 0; s < kBlock / 4; ++s) {
          for (int j = 0; j < 8; ++j) {
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = wb[32 * s + 4 * j + i];
              const int32_t xv = xq[r * K + act_slot<Q>(b * kBlock + 4 * s + i)];
              idot[j] += (byte & 15) * xv;
              idot[8 + j] += (byte >> 4) * xv;
            }
          }
        }
        for (int64_t n = 0; n < kTileN; ++n) {
          dot[r][n] = std::fma(static_cast<float>(idot[n]), xd[r * nb + b], dot[r][n]);
        }
      }
    }
#endif
    const uint16_t* sg = sz + g * 2 * kTileN;
    prefetch_weight(sg + kQ8PrefetchTiles * groups * 2 * kTileN);
    for (int64_t n = 0; n < kTileN; ++n) {
      const float scale = bf16_to_f(sg[n]);
      const float z8 = std::fma(-8.f, scale, bf16_to_f(sg[kTileN + n]));
      for (int r = 0; r < R; ++r) {
        acc[r][n] = std::fma(scale, dot[r][n], std::fma(z8, xg[r * groups + g], acc[r][n]));
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * kTileN, acc[r], sizeof(acc[r]));
}

#if defined(TOKENMILL_Q8_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define TOKENMILL_Q8_AVX512 1
// int8 activations take the pairs where VNNI has vpdpbusd on 512-bit registers.
#if defined(__AVX512VNNI__)
#define TOKENMILL_Q8_PAIR_INT8 1
#endif
// Two tiles at once on 512-bit registers: lanes 0-7 of a register hold outputs of tile t, lanes
// 8-15 the same outputs of tile t + 1, so one broadcast of the activations serves both tiles
// and each instruction does twice the work of tile_rows'. int16 activations (Q = int16_t):
// shifts and masks of each load give [8 outputs][2 inputs] words, vpdpwssd (or vpmaddwd)
// against pairs of activations; int8 ones (TOKENMILL_Q8_PAIR_INT8): masks give [8 outputs][4
// inputs] unsigned bytes, vpdpbusd against four signed activations, four products a lane
// (ggml's Q4_1 x Q8_1). Per output the integer sums and the float steps are tile_rows' own,
// in the same order: the same bits. w0, w1 / sz0, sz1: the two tiles' weights and scales;
// y [R][32]: tile t's 16 outputs, then tile t + 1's.
template <int R, typename Q>
inline void tile_pair_rows(const uint8_t* w0, const uint8_t* w1, const uint16_t* sz0,
                           const uint16_t* sz1, const Q* xq, const float* xd,
                           const float* xg, int64_t K, int64_t group, float* y) {
  const int64_t nb = K / kBlock, bpg = group / kBlock, groups = K / group;
  const int64_t prefetch = kQ8PrefetchTiles * K * kTileBytesPerInput;
  constexpr int64_t kBlockBytes = kBlock * kTileBytesPerInput;
  const __m512i low4w = _mm512_set1_epi16(0x000F);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R][2];
  for (auto& row : acc) for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 fd[R][2];
    for (auto& row : fd) for (auto& v : row) v = _mm512_setzero_ps();
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      const uint8_t* wb0 = w0 + b * kBlockBytes;
      const uint8_t* wb1 = w1 + b * kBlockBytes;
      for (int64_t line = 0; line < kBlockBytes; line += 64) {
        prefetch_weight(reinterpret_cast<const char*>(wb0 + prefetch + line));
        prefetch_weight(reinterpret_cast<const char*>(wb1 + prefetch + line));
      }
      const Q* xb = xq + b * kBlock;
      __m512i ia[R][2];
      for (auto& row : ia) for (auto& v : row) v = _mm512_setzero_si512();
      for (int s = 0; s < kBlock / 4; ++s) {
        const __m512i v = _mm512_inserti64x4(
            _mm512_castsi256_si512(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb0 + 32 * s))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb1 + 32 * s)), 1);
        if constexpr (sizeof(Q) == 1) {
#ifdef TOKENMILL_Q8_PAIR_INT8
          const __m512i lo = _mm512_and_si512(v, low4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          for (int r = 0; r < R; ++r) {
            int32_t four;
            std::memcpy(&four, xb + r * K + 4 * s, sizeof(four));
            const __m512i xv = _mm512_set1_epi32(four);
            ia[r][0] = _mm512_dpbusd_epi32(ia[r][0], lo, xv);
            ia[r][1] = _mm512_dpbusd_epi32(ia[r][1], hi, xv);
          }
#endif
        } else {
          const __m512i q02_lo = _mm512_and_si512(v, low4w);
          const __m512i q02_hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4w);
          const __m512i q13_lo = _mm512_and_si512(_mm512_srli_epi16(v, 8), low4w);
          const __m512i q13_hi = _mm512_srli_epi16(v, 12);
          for (int r = 0; r < R; ++r) {
            int32_t x02, x13;
            std::memcpy(&x02, xb + r * K + 4 * s, sizeof(x02));
            std::memcpy(&x13, xb + r * K + 4 * s + 2, sizeof(x13));
            const __m512i a = _mm512_set1_epi32(x02), c = _mm512_set1_epi32(x13);
#ifdef __AVX512VNNI__
            if constexpr (R >= kVnniMinRows) {
              ia[r][0] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(ia[r][0], q02_lo, a), q13_lo, c);
              ia[r][1] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(ia[r][1], q02_hi, a), q13_hi, c);
              continue;
            }
#endif
            ia[r][0] = _mm512_add_epi32(ia[r][0], _mm512_add_epi32(_mm512_madd_epi16(q02_lo, a),
                                                                   _mm512_madd_epi16(q13_lo, c)));
            ia[r][1] = _mm512_add_epi32(ia[r][1], _mm512_add_epi32(_mm512_madd_epi16(q02_hi, a),
                                                                   _mm512_madd_epi16(q13_hi, c)));
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 d = _mm512_set1_ps(xd[r * nb + b]);
        for (int h = 0; h < 2; ++h) {
          fd[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r][h]), d, fd[r][h]);
        }
      }
    }
    // Lanes 0-7 from tile t's scales, 8-15 from tile t + 1's; bf16 -> fp32 is a shift.
    const uint16_t* s0 = sz0 + g * 2 * kTileN;
    const uint16_t* s1 = sz1 + g * 2 * kTileN;
    prefetch_weight(s0 + kQ8PrefetchTiles * groups * 2 * kTileN);  // one line: 2 x 16 bf16
    prefetch_weight(s1 + kQ8PrefetchTiles * groups * 2 * kTileN);
    auto widen = [](const uint16_t* lo, const uint16_t* hi) {
      const __m256i both = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(both), 16));
    };
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = widen(s0 + 8 * h, s1 + 8 * h);
      const __m512 zero = widen(s0 + kTileN + 8 * h, s1 + kTileN + 8 * h);
      const __m512 z8 = _mm512_fmadd_ps(_mm512_set1_ps(-8.f), scale, zero);
      for (int r = 0; r < R; ++r) {
        acc[r][h] = _mm512_fmadd_ps(
            scale, fd[r][h], _mm512_fmadd_ps(z8, _mm512_set1_ps(xg[r * groups + g]), acc[r][h]));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * 2 * kTileN;
    _mm256_storeu_ps(yr, _mm512_castps512_ps256(acc[r][0]));
    _mm256_storeu_ps(yr + 8, _mm512_castps512_ps256(acc[r][1]));
    _mm256_storeu_ps(yr + 16, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][0]), 1)));
    _mm256_storeu_ps(yr + 24, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][1]), 1)));
  }
}
#endif

// Rows per pass over a tile: the tile's unpacked nibbles serve this many rows at once. (The
// int8 tile pairs were slower with 6 or 8: their accumulators no longer fit the registers.)
constexpr int64_t kRowsPerPass = 4;

template <typename Q>
inline void int4_tiles(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       int64_t group_size, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), N = tiles * kTileN;
  const int64_t groups = K / group_size, nb = K / kBlock;
  const bool out_bf16 = y.scalar_type() == at::kBFloat16;
  // The calling thread's buffers, kept between calls (a decode step makes ~120 of them). A
  // reference, so that the workers' chunks below read the caller's rows: a thread_local named
  // inside the lambda would be each worker's own.
  QuantizedRows<Q>& xq = thread_rows<Q>();
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows_into<Q>(x.data_ptr<c10::BFloat16>(), M, K, group_size, xq);
  } else {
    quantize_rows_into<Q>(x.data_ptr<float>(), M, K, group_size, xq);
  }
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  c10::BFloat16* y_bf16 = out_bf16 ? y.data_ptr<c10::BFloat16>() : nullptr;
  float* y_f32 = out_bf16 ? nullptr : y.data_ptr<float>();
  // Work items: single tiles, or pairs of tiles where tile_pair_rows applies (a last odd
  // tile alone).
#if defined(TOKENMILL_Q8_PAIR_INT8)
  constexpr int64_t kUnit = 2;
#elif defined(TOKENMILL_Q8_AVX512)
  constexpr int64_t kUnit = sizeof(Q) == 2 ? 2 : 1;
#else
  constexpr int64_t kUnit = 1;
#endif
  const int64_t tile_bytes = K * kTileBytesPerInput;
  tmpool::parallel_for(0, (tiles + kUnit - 1) / kUnit, 1, [&](int64_t u0, int64_t u1) {
    // The tile loops fetch kQ8PrefetchTiles ahead of the tile they read: a chunk's first tiles
    // and their scales are fetched here, at once (a batch-1 step after a 500-token prompt
    // -0.6% to -1.0%).
    const int64_t ahead = std::min(kQ8PrefetchTiles, tiles - u0 * kUnit);
    const uint8_t* first = wp + u0 * kUnit * tile_bytes;
    for (int64_t off = 0; off < ahead * tile_bytes; off += 64) prefetch_weight(first + off);
    const char* first_scales =
        reinterpret_cast<const char*>(sp + u0 * kUnit * groups * 2 * kTileN);
    for (int64_t off = 0; off < ahead * groups * 2 * kTileN * 2; off += 64) {
      prefetch_weight(first_scales + off);
    }
    float out[kRowsPerPass * 2 * kTileN];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t t = u * kUnit, width = std::min(kUnit, tiles - t);
      const uint8_t* wt = wp + t * tile_bytes;
      const uint16_t* st = sp + t * groups * 2 * kTileN;
      for (int64_t m = 0; m < M; m += kRowsPerPass) {
        const int64_t r = std::min(kRowsPerPass, M - m);
        const Q* q = xq.q.data() + m * K;
        const float* d = xq.d.data() + m * nb;
        const float* gs = xq.gsum.data() + m * groups;
#ifdef TOKENMILL_Q8_AVX512
        if (width == 2) {  // kUnit is 2 only where tile_pair_rows takes Q
          const uint8_t* wt1 = wt + K * kTileBytesPerInput;
          const uint16_t* st1 = st + groups * 2 * kTileN;
          switch (r) {
            case 4: tile_pair_rows<4, Q>(wt, wt1, st, st1, q, d, gs, K, group_size, out); break;
            case 3: tile_pair_rows<3, Q>(wt, wt1, st, st1, q, d, gs, K, group_size, out); break;
            case 2: tile_pair_rows<2, Q>(wt, wt1, st, st1, q, d, gs, K, group_size, out); break;
            default: tile_pair_rows<1, Q>(wt, wt1, st, st1, q, d, gs, K, group_size, out); break;
          }
        }
#endif
        if (width == 1) {
          switch (r) {
            case 4: tile_rows<4, Q>(wt, st, q, d, gs, K, group_size, out); break;
            case 3: tile_rows<3, Q>(wt, st, q, d, gs, K, group_size, out); break;
            case 2: tile_rows<2, Q>(wt, st, q, d, gs, K, group_size, out); break;
            default: tile_rows<1, Q>(wt, st, q, d, gs, K, group_size, out); break;
          }
        }
        const int64_t cols = width * kTileN;
        for (int64_t i = 0; i < r; ++i) {
          const float* src = out + i * cols;
          if (out_bf16) {
            c10::BFloat16* dst = y_bf16 + (m + i) * N + t * kTileN;
            for (int64_t j = 0; j < cols; ++j) dst[j] = from_f<c10::BFloat16>(src[j]);
          } else {
            std::memcpy(y_f32 + (m + i) * N + t * kTileN, src, cols * sizeof(float));
          }
        }
      }
    }
  });
}

// y = x W^T for W in q8 tiles (see the top of this file); x fp32 or bf16 [M, K], y likewise;
// the activations quantized to `act_bits` (8 or 16) per block of 32.
inline at::Tensor int4_q8_linear(const at::Tensor& x_in, const at::Tensor& packed,
                                 const at::Tensor& scales, int64_t group_size,
                                 int64_t act_bits, const at::Tensor* out = nullptr) {
  RECORD_FUNCTION("tokenmill::int4_q8_linear", std::vector<c10::IValue>());
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(),
              "int4_q8_linear: x must be [M, K] on CPU");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(act_bits == 8 || act_bits == 16,
              "int4_q8_linear: activations are 8 or 16 bits, not ", act_bits);
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0 && K % group_size == 0,
              "int4_q8_linear: group size ", group_size, " must be a multiple of ", kBlock,
              " dividing the ", K, " inputs");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(1) == K / 4 && packed.size(2) == 32,
              "int4_q8_linear: packed weight must be contiguous uint8 [N / 16, K / 4, 32]");
  const int64_t tiles = packed.size(0), N = tiles * kTileN, groups = K / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
                  scales.numel() == tiles * groups * 2 * kTileN,
              "int4_q8_linear: scales must be contiguous bf16 [N / 16, groups, 2, 16]");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat,
              "int4_q8_linear: x must be fp32 or bf16");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = (out != nullptr && out->defined()) ? *out : at::empty({M, N}, x_in.options());
  TORCH_CHECK(y.sizes() == at::IntArrayRef({M, N}) && y.scalar_type() == x_in.scalar_type() &&
                  y.is_contiguous(),
              "int4_q8_linear: out must be contiguous [M, N] in x's dtype");
  if (M == 0) return y;
  if (act_bits == 8) {
    int4_tiles<int8_t>(x, packed, scales, group_size, y);
  } else {
    int4_tiles<int16_t>(x, packed, scales, group_size, y);
  }
  return y;
}

// ---- int8 x int16 ----------------------------------------------------------------------
// x quantized per row to int16 (scale absmax / 32767: relative steps of 3e-5, finer than the
// bf16 the other int kernels round to); w int8 [N, K] with a scale per output. One vpmaddwd
// multiplies 16 weights (sign-extended to 16 bits) by 16 activations into 8 32-bit pair sums.
// A lane gains at most 2 * 128 * 32767 per 16 inputs, so lanes are flushed to int64 every
// kQ16Flush inputs; the integer dot is exact, then y = dot * (x scale * w scale) rounded once.

constexpr int64_t kQ16Flush = 2048;  // 128 steps of 16: < 2^31 per lane
constexpr int64_t kQ16PrefetchRows = 16;  // how far ahead, in weight rows

struct Int16Rows {
  std::vector<int16_t> q;  // [M][Kp], K padded with zeros to a multiple of 16
  std::vector<double> d;   // [M]
  int64_t Kp = 0;
};

template <typename X>
inline Int16Rows quantize_rows_int16(const X* x, int64_t M, int64_t K) {
  Int16Rows out;
  out.Kp = (K + 15) / 16 * 16;
  out.q.assign(M * out.Kp, 0);
  out.d.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    const X* xr = x + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(to_f(xr[k])));
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    int16_t* qr = out.q.data() + m * out.Kp;
    for (int64_t k = 0; k < K; ++k) {
      qr[k] = static_cast<int16_t>(std::nearbyint(to_f(xr[k]) * inv));
    }
    out.d[m] = static_cast<double>(amax) / 32767.0;
  }
  return out;
}

// dots[r][c] = x row r . w row c for R rows and C weight rows (exact, int64).
template <int R, int C>
inline void int8_q16_dots(const int16_t* xq, int64_t Kp, const int8_t* w, int64_t K,
                          int64_t ldw, int64_t (*dots)[C]) {
  for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) dots[r][c] = 0;
  const int64_t K16 = K - K % 16;
#ifdef TOKENMILL_Q8_AVX2
  for (int64_t k0 = 0; k0 < K16; k0 += kQ16Flush) {
    const int64_t k1 = std::min(K16, k0 + kQ16Flush);
    int64_t k = k0;
#ifdef TOKENMILL_Q8_AVX512
    // 32 inputs a step on 512-bit registers (a lane gains at most 64 pairs per flush: inside
    // int32); the same exact integer dots as the 16-input steps below.
    {
      __m512i acc[R][C];
      for (auto& row : acc) for (auto& v : row) v = _mm512_setzero_si512();
      for (; k + 32 <= k1; k += 32) {
        const char* ahead = reinterpret_cast<const char*>(w + kQ16PrefetchRows * ldw + k * C);
        prefetch_weight(ahead);
        prefetch_weight(ahead + 64);
        __m512i wv[C];
        for (int c = 0; c < C; ++c) {
          wv[c] = _mm512_cvtepi8_epi16(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * ldw + k)));
        }
        for (int r = 0; r < R; ++r) {
          const __m512i xv = _mm512_loadu_si512(xq + r * Kp + k);
          for (int c = 0; c < C; ++c) {
#ifdef __AVX512VNNI__
            acc[r][c] = _mm512_dpwssd_epi32(acc[r][c], wv[c], xv);
#else
            acc[r][c] = _mm512_add_epi32(acc[r][c], _mm512_madd_epi16(wv[c], xv));
#endif
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {  // the 16 lanes summed in int64 (their sum may not fit)
          const __m512i wide = _mm512_add_epi64(
              _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[r][c])),
              _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[r][c], 1)));
          dots[r][c] += _mm512_reduce_add_epi64(wide);
        }
      }
    }
#endif
    __m256i acc[R][C];
    for (auto& row : acc) for (auto& v : row) v = _mm256_setzero_si256();
    for (; k < k1; k += 16) {
      // The weight rows are read once, C at a time: fetch ahead of the hardware prefetcher,
      // which does not keep up with C interleaved streams (~4 GB/s a core without this).
      prefetch_weight(reinterpret_cast<const char*>(w + kQ16PrefetchRows * ldw + k * C));
      __m256i wv[C];
      for (int c = 0; c < C; ++c) {
        wv[c] = _mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * ldw + k)));
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * Kp + k));
        for (int c = 0; c < C; ++c) {
          acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(wv[c], xv));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) {
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[r][c]);
        for (int32_t l : lanes) dots[r][c] += l;
      }
    }
  }
#else
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      for (int64_t k = 0; k < K16; ++k) {
        dots[r][c] += static_cast<int64_t>(w[c * ldw + k]) * xq[r * Kp + k];
      }
    }
  }
#endif
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      for (int64_t k = K16; k < K; ++k) {
        dots[r][c] += static_cast<int64_t>(w[c * ldw + k]) * xq[r * Kp + k];
      }
    }
  }
}

// The activations and scales of an int8 x int16 call (`name`: the entry point, for the
// messages) for N outputs.
inline void check_q16_call(const char* name, const at::Tensor& x, const at::Tensor& scales,
                           int64_t N) {
  TORCH_CHECK(scales.numel() == N, name, ": ", scales.numel(), " scales for ", N, " outputs");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, name,
              ": x must be fp32 or bf16");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 || scales.scalar_type() == at::kFloat, name,
              ": scales must be fp32 or bf16");
}

// Writes output (m, n) of an int8 x int16 call from its exact integer dot: dot * x scale * w
// scale in double, rounded once to y's dtype (fp32 or bf16), as every such kernel does.
struct Q16Output {
  Q16Output(at::Tensor& y, const at::Tensor& scales, const std::vector<double>& row_scales)
      : out_bf16(y.scalar_type() == at::kBFloat16),
        bf16_scales(scales.scalar_type() == at::kBFloat16), scales_raw(scales.data_ptr()),
        y_raw(y.data_ptr()), xd(row_scales.data()), N(y.size(1)) {}

  void store(int64_t m, int64_t n, int64_t dot) const {
    const double scale =
        bf16_scales ? static_cast<double>(static_cast<const c10::BFloat16*>(scales_raw)[n])
                    : static_cast<double>(static_cast<const float*>(scales_raw)[n]);
    const float v = static_cast<float>(static_cast<double>(dot) * xd[m] * scale);
    if (out_bf16) {
      static_cast<c10::BFloat16*>(y_raw)[m * N + n] = from_f<c10::BFloat16>(v);
    } else {
      static_cast<float*>(y_raw)[m * N + n] = v;
    }
  }

  // Outputs n0 .. n0 + cols - 1 (at most kMaxRowCols) of row m from their dots: store()'s
  // arithmetic eight lanes at a time (int64 -> double is exact below 2^53, the two products
  // and the rounding to fp32 are the scalar code's, in its order): the same bits. A batch-32
  // output head stores 1.6 M of them a step.
  static constexpr int64_t kMaxRowCols = 32;
  void store_row(int64_t m, int64_t n0, int64_t cols, const int64_t* dots) const {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    float v[kMaxRowCols];
    const __m512d xdv = _mm512_set1_pd(xd[m]);
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
      __m512d scale;
      if (bf16_scales) {
        const __m128i raw = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(static_cast<const c10::BFloat16*>(scales_raw) + n0 + c));
        scale = _mm512_cvtps_pd(
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
      } else {
        scale = _mm512_cvtps_pd(_mm256_loadu_ps(static_cast<const float*>(scales_raw) + n0 + c));
      }
      const __m512d dot = _mm512_cvtepi64_pd(_mm512_loadu_si512(dots + c));
      _mm256_storeu_ps(v + c, _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_mul_pd(dot, xdv), scale)));
    }
    if (out_bf16) {
      c10::BFloat16* dst = static_cast<c10::BFloat16*>(y_raw) + m * N + n0;
      for (int64_t j = 0; j < c; ++j) dst[j] = from_f<c10::BFloat16>(v[j]);
    } else {
      std::memcpy(static_cast<float*>(y_raw) + m * N + n0, v, c * sizeof(float));
    }
    for (; c < cols; ++c) store(m, n0 + c, dots[c]);  // the last cols % 8
#else
    for (int64_t c = 0; c < cols; ++c) store(m, n0 + c, dots[c]);
#endif
  }

  bool out_bf16, bf16_scales;
  const void* scales_raw;
  void* y_raw;
  const double* xd;
  int64_t N;
};

// y = x (w * scales[:, None])^T for int8 w [N, K], x fp32 or bf16 [M, K]; y in x's dtype.
inline at::Tensor int8_q16_linear(const at::Tensor& x_in, const at::Tensor& weight,
                                  const at::Tensor& scales_in) {
  RECORD_FUNCTION("tokenmill::int8_q16_linear", std::vector<c10::IValue>());
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(),
              "int8_q16_linear: x must be [M, K] on CPU");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "int8_q16_linear: weight must be contiguous int8 [N, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "int8_q16_linear: weight has ", weight.size(1),
              " inputs, x has ", K);
  check_q16_call("int8_q16_linear", x_in, scales_in, N);
  const bool out_bf16 = x_in.scalar_type() == at::kBFloat16;
  // Read in place, no widened copies: a decode step's calls are small enough for an extra
  // ATen op to show.
  const at::Tensor x = x_in.contiguous();
  const at::Tensor scales = scales_in.contiguous();
  at::Tensor y = at::empty({M, N}, x_in.options());
  if (M > 0) {
    const Int16Rows xq = out_bf16 ? quantize_rows_int16(x.data_ptr<c10::BFloat16>(), M, K)
                                  : quantize_rows_int16(x.data_ptr<float>(), M, K);
    const int8_t* wp = weight.data_ptr<int8_t>();
    const Q16Output output(y, scales, xq.d);
    constexpr int64_t kCols = 4;  // weight rows per pass
    // Activation rows per pass: with 32 registers (AVX-512) four rows' accumulators fit.
#ifdef TOKENMILL_Q8_AVX512
    constexpr int64_t kRows = 4;
#else
    constexpr int64_t kRows = 2;
#endif
    tmpool::parallel_for(0, (N + kCols - 1) / kCols, 16, [&](int64_t c0, int64_t c1) {
      for (int64_t n = c0 * kCols; n < std::min(N, c1 * kCols); n += kCols) {
        const int64_t cols = std::min(kCols, N - n);
        for (int64_t m = 0; m < M;) {
          const int64_t rows = std::min<int64_t>(kRows, M - m);
          int64_t dots[kRows][kCols];
          const int16_t* xr = xq.q.data() + m * xq.Kp;
          const int8_t* wr = wp + n * K;
          if (cols == kCols) {
            switch (rows) {
#ifdef TOKENMILL_Q8_AVX512
              case 4: int8_q16_dots<4, kCols>(xr, xq.Kp, wr, K, K, dots); break;
              case 3: int8_q16_dots<3, kCols>(xr, xq.Kp, wr, K, K, dots); break;
#endif
              case 2: int8_q16_dots<2, kCols>(xr, xq.Kp, wr, K, K, dots); break;
              default: int8_q16_dots<1, kCols>(xr, xq.Kp, wr, K, K, dots); break;
            }
          } else {
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t c = 0; c < cols; ++c) {
                int64_t one[1][1];
                int8_q16_dots<1, 1>(xr + r * xq.Kp, xq.Kp, wr + c * K, K, K, one);
                dots[r][c] = one[0][0];
              }
            }
          }
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t c = 0; c < cols; ++c) output.store(m + r, n + c, dots[r][c]);
          }
          m += rows;
        }
      }
    });
  }
  return y;
}

// ---- int8 x int16, output tiles -----------------------------------------------------------
// The same products as int8_q16_linear (exact integer dots, then dot * x scale * w scale
// rounded once: the same bits), on the weight repacked so that outputs run along the register
// lanes: tile t (outputs 16 t .. 16 t + 15), input pair p is 32 bytes, byte 2 j + i holding
// input 2 p + i of output 16 t + j (pack_int8_q16_tiles). One load, widened to 16-bit words,
// is [16 outputs][2 inputs]; vpdpwssd against a row's pair of activations broadcast adds both
// products into each output's lane. Rows share each widened load and no lane sums are left to
// reduce across the register: several times the work per instruction of int8_q16_dots when a
// call has many rows (an output head in a batch of sequences).
// A lane gains at most 2 * 128 * 32767 per pair: 256 pairs stay inside int32, then the lanes
// are added into int64 totals.

constexpr int64_t kQ16TileN = 16;   // outputs per tile
constexpr int64_t kQ16TilesPerUnit = 2;  // tiles a work item computes together
static_assert(kQ16TileN * kQ16TilesPerUnit <= Q16Output::kMaxRowCols);
constexpr int64_t kQ16TileRows = 8;  // activation rows per pass over a unit
constexpr int64_t kQ16TilePairsPerFlush = 256;
// Rows whose dots a unit keeps at once, and input pairs per slab (32 rows x 128 pairs of
// activations, 16 KB, and the unit's 8 KB of them: inside L1 together).
constexpr int64_t kQ16BlockRows = 32;
constexpr int64_t kQ16SlabPairs = 128;
constexpr int64_t kQ16PrefetchBytes = 4096;  // how far ahead a unit's weights are fetched

// Padded sizes of the tiled layout: outputs to whole units, inputs to whole pairs.
inline int64_t q16_tiles_padded_n(int64_t n) {
  const int64_t unit = kQ16TileN * kQ16TilesPerUnit;
  return (n + unit - 1) / unit * unit;
}

// dots[r][j] += the products of input pairs [pair_begin, pair_end) for R rows and the unit's
// 32 outputs (two tiles), exact in int64. w: the unit's weights, 64 bytes a pair (tile 0's 32,
// then tile 1's). xq: row 0's int16 activations, rows Kp apart, zero past K.
template <int R>
inline void q16_unit_dots(const int16_t* xq, int64_t Kp, const int8_t* w, int64_t pair_begin,
                          int64_t pair_end, int64_t (*dots)[kQ16TilesPerUnit * kQ16TileN]) {
#if defined(TOKENMILL_Q8_AVX512) && defined(__AVX512VNNI__)
  constexpr int64_t kUnitBytesPerPair = kQ16TilesPerUnit * 2 * kQ16TileN;
  // With few rows, U accumulators per output take turns over the pairs: independent chains
  // of vpdpwssd, or one row's call would wait on each one's latency.
  constexpr int U = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  for (int64_t p0 = pair_begin; p0 < pair_end; p0 += kQ16TilePairsPerFlush) {
    const int64_t p1 = std::min(pair_end, p0 + kQ16TilePairsPerFlush);
    __m512i acc[U][R][kQ16TilesPerUnit];
    for (auto& turn : acc) for (auto& row : turn) for (auto& v : row) v = _mm512_setzero_si512();
    int64_t p = p0;
    auto step = [&](int u, int64_t q) {
      prefetch_weight(reinterpret_cast<const char*>(w + q * kUnitBytesPerPair + kQ16PrefetchBytes));
      __m512i wv[kQ16TilesPerUnit];
      for (int64_t t = 0; t < kQ16TilesPerUnit; ++t) {
        const int8_t* src = w + (q * kQ16TilesPerUnit + t) * 2 * kQ16TileN;
        wv[t] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
      }
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, xq + r * Kp + 2 * q, sizeof(pair));
        const __m512i xv = _mm512_set1_epi32(pair);
        for (int64_t t = 0; t < kQ16TilesPerUnit; ++t) {
          acc[u][r][t] = _mm512_dpwssd_epi32(acc[u][r][t], wv[t], xv);
        }
      }
    };
    for (; p + U <= p1; p += U) {
      for (int u = 0; u < U; ++u) step(u, p + u);
    }
    for (; p < p1; ++p) step(0, p);
    for (int r = 0; r < R; ++r) {
      for (int64_t t = 0; t < kQ16TilesPerUnit; ++t) {
        int64_t* d = dots[r] + t * kQ16TileN;
        for (int u = 0; u < U; ++u) {  // each turn's lanes inside int32: widened, then added
          const __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[u][r][t]));
          const __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[u][r][t], 1));
          _mm512_storeu_si512(d, _mm512_add_epi64(_mm512_loadu_si512(d), lo));
          _mm512_storeu_si512(d + 8, _mm512_add_epi64(_mm512_loadu_si512(d + 8), hi));
        }
      }
    }
  }
#else
  for (int r = 0; r < R; ++r) {
    for (int64_t t = 0; t < kQ16TilesPerUnit; ++t) {
      for (int64_t p = pair_begin; p < pair_end; ++p) {
        const int8_t* src = w + (p * kQ16TilesPerUnit + t) * 2 * kQ16TileN;
        for (int64_t j = 0; j < kQ16TileN; ++j) {
          dots[r][t * kQ16TileN + j] +=
              static_cast<int64_t>(src[2 * j]) * xq[r * Kp + 2 * p] +
              static_cast<int64_t>(src[2 * j + 1]) * xq[r * Kp + 2 * p + 1];
        }
      }
    }
  }
#endif
}

#if defined(TOKENMILL_Q8_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TOKENMILL_Q16_AMX 1
// ---- int8 x int16, output tiles, on AMX (Sapphire Rapids and later) ----------------------
//
// From kQ16AmxMinRows rows, int8_q16_tiles_linear's products run on the AMX tile unit: each
// int16 activation is split as a = 256 hi + lo (hi signed, lo unsigned bytes), and the tile
// products tdpbssd (hi x w) and tdpbusd (lo x w) add 64 inputs of 16 rows x 16 outputs each
// into int32 sums, which stay exact over any K below 65,536 (|hi w| <= 128 x 128, lo w <=
// 255 x 128 an input). dot = 256 sum(hi) + sum(lo) is then the vector path's exact int64 dot,
// and the output is stored by the same code: the same bits at every batch size, only faster.
// Tiles: 0-3 the sums (hi, lo for the unit's two tiles of 16 outputs), 4-5 the activations'
// hi and lo bytes (rows of 64 inputs), 6-7 the two weight tiles in AMX's layout (16 rows of 4
// inputs x 16 outputs), rebuilt from the unit's pairs once per unit.
constexpr int64_t kQ16AmxMinRows = 12;
constexpr int64_t kAmxRows = 16;     // rows a tile holds
constexpr int64_t kAmxInputs = 64;   // inputs a tile product adds
constexpr int64_t kAmxMaxInputs = 65536;  // the int32 sums' bound (above)

// Whether the AMX path may run: Linux grants a process the tile state on request
// (arch_prctl), asked once; tokenmill.kernels.cpu's set_amx turns it off (A/B runs, tests).
inline bool g_use_amx = true;
inline bool amx_granted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct AmxTileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void q16_amx_configure(int rows) {
  AmxTileConfig c;
  for (int t = 0; t < 6; ++t) {  // sums and activations: `rows` rows of 64 bytes
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = 64;
  }
  for (int t = 6; t < 8; ++t) {  // weights: 16 rows of 4 inputs x 16 outputs
    c.rows[t] = kAmxInputs / 4;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// xq's rows [M][Kp] -> hi and lo bytes [M][K64] (K64 >= Kp, zeros past Kp).
inline void q16_split_rows(const Int16Rows& xq, int64_t M, int64_t K64, int8_t* hi,
                           uint8_t* lo) {
  for (int64_t m = 0; m < M; ++m) {
    const int16_t* q = xq.q.data() + m * xq.Kp;
    int8_t* h = hi + m * K64;
    uint8_t* l = lo + m * K64;
    for (int64_t k = 0; k < xq.Kp; k += 16) {  // Kp is a multiple of 16
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(l + k), _mm256_cvtepi16_epi8(v));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(h + k),
                       _mm256_cvtepi16_epi8(_mm256_srai_epi16(v, 8)));
    }
    std::memset(h + xq.Kp, 0, K64 - xq.Kp);
    std::memset(l + xq.Kp, 0, K64 - xq.Kp);
  }
}

// A unit's weights (pairs of inputs, tile 0's 16 words then tile 1's) as two AMX tiles' rows:
// row s of tile t holds, per output j, inputs 4 s .. 4 s + 3, i.e. output j's words of pairs
// 2 s and 2 s + 1 side by side. out: [2][K64 / 4][64] bytes, zeros past the last pair.
inline void q16_unit_for_amx(const int8_t* wu, int64_t pairs, int64_t K64, int8_t* out) {
  static constexpr int16_t kIdx[2][32] = {
      {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
  const __m512i idx0 = _mm512_loadu_si512(kIdx[0]), idx1 = _mm512_loadu_si512(kIdx[1]);
  const int64_t quads = K64 / 4;
  for (int64_t s = 0; s < quads; ++s) {
    const int64_t p = 2 * s;
    const __m512i a = p < pairs ? _mm512_loadu_si512(wu + p * 64) : _mm512_setzero_si512();
    const __m512i b = p + 1 < pairs ? _mm512_loadu_si512(wu + (p + 1) * 64)
                                    : _mm512_setzero_si512();
    _mm512_storeu_si512(out + s * 64, _mm512_permutex2var_epi16(a, idx0, b));
    _mm512_storeu_si512(out + (quads + s) * 64, _mm512_permutex2var_epi16(a, idx1, b));
  }
}

// int8_q16_tiles_linear's body on the AMX tiles (see above), for M >= kQ16AmxMinRows rows.
inline void q16_tiles_amx(const Int16Rows& xq, int64_t M, int64_t K, const int8_t* wp,
                          int64_t units, int64_t unit_bytes, int64_t N,
                          const Q16Output& output) {
  constexpr int64_t kUnitN = kQ16TilesPerUnit * kQ16TileN;
  static_assert(kUnitN == 32, "the AMX path computes a unit as two tiles of 16 outputs");
  const int64_t pairs = (K + 1) / 2, K64 = (K + kAmxInputs - 1) / kAmxInputs * kAmxInputs;
  // The calling thread's split rows, read by the workers through these references.
  static thread_local std::vector<int8_t> hi_rows, lo_bytes;
  std::vector<int8_t>& hi = hi_rows;
  std::vector<int8_t>& lo = lo_bytes;
  hi.resize(M * K64);
  lo.resize(M * K64);
  q16_split_rows(xq, M, K64, hi.data(), reinterpret_cast<uint8_t*>(lo.data()));
  tmpool::parallel_for(0, units, 8, [&](int64_t u0, int64_t u1) {
    static thread_local std::vector<int8_t> weights;
    weights.resize(2 * K64 * 16);
    const int8_t* w0 = weights.data();
    const int8_t* w1 = weights.data() + K64 * 16;
    alignas(64) int32_t sums[4][kAmxRows][16];
    int64_t dots[kAmxRows][kUnitN];
    int configured = 0;
    for (int64_t u = u0; u < u1; ++u) {
      q16_unit_for_amx(wp + u * unit_bytes, pairs, K64, weights.data());
      const int64_t n0 = u * kUnitN, cols = std::min(kUnitN, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
        const int rows = static_cast<int>(std::min(kAmxRows, M - m0));
        if (rows != configured) {
          q16_amx_configure(rows);
          configured = rows;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const int8_t* h = hi.data() + m0 * K64;
        const int8_t* l = lo.data() + m0 * K64;
        for (int64_t k = 0; k < K64; k += kAmxInputs) {
          _tile_loadd(4, h + k, K64);
          _tile_loadd(5, l + k, K64);
          _tile_loadd(6, w0 + k * 16, 64);
          _tile_loadd(7, w1 + k * 16, 64);
          _tile_dpbssd(0, 4, 6);
          _tile_dpbusd(1, 5, 6);
          _tile_dpbssd(2, 4, 7);
          _tile_dpbusd(3, 5, 7);
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
        for (int r = 0; r < rows; ++r) {
          for (int t = 0; t < 2; ++t) {
            for (int half = 0; half < 2; ++half) {
              const __m512i hs = _mm512_cvtepi32_epi64(
                  _mm256_load_si256(reinterpret_cast<const __m256i*>(sums[2 * t][r] + 8 * half)));
              const __m512i ls = _mm512_cvtepi32_epi64(_mm256_load_si256(
                  reinterpret_cast<const __m256i*>(sums[2 * t + 1][r] + 8 * half)));
              _mm512_storeu_si512(dots[r] + 16 * t + 8 * half,
                                  _mm512_add_epi64(_mm512_slli_epi64(hs, 8), ls));
            }
          }
          output.store_row(m0 + r, n0, cols, dots[r]);
        }
      }
    }
    if (configured) _tile_release();
  });
}
#endif

// y = x (w * scales[:, None])^T as int8_q16_linear, for w in output tiles: tiles int8
// [Np / 16, K2, 32] (Np the outputs padded by q16_tiles_padded_n, K2 = ceil(K / 2) input
// pairs), `out_features` of its outputs real; x fp32 or bf16 [M, K], y likewise [M, N].
inline at::Tensor int8_q16_tiles_linear(const at::Tensor& x_in, const at::Tensor& tiles,
                                        const at::Tensor& scales_in, int64_t out_features) {
  RECORD_FUNCTION("tokenmill::int8_q16_tiles_linear", std::vector<c10::IValue>());
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(),
              "int8_q16_tiles_linear: x must be [M, K] on CPU");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = out_features, pairs = (K + 1) / 2;
  TORCH_CHECK(N > 0, "int8_q16_tiles_linear: out_features must be > 0, got ", N);
  TORCH_CHECK(tiles.scalar_type() == at::kChar && tiles.is_contiguous() && tiles.dim() == 3 &&
                  tiles.size(0) * kQ16TilesPerUnit * kQ16TileN == q16_tiles_padded_n(N) &&
                  tiles.size(1) == pairs && tiles.size(2) == kQ16TilesPerUnit * 2 * kQ16TileN,
              "int8_q16_tiles_linear: tiles must be contiguous int8 [",
              q16_tiles_padded_n(N) / (kQ16TilesPerUnit * kQ16TileN), ", ", pairs, ", ",
              kQ16TilesPerUnit * 2 * kQ16TileN, "] for ", N, " outputs of ", K, " inputs");
  check_q16_call("int8_q16_tiles_linear", x_in, scales_in, N);
  const bool out_bf16 = x_in.scalar_type() == at::kBFloat16;
  const at::Tensor x = x_in.contiguous();
  const at::Tensor scales = scales_in.contiguous();
  at::Tensor y = at::empty({M, N}, x_in.options());
  if (M == 0) return y;
  // Rows padded to an even count of inputs (the last pair's second input 0).
  const Int16Rows xq = out_bf16 ? quantize_rows_int16(x.data_ptr<c10::BFloat16>(), M, K)
                                : quantize_rows_int16(x.data_ptr<float>(), M, K);
  const int8_t* wp = tiles.data_ptr<int8_t>();
  const Q16Output output(y, scales, xq.d);
  constexpr int64_t kUnitN = kQ16TilesPerUnit * kQ16TileN;
  const int64_t units = tiles.size(0);
  const int64_t unit_bytes = kQ16TilesPerUnit * pairs * 2 * kQ16TileN;
#ifdef TOKENMILL_Q16_AMX
  if (g_use_amx && M >= kQ16AmxMinRows && K <= kAmxMaxInputs && amx_granted()) {
    q16_tiles_amx(xq, M, K, wp, units, unit_bytes, N, output);
    return y;
  }
#endif
  tmpool::parallel_for(0, units, 8, [&](int64_t u0, int64_t u1) {
    int64_t dots[kQ16BlockRows][kUnitN];
    for (int64_t u = u0; u < u1; ++u) {
      const int8_t* wu = wp + u * unit_bytes;
      const int64_t n0 = u * kUnitN, cols = std::min(kUnitN, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kQ16BlockRows) {
        const int64_t block = std::min(kQ16BlockRows, M - m0);
        std::memset(dots, 0, sizeof(dots));
        // A slab of inputs at a time for every row of the block: its weights and activations
        // stay in L1 while the passes of kQ16TileRows rows read them.
        for (int64_t p0 = 0; p0 < pairs; p0 += kQ16SlabPairs) {
          const int64_t p1 = std::min(pairs, p0 + kQ16SlabPairs);
          for (int64_t m = 0; m < block; m += kQ16TileRows) {
            const int16_t* xr = xq.q.data() + (m0 + m) * xq.Kp;
            int64_t(*d)[kUnitN] = dots + m;
            switch (std::min(kQ16TileRows, block - m)) {
              case 8: q16_unit_dots<8>(xr, xq.Kp, wu, p0, p1, d); break;
              case 7: q16_unit_dots<7>(xr, xq.Kp, wu, p0, p1, d); break;
              case 6: q16_unit_dots<6>(xr, xq.Kp, wu, p0, p1, d); break;
              case 5: q16_unit_dots<5>(xr, xq.Kp, wu, p0, p1, d); break;
              case 4: q16_unit_dots<4>(xr, xq.Kp, wu, p0, p1, d); break;
              case 3: q16_unit_dots<3>(xr, xq.Kp, wu, p0, p1, d); break;
              case 2: q16_unit_dots<2>(xr, xq.Kp, wu, p0, p1, d); break;
              default: q16_unit_dots<1>(xr, xq.Kp, wu, p0, p1, d); break;
            }
          }
        }
        for (int64_t r = 0; r < block; ++r) output.store_row(m0 + r, n0, cols, dots[r]);
      }
    }
  });
  return y;
}

}  // namespace intdot
}  // namespace tokenmill
