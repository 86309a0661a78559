// Structured outputs: set the logits of the tokens a grammar forbids to -inf, in place.
// The bitmask is xgrammar's layout: row r, int32 word w, bit j (least significant first) is
// token 32 * w + j, set when the token is allowed. xgrammar's own CPU routine visits every
// token one by one on one thread; here a word that allows everything is skipped, one that
// allows nothing is a plain fill, and rows are spread over the ATen threads.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "thread_pool.h"

namespace tokenmill {

inline void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask,
                                const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be a contiguous 2-D int32 tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be 1-D int64");
  const int64_t vocab = logits.size(1);
  const int64_t words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "bitmask has ", words, " words, too few for ", vocab,
              " tokens");
  const int64_t n = rows.numel();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0) && row_ids[i] < bitmask.size(0),
                "row ", row_ids[i], " is outside the logits or the bitmask");
  }
  float* out = logits.data_ptr<float>();
  const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  tmpool::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* l = out + row_ids[i] * vocab;
      const uint32_t* m = mask + row_ids[i] * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = m[w];
        if (word == 0xffffffffu) continue;
        const int64_t base = w * 32;
        const int64_t count = std::min<int64_t>(32, vocab - base);
        if (word == 0) {
          std::fill(l + base, l + base + count, kNegInf);
          continue;
        }
        for (int64_t j = 0; j < count; ++j) {
          if (!((word >> j) & 1u)) l[base + j] = kNegInf;
        }
      }
    }
  });
}

}  // namespace tokenmill
