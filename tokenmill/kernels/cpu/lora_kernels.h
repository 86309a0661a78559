// LoRA updates of one projection inside the fused layer stack: y[m] += B_s (A_s x[m]) for each
// row m whose adapter slot s is set. Each row reads its own slot's matrices only, so a step of
// several adapters costs what one of them would, and the work runs on the extension's own
// thread pool: ATen's small matmuls in between the pool's kernels paid for waking OpenMP's
// threads against the pool's spinning ones (a rank-16 adapter on every projection of a
// 135M model measured 106 us per such product inside the stack, 19 us alone).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "decode_kernels.h"

namespace tokenmill::lora {

// Rows are taken in groups of up to kGroup rows of one slot: each matrix row read (and
// widened from bf16) serves them all.
constexpr int64_t kGroup = 4;

// out[r] = sum_k x[r][k] * w[k] in fp32 for r < kGroup (x rows fp32 or bf16; a group of fewer
// rows repeats its last one, whose extra results the caller ignores).
template <typename X, typename W>
inline void dots(const X* const* x, const W* w, int64_t n, float* out) {
  using lanes::F;
  constexpr int64_t L = lanes::kWidth;
  F acc[kGroup] = {};
  int64_t k = 0;
  for (; k + L <= n; k += L) {
    const F wv = lanes::load(w + k);
    for (int64_t r = 0; r < kGroup; ++r) acc[r] += lanes::load(x[r] + k) * wv;
  }
  for (int64_t r = 0; r < kGroup; ++r) {
    float sum = 0.f;
    for (int64_t i = 0; i < L; ++i) sum += acc[r][i];
    for (int64_t t = k; t < n; ++t) sum += to_f(x[r][t]) * to_f(w[t]);
    out[r] = sum;
  }
}

// acc[r][n] += h[r] * w[n] for r < rows, n < count (acc fp32, w fp32 or bf16).
template <typename W>
inline void axpys(float* const* acc, const float* h, int64_t rows, const W* w, int64_t count) {
  using lanes::F;
  constexpr int64_t L = lanes::kWidth;
  int64_t n = 0;
  for (; n + L <= count; n += L) {
    const F wv = lanes::load(w + n);
    for (int64_t r = 0; r < rows; ++r) {
      lanes::store(acc[r] + n, lanes::load(acc[r] + n) + (F{} + h[r]) * wv);
    }
  }
  for (; n < count; ++n) {
    const float wn = to_f(w[n]);
    for (int64_t r = 0; r < rows; ++r) acc[r][n] += h[r] * wn;
  }
}

// x [M, K] (row stride K), a [S, R, K], b [S, R, N], y [M, N] (row stride N); slots [M], -1
// for rows without an adapter. The update is computed in fp32 and added to y in its dtype.
template <typename X, typename W, typename Y>
void add_updates(const X* x, const W* a, const W* b, Y* y, const int32_t* slots, int64_t M,
                 int64_t K, int64_t R, int64_t N) {
  // Groups of up to kGroup consecutive adapted rows of one slot: (first row, row count).
  std::vector<std::pair<int64_t, int64_t>> groups;
  for (int64_t m = 0; m < M; ++m) {
    if (slots[m] < 0) continue;
    if (!groups.empty()) {
      auto& last = groups.back();
      if (last.second < kGroup && last.first + last.second == m && slots[last.first] == slots[m]) {
        ++last.second;
        continue;
      }
    }
    groups.emplace_back(m, 1);
  }
  const int64_t G = static_cast<int64_t>(groups.size());
  if (G == 0) return;
  // h[g][j][r] = A_s[j] . x[row r of group g].
  std::vector<float> h(static_cast<size_t>(G * R * kGroup));
  for_rows(G * R, kGroup * K, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [first, count] = groups[i / R];
      const X* rows[kGroup];
      for (int64_t r = 0; r < kGroup; ++r) rows[r] = x + (first + std::min(r, count - 1)) * K;
      dots(rows, a + (slots[first] * R + i % R) * K, K, h.data() + i * kGroup);
    }
  });
  // y[m] += sum_j h[g][j][r] B_s[j]: rows of B are contiguous over the outputs.
  for_rows(G, kGroup * R * N, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(kGroup * N));
    for (int64_t g = begin; g < end; ++g) {
      const auto [first, count] = groups[g];
      std::fill(acc.begin(), acc.end(), 0.f);
      float* accs[kGroup];
      for (int64_t r = 0; r < kGroup; ++r) accs[r] = acc.data() + r * N;
      const W* bs = b + slots[first] * R * N;
      for (int64_t j = 0; j < R; ++j) {
        const float* hj = h.data() + (g * R + j) * kGroup;
        bool any = false;
        for (int64_t r = 0; r < count; ++r) any = any || hj[r] != 0.f;
        if (any) axpys(accs, hj, count, bs + j * N, N);
      }
      for (int64_t r = 0; r < count; ++r) {
        Y* yr = y + (first + r) * N;
        for (int64_t n = 0; n < N; ++n) yr[n] = from_f<Y>(to_f(yr[n]) + accs[r][n]);
      }
    }
  });
}

}  // namespace tokenmill::lora
