// Rows of an int8 embedding table (one bf16 scale a row, as tokenmill.quant stores a Q8_0
// table): the token embeddings of a step in one call. In PyTorch that is an index of the rows,
// an index of their scales and a multiply, three ops whose dispatch, right after a decode
// step has streamed the weights through the caches, cost ~80 us of a ~5 ms step on a 2-core
// Xeon; the arithmetic is a few hundred multiplies.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "decode_kernels.h"

namespace tokenmill {

// out[i] = weight[ids[i]] * scales[ids[i]] in fp32: float(q) * float(scale), one rounding,
// the bits of tokenmill.quant.packing.dequantize_int8 in fp32.
inline at::Tensor int8_embedding(const at::Tensor& ids, const at::Tensor& weight,
                                 const at::Tensor& scales) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.device().is_cpu(),
              "int8_embedding: ids must be a 1-D int64 CPU tensor");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "int8_embedding: weight must be a contiguous int8 [rows, dim] tensor");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.dim() == 1 &&
                  scales.size(0) == weight.size(0) && scales.is_contiguous(),
              "int8_embedding: scales must be bf16 [rows], one a row of weight");
  const int64_t n = ids.numel(), rows = weight.size(0), dim = weight.size(1);
  const auto idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "int8_embedding: token id ", id[i],
                " is outside the table's ", rows, " rows");
  }
  at::Tensor out = at::empty({n, dim}, weight.options().dtype(at::kFloat));
  const int8_t* w = weight.data_ptr<int8_t>();
  const c10::BFloat16* s = scales.data_ptr<c10::BFloat16>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int8_t* row = w + id[i] * dim;
    const float scale = to_f(s[id[i]]);
    float* dst = o + i * dim;
    for (int64_t k = 0; k < dim; ++k) dst[k] = static_cast<float>(row[k]) * scale;
  }
  return out;
}

}  // namespace tokenmill
