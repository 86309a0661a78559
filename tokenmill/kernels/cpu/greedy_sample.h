// Greedy sampling with the chosen token's logprob in one C++ call: per row of logits, the
// first index of the largest value (torch.argmax's choice; a NaN wins, as there) and
// logit - logsumexp(row) = -log(sum(exp(x - max))). In PyTorch that is argmax plus a
// logsumexp, two passes and two wake-ups of OpenMP's threads over a [B, vocab] tensor; at batch
// 32 of a 49k vocabulary they took ~1.3 ms of a 34 ms decode step on a 2-core Zen 5.
//
// A row is scanned in parts (RowScan), each part twice: its maximum (and whether it holds a
// NaN), then the first index of that maximum and the sum of exp(x - maximum). With fewer rows
// than threads a row is cut into one part per thread and the parts merged, as a softmax over
// blocks merges them: at batch 1 one thread took 42 us for the 49k-entry row of the embedded
// model, scalar; vectorized and on both threads it is a few.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "paged_attention.h"
#include "thread_pool.h"

namespace tokenmill {

// What one part [begin, end) of a row says: its largest value and the first index holding it,
// or the first NaN (which wins, as in torch.argmax); and the sum of exp(x - max) over the part.
struct RowScan {
  float max = -INFINITY;
  int64_t best = -1;  // absolute index in the row
  bool nan = false;
  float sum = 0.f;
};

inline RowScan scan_row_part(const float* row, int64_t begin, int64_t end) {
  using namespace vec16;
  RowScan r;
  r.best = begin;
  // Pass 1: the maximum and whether the part holds a NaN.
  int64_t i = begin;
  bool nan = false;
#if defined(__AVX512F__)
  __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
  __mmask16 unordered = 0;
  for (; i + 32 <= end; i += 32) {
    const __m512 a = _mm512_loadu_ps(row + i), b = _mm512_loadu_ps(row + i + 16);
    unordered |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    m0 = _mm512_max_ps(m0, a);
    m1 = _mm512_max_ps(m1, b);
  }
  nan = unordered != 0;
  float mx = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
#else
  float mx = -INFINITY;
#endif
  for (; i < end; ++i) {
    nan = nan || row[i] != row[i];
    mx = std::max(mx, row[i]);
  }
  if (nan) {
    for (int64_t j = begin; j < end; ++j) {
      if (row[j] != row[j]) {
        r.nan = true;
        r.best = j;
        r.max = row[j];
        r.sum = NAN;
        return r;
      }
    }
  }
  r.max = mx;
  // Pass 2: the first index of the maximum, and the sum of the exponentials.
  i = begin;
  int64_t best = -1;
  acc16 sum{};
  for (; i + 16 <= end; i += 16) {
    const acc16 x = load_acc(row + i);
#if defined(__AVX512F__)
    if (best < 0) {
      const __mmask16 hit = _mm512_cmp_ps_mask(reinterpret_cast<const __m512&>(x),
                                               _mm512_set1_ps(mx), _CMP_EQ_OQ);
      if (hit != 0) best = i + __builtin_ctz(hit);
    }
#else
    for (int k = 0; best < 0 && k < 16; ++k) {
      if (row[i + k] == mx) best = i + k;
    }
#endif
    sum += vec16::exp(x - mx);
  }
  float total = hsum(sum);
  for (; i < end; ++i) {
    if (best < 0 && row[i] == mx) best = i;
    total += exp_poly(row[i] - mx);
  }
  r.best = best < 0 ? begin : best;  // no match: every entry is NaN-free and -inf = mx
  r.sum = total;
  return r;
}

// The parts of one row, in order, as one: the first NaN, else the first index of the largest
// maximum; the sums rescaled to that maximum (where it is finite: the logprob is NaN otherwise).
inline RowScan merge_row_parts(const RowScan* parts, int64_t n) {
  RowScan r = parts[0];
  for (int64_t k = 1; k < n && !r.nan; ++k) {
    if (parts[k].nan || parts[k].max > r.max) r = parts[k];
  }
  if (r.nan || !std::isfinite(r.max)) return r;
  float total = 0.f;
  for (int64_t k = 0; k < n; ++k) total += parts[k].sum * std::exp(parts[k].max - r.max);
  r.sum = total;
  return r;
}

inline std::tuple<at::Tensor, at::Tensor> greedy_with_logprobs(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "greedy_with_logprobs: logits must be a contiguous 2-D float32 tensor");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "greedy_with_logprobs: logits have no columns");
  at::Tensor ids = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor lps = at::empty({B}, logits.options());
  const float* x = logits.data_ptr<float>();
  int64_t* id_out = ids.data_ptr<int64_t>();
  float* lp_out = lps.data_ptr<float>();
  // Parts a row: one per thread where the rows alone would leave threads idle, each at least
  // a few thousand entries (a part is worth a wake-up of a worker).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t parts = B >= threads ? 1 : std::clamp<int64_t>(V / 4096, 1, threads);
  std::vector<RowScan> scans(static_cast<size_t>(B * parts));
  tmpool::parallel_for(0, B * parts, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / parts, k = i % parts;
      scans[i] = scan_row_part(x + b * V, V * k / parts, V * (k + 1) / parts);
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    const RowScan r = merge_row_parts(scans.data() + b * parts, parts);
    id_out[b] = r.best;
    // logit - logsumexp is NaN for a NaN or an infinite maximum in PyTorch too.
    lp_out[b] = r.nan || !std::isfinite(r.max) ? NAN : -std::log(r.sum);
  }
  return {ids, lps};
}

}  // namespace tokenmill
