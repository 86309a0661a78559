// One projection of an op program (op_program.cpp) as the C++ side computes it: its kind
// (float, int8, int4), its tensors and the row-count routing between tokenmill's kernels,
// PyTorch's and a dense matmul, exactly as the Python modules of tokenmill.quant route; and
// its LoRA slots.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <limits>
#include <optional>

#include "int_dot.h"
#include "kquant.h"
#include "lora_kernels.h"
#include "quant_gemm.h"

namespace tokenmill {

// How a projection is computed; the Python side (tokenmill/runner/cpu_program.py) extracts the
// tensors from whatever module sits in that place and refuses modules it does not know.
enum LinearKind : int64_t {
  kFloat = 0,  // at::linear(x, weight, bias)
  kInt8 = 1,  // _weight_int8pack_mm(x as bf16, int8 weight [N, K], per-channel scales [N])
  kInt4 = 2,  // _weight_int4pack_mm_for_cpu(x as bf16, packed weight, group size, scales+zeros)
  // A GGUF tensor's own blocks (kquant.h): weight uint8 (the segments' blocks), scales the
  // segment table int64 [S, 2] of (ggml type, rows); x in the activations' dtype, not bf16
  // (tokenmill.quant.kquant.KQuantLinear).
  kKQuant = 3,
};

// Whether this thread runs a decode-only step of an op program (LinearSpec picks its int4
// activation bits by it); set for the length of Program::forward.
inline thread_local bool t_decode_only_step = false;

class DecodeOnlyStep {
 public:
  explicit DecodeOnlyStep(bool on) : saved_(t_decode_only_step) { t_decode_only_step = on; }
  ~DecodeOnlyStep() { t_decode_only_step = saved_; }
  DecodeOnlyStep(const DecodeOnlyStep&) = delete;
  DecodeOnlyStep& operator=(const DecodeOnlyStep&) = delete;

 private:
  bool saved_;
};

struct LinearSpec {
  int64_t kind = kFloat;
  at::Tensor weight;
  at::Tensor bias;  // undefined when absent
  at::Tensor scales;  // kInt8 / kInt4 only
  int64_t group_size = 0;  // kInt4 only
  // kInt8 / kInt4: > 0 for tokenmill's own kernels (quant_gemm.h; for int4 the packing's
  // output-block width), 0 for PyTorch's, as the module computes in Python.
  int64_t own_kernel = 0;
  int64_t own_min_rows = 1;  // ... for this many rows and more
  // > 0: our kernels on integer activations of this many bits (int_dot.h) instead of the fp32
  // ones: 16 for kInt8; 8 or 16 for kInt4, which reads the weight again in q8 tiles (and
  // their scales).
  int64_t act_bits = 0;
  // The same in decode-only steps (int4: 8 by default, see tokenmill.quant.linear).
  int64_t decode_act_bits = 0;
  at::Tensor q8_packed, q8_scales;
  // kInt8 / kInt4: from this many rows the module dequantizes the whole weight for one dense
  // matmul in dense_type (bf16, or fp32 where the CPU has no native bf16); for int4 the
  // decoding reads PyTorch's packing in blocks of dense_block_n outputs (0: an unknown layout,
  // PyTorch's kernel instead), as tokenmill.quant's modules do.
  int64_t dense_min_rows = std::numeric_limits<int64_t>::max();
  at::ScalarType dense_type = at::kBFloat16;
  int64_t dense_block_n = 0;

  // Outputs: [N, K] weights (float, int8), or N / 16 tiles of q8 int4 (else its scales'
  // columns).
  int64_t out_features() const {
    if (kind == kKQuant) return scales.select(1, 1).sum().item<int64_t>();
    if (kind != kInt4) return weight.size(0);
    return q8_packed.defined() ? q8_packed.size(0) * intdot::kTileN : scales.size(1);
  }

  bool own_at(int64_t rows) const {
    return kind != kFloat && own_kernel > 0 && rows >= own_min_rows && rows < dense_min_rows;
  }

  // kKQuant: x in its own dtype (fp32 activations stay fp32 into the int8 quantization, as
  // ggml keeps them), as tokenmill.quant.kquant.KQuantLinear computes.
  at::Tensor kquant_forward(const at::Tensor& x) const {
    at::Tensor y = x.size(0) >= dense_min_rows
                       ? dense(x)
                       : kquant::kquant_linear(x.contiguous(), weight, scales);
    if (bias.defined()) y = y + bias;
    return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
  }

  // The module's dense path on bf16 activations xb.
  at::Tensor dense(const at::Tensor& xb) const {
    if (kind == kKQuant) {
      return at::linear(xb.to(dense_type), kquant::kquant_dequantize(
                                               weight, scales, xb.size(1),
                                               dense_type == at::kBFloat16));
    }
    if (kind == kInt8) {
      return at::linear(xb.to(dense_type), weight * scales.to(dense_type).unsqueeze(1));
    }
    if (dense_block_n == 0) return at::_weight_int4pack_mm_for_cpu(xb, weight, group_size, scales);
    const int64_t N = scales.size(1), K = scales.size(0) * group_size;
    const at::Tensor w_t = qgemm::dequantize_int4_t(weight, scales, group_size, N, K,
                                                    dense_block_n);
    return at::mm(xb.to(dense_type), w_t.to(dense_type));
  }

  // y = x W^T (+ bias). Quantized kinds (ours and PyTorch's kernels) take and return bf16, as tokenmill.quant's modules
  // compute (they cast in, add the bias in bf16 and cast back; the program skips the casts when
  // every projection is quantized, see Program::io_bf16_); float ones keep x's dtype.
  // `out`, where given, is a buffer of the result's shape that our int4 kernel may write into
  // instead of allocating (the program's per-step buffers); other routes allocate as before.
  at::Tensor operator()(const at::Tensor& x, const at::Tensor* out = nullptr) const {
    if (kind == kFloat) {
      return bias.defined() ? at::linear(x, weight, bias) : at::linear(x, weight);
    }
    if (kind == kKQuant) return kquant_forward(x);
    const at::Tensor xb = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16);
    at::Tensor y = quantized(xb, out);
    if (bias.defined()) y = y + bias;
    return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
  }

 private:
  // xb W^T in bf16 by the route the module takes at xb's row count: its dense matmul, ours,
  // or PyTorch's weight-only kernel.
  at::Tensor quantized(const at::Tensor& xb, const at::Tensor* out) const {
    const int64_t rows = xb.size(0);
    if (rows >= dense_min_rows) return dense(xb);
    if (own_at(rows)) {
      if (kind == kInt8) {
        return act_bits ? intdot::int8_q16_linear(xb, weight, scales)
                        : qgemm::int8_linear(xb, weight, scales);
      }
      const int64_t bits = t_decode_only_step ? decode_act_bits : act_bits;
      // The caller's buffer where it holds this result's dtype (bf16 between projections).
      const bool into = out != nullptr && out->scalar_type() == xb.scalar_type();
      return bits ? intdot::int4_q8_linear(xb, q8_packed, q8_scales, group_size, bits,
                                           into ? out : nullptr)
                  : qgemm::int4_linear(xb, weight, scales, group_size, own_kernel);
    }
    if (kind == kInt8) return at::_weight_int8pack_mm(xb, weight, scales);
    return at::_weight_int4pack_mm_for_cpu(xb, weight, group_size, scales);
  }
};

// The LoRA slots of one projection (tokenmill.lora.layers.LoRALinear's tensors, shared: a
// slot loaded in Python is seen here): A [slots, R, in] and B [slots, R, out], fp32 or bf16.
struct LoraSlots {
  at::Tensor a, b;

  // y[m] += B_s (A_s x[m]) for each row m of slot s = row_slots[m] (-1: none); x and y
  // contiguous in one dtype (the program's activations between projections).
  void add(const at::Tensor& x, at::Tensor& y, const std::optional<at::Tensor>& row_slots) const {
    if (!a.defined() || !row_slots.has_value()) return;
    const int64_t M = x.size(0), K = x.size(1), R = a.size(1), N = b.size(2);
    TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && y.size(0) == M && y.size(1) == N &&
                    a.size(2) == K && x.scalar_type() == y.scalar_type(),
                "LoRA update: x [rows, ", K, "] and y [rows, ", N, "] of one dtype");
    const int32_t* slots = row_slots->data_ptr<int32_t>();
    auto run = [&](auto x_tag, auto w_tag) {
      using X = decltype(x_tag);
      using W = decltype(w_tag);
      lora::add_updates<X, W, X>(x.data_ptr<X>(), a.data_ptr<W>(), b.data_ptr<W>(),
                                 y.data_ptr<X>(), slots, M, K, R, N);
    };
    auto with_weights = [&](auto x_tag) {
      if (a.scalar_type() == at::kBFloat16) {
        run(x_tag, c10::BFloat16{});
      } else {
        run(x_tag, float{});
      }
    };
    if (x.scalar_type() == at::kBFloat16) {
      with_weights(c10::BFloat16{});
    } else {
      with_weights(float{});
    }
  }
};

}  // namespace tokenmill
