// A mixture-of-experts feed-forward as one op of the program: a router (a linear whose outputs
// are the experts' logits), a softmax top-k with or without renormalisation, then for each
// expert that a step's tokens chose its [gate | up] linear, silu_mul and down linear on the rows
// of the tokens that chose it, weighted and summed in fp32. Experts nobody chose are never
// read, so a decode step's cost follows the active parameters. Each expert's projections are
// LinearSpecs (float, int8, int4, K-quant), so every linear kind works; their matmuls run on
// the extension's pool (or ATen's threads) inside each call, the glue on the pool.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "decode_kernels.h"
#include "linear_spec.h"

namespace tokenmill {

struct MoeSpec {
  LinearSpec router;  // [experts, hidden]: the routing logits
  std::vector<LinearSpec> gate_up, down;  // per expert: [2I, hidden] and [hidden, I]
  int64_t top_k = 1;
  bool renormalize = false;

  int64_t num_experts() const { return static_cast<int64_t>(gate_up.size()); }
};

// (weights [B, k] fp32, ids [B, k] int64) as the eager router computes them: softmax in fp32
// over the logits, the top k (descending), renormalised to sum to one where asked.
inline std::pair<at::Tensor, at::Tensor> moe_route(const MoeSpec& m, const at::Tensor& x) {
  const at::Tensor probs = at::softmax(m.router(x), -1, at::kFloat);
  auto [weights, ids] = at::topk(probs, m.top_k, -1);
  if (m.renormalize) weights = weights / weights.sum(-1, true);
  return {weights.contiguous(), ids.contiguous()};
}

// out [B, H] (storage O, rounded as T computes) = sum_j w[t, j] * down_e(silu(gate_e(x_t)) *
// up_e(x_t)) with e = ids[t, j], summed in fp32 in top-k order; x [B, H] contiguous.
template <typename T, typename O>
void moe_rows(const MoeSpec& m, const at::Tensor& x, O* out) {
  const int64_t B = x.size(0), H = x.size(1), k = m.top_k, E = m.num_experts();
  auto [weights, ids] = moe_route(m, x);
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* w = weights.data_ptr<float>();
  // Each expert's (token, choice) pairs, tokens in order: one run a chosen expert.
  std::vector<std::vector<int64_t>> pairs(static_cast<size_t>(E));
  for (int64_t p = 0; p < B * k; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < E, "moe: expert ", id[p], " of ", E);
    pairs[static_cast<size_t>(id[p])].push_back(p);
  }
  // Each pair's weighted output, fp32 [B * k, H]; summed per token below.
  at::Tensor acc = at::empty({B * k, H}, x.options().dtype(at::kFloat));
  float* a = acc.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e) {
    const std::vector<int64_t>& run = pairs[static_cast<size_t>(e)];
    const int64_t n = static_cast<int64_t>(run.size());
    if (n == 0) continue;
    at::Tensor rows = x;
    if (B > 1) {  // gather this expert's tokens (a single token's row is x itself)
      std::vector<int64_t> tokens(run.size());
      for (int64_t i = 0; i < n; ++i) tokens[i] = run[i] / k;
      rows = x.index_select(0, at::tensor(tokens, at::kLong));
    }
    const at::Tensor gu = m.gate_up[e](rows).contiguous();
    const int64_t inter = gu.size(1) / 2;
    at::Tensor act = at::empty({n, inter}, gu.options());
    AT_DISPATCH_SWITCH(gu.scalar_type(), "tokenmill_moe_silu",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        silu_mul_rows<T, float, float>(gu.data_ptr<float>(), act.data_ptr<float>(), n, inter);
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        using B16 = c10::BFloat16;
        silu_mul_rows<T, B16, B16>(gu.data_ptr<B16>(), act.data_ptr<B16>(), n, inter);
      }));
    const at::Tensor y = m.down[e](act).to(at::kFloat).contiguous();
    const float* yr = y.data_ptr<float>();
    for_rows(n, H, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t p = run[i];
        float* dst = a + p * H;
        const float* src = yr + i * H;
        const float wp = w[p];
#pragma omp simd
        for (int64_t c = 0; c < H; ++c) dst[c] = src[c] * wp;
      }
    });
  }
  for_rows(B, k * H, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      O* o = out + t * H;
      const float* first = a + t * k * H;
      for (int64_t c = 0; c < H; ++c) {
        float s = first[c];
        for (int64_t j = 1; j < k; ++j) s += first[j * H + c];
        o[c] = from_f<O>(round_to<T>(s));
      }
    }
  });
}

}  // namespace tokenmill
