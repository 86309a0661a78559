// An op program: a model's step as a list of typed ops over per-step buffers, built from the
// module tree when the model loads (tokenmill/runner/cpu_program.py lowers each shared block)
// and executed here by one generic loop: one Python call per step instead of ~30 eager ops per
// layer. Nothing here knows a model family. Matmuls stay ATen calls or the int kernels
// (linear_spec.h); the glue between them is decode_kernels.h.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "decode_kernels.h"
#include "embedding.h"
#include "greedy_sample.h"
#include "int_dot.h"
#include "linear_spec.h"
#include "lora_kernels.h"
#include "moe_kernels.h"
#include "paged_attention.h"
#include "prefill_attention.h"
#include "quant_gemm.h"
#include "thread_pool.h"
#include "token_bitmask.h"

namespace tokenmill {

// The dtype class of a buffer. kAct: T, the activations' dtype (the residual stream, rotated
// queries, the final output). kIO: X, what the projections take and return: bf16 where every
// projection is quantized (no casts around the int kernels), else T.
enum BufferClass : int64_t { kAct = 0, kIO = 1 };

struct Buffer {
  int64_t width;
  int64_t cls;
};

enum OpKind : int64_t {
  kRmsNorm, kAdd, kLinear, kRopeStoreKV, kAttention, kSiluMul, kGeluTanhMul, kScale, kMoe
};

// One attention block's KV cache (its index in the step's list of caches) and heads.
struct AttnGeometry {
  int64_t cache = 0, heads = 0, kv_heads = 0, head_dim = 0;
};

// One op: reads buffer `src`, writes buffer `dst` (kAdd: dst += src); the other fields are
// those of its kind.
struct Op {
  OpKind kind;
  int64_t src = -1, dst = -1;
  at::Tensor weight;  // kRmsNorm: the norm's weight
  float eps = 0.f;  // kRmsNorm; kRopeStoreKV: the q/k norms'
  LinearSpec linear;  // kLinear
  LoraSlots lora;  // kLinear: undefined without LoRA
  AttnGeometry geo;  // kRopeStoreKV, kAttention
  at::Tensor q_norm, k_norm;  // kRopeStoreKV: per-head norms of q and k, undefined if absent
  at::Tensor cos_half, sin_half;  // kRopeStoreKV: fp32 [max_positions, head_dim / 2]
  float scale = 0.f;  // kAttention; kScale: the factor
  int64_t window = 0;  // kAttention: a sliding window in tokens (0: none)
  std::shared_ptr<MoeSpec> moe;  // kMoe: the router and the experts' projections
};

// A linear from its Python form: (kind, [weight, bias-or-empty, scales-or-empty, q8 packed
// weight-or-empty, q8 scales-or-empty], group size, [own kernel, own min rows, activation
// bits, dense min rows, dense in bf16, dense block width, decode activation bits]).
inline LinearSpec make_linear_spec(int64_t kind, const std::vector<at::Tensor>& tensors,
                                   int64_t group_size, const std::vector<int64_t>& rows) {
  TORCH_CHECK(kind >= kFloat && kind <= kKQuant, "unknown linear kind ", kind);
  TORCH_CHECK(tensors.size() == 5,
              "a linear is [weight, bias, scales, q8 packed weight, q8 scales]");
  LinearSpec spec;
  spec.kind = kind;
  spec.weight = tensors[0];
  if (tensors[1].numel() > 0) spec.bias = tensors[1];
  if (tensors[2].numel() > 0) spec.scales = tensors[2];
  if (tensors[3].numel() > 0) {
    TORCH_CHECK(kind == kInt4 && tensors[4].numel() > 0,
                "q8 tiles are for int4 linears, with their scales");
    spec.q8_packed = tensors[3];
    spec.q8_scales = tensors[4];
  }
  spec.group_size = group_size;
  TORCH_CHECK(rows.size() == 7,
              "row dispatch is [own kernel's block width, its min rows, activation bits, "
              "dense min rows, dense in bf16, dense block width, decode activation bits]");
  spec.own_kernel = rows[0];
  spec.own_min_rows = rows[1];
  spec.act_bits = rows[2];
  spec.dense_min_rows = rows[3];
  spec.dense_type = rows[4] ? at::kBFloat16 : at::kFloat;
  spec.dense_block_n = rows[5];
  spec.decode_act_bits = rows[6];
  TORCH_CHECK((spec.act_bits == 0) == (spec.decode_act_bits == 0),
              "integer activations in prompt steps and decode steps alike, or in neither");
  TORCH_CHECK(spec.act_bits == 0 || kind == kInt8 || spec.q8_packed.defined(),
              "int4 on integer activations needs the weight in q8 tiles");
  return spec;
}

// What one step's ops share. `own`: each buffer's allocation for the step, written in place;
// `cur`: what each buffer holds now (a linear's result may be a tensor of its own).
struct Step {
  std::vector<at::Tensor> own, cur;
  const std::vector<at::Tensor>& kv;
  at::Tensor pos, slots, lens, tables;
  int64_t max_seq_len;
  std::vector<PrefillChunk> chunks;  // empty in a decode-only step
  const std::optional<at::Tensor>& lora_slots;
  int64_t rows;
};

class Program {
 public:
  // A buffer of `width` columns (one row per token of the step) in dtype class `cls`; its index.
  int64_t add_buffer(int64_t width, int64_t cls) {
    TORCH_CHECK(width > 0, "add_buffer: width must be > 0, got ", width);
    TORCH_CHECK(cls == kAct || cls == kIO, "add_buffer: unknown dtype class ", cls);
    buffers_.push_back({width, cls});
    return static_cast<int64_t>(buffers_.size()) - 1;
  }

  // The buffer the step's embeddings are copied into, and the one returned.
  void set_io(int64_t input, int64_t output) {
    check_buffer(input, kAct, "the input");
    check_buffer(output, kAct, "the output");
    TORCH_CHECK(input != output, "set_io: the input and output are one buffer");
    input_ = input;
    output_ = output;
  }

  // dst = rms_norm(src) * weight, in T; src and dst of either class (a projection's output
  // is normed before its residual add in a sandwich-norm layer).
  int64_t add_rms_norm(int64_t src, int64_t dst, at::Tensor weight, double eps) {
    check_buffer(src, -1, "rms_norm's input");
    check_buffer(dst, -1, "rms_norm's output");
    TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() &&
                    weight.size(0) == buffers_[src].width &&
                    buffers_[dst].width == buffers_[src].width,
                "rms_norm: a contiguous weight [", buffers_[src].width, "] and equal widths");
    Op op{kRmsNorm, src, dst};
    op.weight = std::move(weight);
    op.eps = static_cast<float>(eps);
    return push(std::move(op));
  }

  // dst += src (the residual add: dst in T, src a projection's output or a normed one).
  int64_t add_add(int64_t dst, int64_t src) {
    check_buffer(dst, kAct, "add's destination");
    check_buffer(src, -1, "add's input");
    TORCH_CHECK(buffers_[dst].width == buffers_[src].width && dst != src,
                "add: widths differ, or dst is src");
    return push(Op{kAdd, src, dst});
  }

  // dst = src W^T (+ bias) by the spec's route (see make_linear_spec for the arguments).
  int64_t add_linear(int64_t src, int64_t dst, int64_t kind, std::vector<at::Tensor> tensors,
                     int64_t group_size, std::vector<int64_t> row_dispatch) {
    check_buffer(src, kIO, "a linear's input");
    check_buffer(dst, kIO, "a linear's output");
    Op op{kLinear, src, dst};
    op.linear = make_linear_spec(kind, tensors, group_size, row_dispatch);
    TORCH_CHECK(op.linear.out_features() == buffers_[dst].width, "linear: ",
                op.linear.out_features(), " outputs into a buffer of width ",
                buffers_[dst].width);
    TORCH_CHECK(kind != kFloat || op.linear.weight.size(1) == buffers_[src].width,
                "linear: a weight of ", op.linear.weight.size(1), " inputs on a buffer of width ",
                buffers_[src].width);
    io_bf16_ = io_bf16_ && kind != kFloat && kind != kKQuant;  // K-quants take x as it is
    return push(std::move(op));
  }

  // From a fused q/k/v projection's output src: the queries into dst (T), optionally
  // normed per head, rotated; the keys likewise, stored with the values into cache `cache`.
  int64_t add_rope_store_kv(int64_t src, int64_t dst, int64_t cache, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, at::Tensor q_norm,
                            at::Tensor k_norm, double eps, at::Tensor cos_half,
                            at::Tensor sin_half) {
    Op op{kRopeStoreKV, src, dst};
    op.geo = check_geometry(cache, heads, kv_heads, head_dim);
    check_buffer(src, kIO, "rope_store_kv's input");
    check_buffer(dst, kAct, "rope_store_kv's queries");
    TORCH_CHECK(buffers_[src].width == (heads + 2 * kv_heads) * head_dim &&
                    buffers_[dst].width == heads * head_dim,
                "rope_store_kv: q/k/v of ", (heads + 2 * kv_heads) * head_dim,
                " columns in, queries of ", heads * head_dim, " out");
    TORCH_CHECK(cos_half.scalar_type() == at::kFloat && cos_half.dim() == 2 &&
                    cos_half.is_contiguous() && cos_half.size(1) * 2 == head_dim,
                "rope tables must be contiguous fp32 [max_positions, head_dim / 2]");
    TORCH_CHECK(sin_half.sizes() == cos_half.sizes() && sin_half.is_contiguous() &&
                sin_half.scalar_type() == at::kFloat, "rope's sin table must be cos's shape");
    TORCH_CHECK((q_norm.numel() > 0) == (k_norm.numel() > 0),
                "rope_store_kv: norms of both q and k, or of neither");
    if (q_norm.numel() > 0) {
      TORCH_CHECK(q_norm.numel() == head_dim && k_norm.numel() == head_dim &&
                      q_norm.is_contiguous() && k_norm.is_contiguous(),
                  "rope_store_kv: q/k norm weights are contiguous [head_dim]");
      op.q_norm = std::move(q_norm);
      op.k_norm = std::move(k_norm);
    }
    op.eps = static_cast<float>(eps);
    op.cos_half = std::move(cos_half);
    op.sin_half = std::move(sin_half);
    return push(std::move(op));
  }

  // dst = attention of the queries src over cache `cache` (decode or prefill kernel by step).
  // window > 0: a sliding-window layer, each query over its last `window` positions' keys.
  int64_t add_attention(int64_t src, int64_t dst, int64_t cache, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, double scale, int64_t window) {
    TORCH_CHECK(window >= 0, "attention: window must be >= 0 (0: none), got ", window);
    Op op{kAttention, src, dst};
    op.window = window;
    op.geo = check_geometry(cache, heads, kv_heads, head_dim);
    check_buffer(src, kAct, "attention's queries");
    check_buffer(dst, kIO, "attention's output");
    TORCH_CHECK(buffers_[src].width == heads * head_dim &&
                    buffers_[dst].width == heads * head_dim,
                "attention: queries and output of ", heads * head_dim, " columns");
    op.scale = static_cast<float>(scale);
    return push(std::move(op));
  }

  // dst = silu(gate) * up of each row [gate | up] of src.
  int64_t add_silu_mul(int64_t src, int64_t dst) {
    check_buffer(src, kIO, "silu_mul's input");
    check_buffer(dst, kIO, "silu_mul's output");
    TORCH_CHECK(buffers_[src].width == 2 * buffers_[dst].width,
                "silu_mul: an input twice as wide as its output");
    return push(Op{kSiluMul, src, dst});
  }

  // dst = gelu_tanh(gate) * up of each row [gate | up] of src (GELU's tanh approximation).
  int64_t add_gelu_tanh_mul(int64_t src, int64_t dst) {
    check_buffer(src, kIO, "gelu_tanh_mul's input");
    check_buffer(dst, kIO, "gelu_tanh_mul's output");
    TORCH_CHECK(buffers_[src].width == 2 * buffers_[dst].width,
                "gelu_tanh_mul: an input twice as wide as its output");
    return push(Op{kGeluTanhMul, src, dst});
  }

  // dst *= factor (rounded to T first, as a scalar tensor of the activations' dtype), in place.
  int64_t add_scale(int64_t dst, double factor) {
    check_buffer(dst, kAct, "scale's buffer");
    Op op{kScale, dst, dst};
    op.scale = static_cast<float>(factor);
    return push(std::move(op));
  }

  // dst = a mixture of experts' feed-forward of src (moe_kernels.h): the router is the linear
  // given here (one output per expert), its experts are added by add_moe_expert in order.
  int64_t add_moe(int64_t src, int64_t dst, int64_t top_k, bool renormalize, int64_t kind,
                  std::vector<at::Tensor> tensors, int64_t group_size,
                  std::vector<int64_t> row_dispatch) {
    check_buffer(src, kIO, "moe's input");
    check_buffer(dst, kIO, "moe's output");
    TORCH_CHECK(buffers_[src].width == buffers_[dst].width, "moe: input and output widths differ");
    Op op{kMoe, src, dst};
    op.moe = std::make_shared<MoeSpec>();
    op.moe->router = make_linear_spec(kind, tensors, group_size, row_dispatch);
    const int64_t experts = op.moe->router.out_features();
    TORCH_CHECK(top_k >= 1 && top_k <= experts, "moe: top_k must be in [1, ", experts, "], got ",
                top_k);
    op.moe->top_k = top_k;
    op.moe->renormalize = renormalize;
    // The experts' output is summed in fp32 and rounded to T, which a bf16 buffer between
    // projections would round again: the program's X stays T.
    io_bf16_ = false;
    return push(std::move(op));
  }

  // Appends an expert to moe op `op`: its [gate | up] and down linears (make_linear_spec's
  // arguments each).
  void add_moe_expert(int64_t op, int64_t gu_kind, std::vector<at::Tensor> gu_tensors,
                      int64_t gu_group, std::vector<int64_t> gu_rows, int64_t down_kind,
                      std::vector<at::Tensor> down_tensors, int64_t down_group,
                      std::vector<int64_t> down_rows) {
    TORCH_CHECK(op >= 0 && op < num_ops() && ops_[op].kind == kMoe, "add_moe_expert: op ", op,
                " is no moe");
    MoeSpec& m = *ops_[op].moe;
    TORCH_CHECK(m.num_experts() < m.router.out_features(), "add_moe_expert: the router has ",
                m.router.out_features(), " experts, all of them added");
    LinearSpec gu = make_linear_spec(gu_kind, gu_tensors, gu_group, gu_rows);
    LinearSpec down = make_linear_spec(down_kind, down_tensors, down_group, down_rows);
    const int64_t width = buffers_[ops_[op].dst].width;
    TORCH_CHECK(down.out_features() == width && gu.out_features() % 2 == 0,
                "add_moe_expert: a [gate | up] linear of even outputs and a down linear of ",
                width, " outputs");
    m.gate_up.push_back(std::move(gu));
    m.down.push_back(std::move(down));
  }

  int64_t num_ops() const { return static_cast<int64_t>(ops_.size()); }
  int64_t num_caches() const { return num_caches_; }

  // The LoRA slots of linear op `op`: A [slots, R, in] and B [slots, R, out], read in place.
  void set_lora(int64_t op, at::Tensor a, at::Tensor b) {
    TORCH_CHECK(op >= 0 && op < num_ops() && ops_[op].kind == kLinear,
                "set_lora: op ", op, " is no linear");
    Op& lin = ops_[op];
    TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) &&
                    a.size(1) == b.size(1) && a.scalar_type() == b.scalar_type() &&
                    (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) &&
                    a.is_contiguous() && b.is_contiguous() &&
                    a.size(2) == buffers_[lin.src].width && b.size(2) == buffers_[lin.dst].width,
                "set_lora: contiguous fp32 or bf16 A [slots, R, in] and B [slots, R, out]");
    TORCH_CHECK(lora_slots_ < 0 || lora_slots_ == a.size(0),
                "set_lora: every linear has the same number of slots");
    lora_slots_ = a.size(0);
    lin.lora.a = std::move(a);
    lin.lora.b = std::move(b);
  }

  // hidden [T, H] embeddings of the new tokens -> the output buffer [T, H]. A decode-only step
  // (one token per sequence, token b of sequence b) has no `chunks`; any other step gives each
  // sequence's (first row, query length, context length, block-table row), four numbers a
  // sequence, and its attention is prefill_attention.h's.
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& positions,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                     const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     int64_t max_seq_len, const std::vector<int64_t>& chunks,
                     const std::optional<at::Tensor>& lora_slots) const {
    check_step(hidden, positions, kv_caches, slot_mapping, seq_lens, block_tables, chunks);
    check_lora(lora_slots, hidden.size(0));
    at::NoGradGuard no_grad;
    // Steps with prefill whose matmuls are PyTorch's (dense above the modules' thresholds, on
    // OpenMP's threads): the glue goes there too rather than wake (and spin) the pool's
    // workers between. Where every projection at this row count is one of our kernels, the
    // pool (a 200-token prompt's TTFT 110 -> 97 ms on a Zen 5).
    DecodeOnlyStep step_kind(chunks.empty());
    std::optional<tmpool::RouteToOpenMP> openmp;
    if (!chunks.empty()) {
      const int64_t rows = hidden.size(0);
      for (const Op& op : ops_) {
        if ((op.kind == kLinear && !op.linear.own_at(rows)) ||
            (op.kind == kMoe && !op.moe->gate_up.front().own_at(rows))) {
          openmp.emplace();
          break;
        }
      }
    }
    at::Tensor out;
    // The cache's own dtype: the activations', or fp16 under fp32 activations.
    const bool fp16_cache = kv_caches.front().scalar_type() == at::kHalf;
    auto with_cache = [&](auto x_tag) {
      using X = decltype(x_tag);
      out = fp16_cache ? run<float, X, c10::Half>(hidden, positions, kv_caches, slot_mapping,
                                                  seq_lens, block_tables, max_seq_len, chunks,
                                                  lora_slots)
                       : run<float, X, float>(hidden, positions, kv_caches, slot_mapping,
                                              seq_lens, block_tables, max_seq_len, chunks,
                                              lora_slots);
    };
    AT_DISPATCH_SWITCH(hidden.scalar_type(), "tokenmill_op_program",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        // bf16 between the projections when all of them are quantized, as model.forward
        // rounds the quantized layers' inputs (tokenmill's kernels and PyTorch's alike).
        if (io_bf16_) {
          with_cache(c10::BFloat16{});
        } else {
          with_cache(float{});
        }
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        out = run<c10::BFloat16, c10::BFloat16, c10::BFloat16>(
            hidden, positions, kv_caches, slot_mapping, seq_lens, block_tables, max_seq_len,
            chunks, lora_slots);
      }));
    return out;
  }

 private:
  int64_t push(Op op) {
    ops_.push_back(std::move(op));
    return num_ops() - 1;
  }

  // cls -1: either class.
  void check_buffer(int64_t b, int64_t cls, const char* what) const {
    TORCH_CHECK(b >= 0 && b < static_cast<int64_t>(buffers_.size()), what, ": no buffer ", b);
    TORCH_CHECK(cls < 0 || buffers_[b].cls == cls, what, ": buffer ", b, " is of dtype class ",
                buffers_[b].cls, ", expected ", cls);
  }

  AttnGeometry check_geometry(int64_t cache, int64_t heads, int64_t kv_heads,
                              int64_t head_dim) {
    TORCH_CHECK(cache >= 0 && heads > 0 && kv_heads > 0 && head_dim > 0 && head_dim % 2 == 0,
                "attention geometry: a cache index >= 0, heads > 0, an even head_dim");
    TORCH_CHECK(heads % kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
    num_caches_ = std::max(num_caches_, cache + 1);
    return {cache, heads, kv_heads, head_dim};
  }

  // The step's LoRA slot of each row (-1: none), on a program that has LoRA slots.
  void check_lora(const std::optional<at::Tensor>& slots, int64_t rows) const {
    if (!slots.has_value()) return;
    TORCH_CHECK(lora_slots_ >= 0, "LoRA rows, but the program has no LoRA slots");
    TORCH_CHECK(slots->scalar_type() == at::kInt && slots->dim() == 1 &&
                    slots->numel() == rows && slots->is_contiguous() && slots->device().is_cpu(),
                "LoRA slots are a contiguous int32 [rows] tensor");
    const int32_t* s = slots->data_ptr<int32_t>();
    for (int64_t i = 0; i < rows; ++i) {
      TORCH_CHECK(s[i] >= -1 && s[i] < lora_slots_, "LoRA slot ", s[i], " does not exist");
    }
  }

  void check_step(const at::Tensor& hidden, const at::Tensor& positions,
                  const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                  const at::Tensor& seq_lens, const at::Tensor& block_tables,
                  const std::vector<int64_t>& chunks) const {
    TORCH_CHECK(!ops_.empty() && input_ >= 0, "the op program has no ops or no input");
    const int64_t T = hidden.size(0);
    // Sequences: one per token in a decode-only step, one per chunk otherwise.
    const int64_t num_seqs = chunks.empty() ? T : static_cast<int64_t>(chunks.size() / 4);
    TORCH_CHECK(hidden.dim() == 2 && hidden.device().is_cpu() &&
                    hidden.size(1) == buffers_[input_].width,
                "hidden must be [T, ", buffers_[input_].width, "] on CPU");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == T);
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T);
    TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.numel() == num_seqs);
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                block_tables.size(0) == num_seqs && block_tables.is_contiguous());
    TORCH_CHECK(chunks.size() % 4 == 0, "chunks are (first row, query length, context, row)");
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_caches_,
                "one KV cache per attention block: ", num_caches_, ", got ", kv_caches.size());
    TORCH_CHECK(!kv_caches.empty(), "no KV caches");
    const at::ScalarType cache_type = kv_caches.front().scalar_type();
    TORCH_CHECK(cache_type == hidden.scalar_type() ||
                    (cache_type == at::kHalf && hidden.scalar_type() == at::kFloat),
                "the KV cache must be in the activation dtype, or fp16 under fp32 activations, "
                "not ", cache_type);
    for (const auto& c : kv_caches) {
      TORCH_CHECK(c.dim() == 5 && c.size(0) == 2 && c.is_contiguous() &&
                      c.scalar_type() == cache_type,
                  "each KV cache must be contiguous [2, blocks, block_size, Hkv, D], all in "
                  "one dtype");
    }
    for (const Op& op : ops_) {
      if (op.kind != kRopeStoreKV && op.kind != kAttention) continue;
      const at::Tensor& c = kv_caches[op.geo.cache];
      TORCH_CHECK(c.size(3) == op.geo.kv_heads && c.size(4) == op.geo.head_dim,
                  "KV cache ", op.geo.cache, " must be [2, blocks, block_size, ",
                  op.geo.kv_heads, ", ", op.geo.head_dim, "]");
    }
  }

  // T: the activation (residual) dtype; X: what the projections take and return, bf16 when
  // every one is quantized (no casts around the int kernels), else T; C: the KV cache's. The
  // roundings are those of model.forward either way: there the int kernels' bf16 output is
  // widened to T exactly, T values are rounded to bf16 on the way in, and k and v are computed
  // in T and rounded to C as they are stored.
  template <typename T, typename X, typename C>
  at::Tensor run(const at::Tensor& hidden, const at::Tensor& positions,
                 const std::vector<at::Tensor>& kv, const at::Tensor& slot_mapping,
                 const at::Tensor& seq_lens, const at::Tensor& block_tables, int64_t max_seq_len,
                 const std::vector<int64_t>& chunk_args,
                 const std::optional<at::Tensor>& lora_slots) const {
    const int64_t B = hidden.size(0);  // the step's tokens
    const auto tables = block_tables.contiguous();
    Step s{{}, {}, kv, positions.contiguous(), slot_mapping.contiguous(),
           seq_lens.contiguous(), tables, max_seq_len,
           prefill_chunks(chunk_args, B, tables, kv.front().size(1), kv.front().size(2)),
           lora_slots, B};
    // One allocation per buffer for the step, reused by every op (and layer) writing it; the
    // input buffer is our own copy: the residual adds write into it in place.
    const auto act_opts = hidden.options().dtype(c10::CppTypeToScalarType<T>::value);
    const auto io_opts = hidden.options().dtype(c10::CppTypeToScalarType<X>::value);
    for (size_t i = 0; i < buffers_.size(); ++i) {
      const Buffer& b = buffers_[i];
      s.own.push_back(static_cast<int64_t>(i) == input_ ? hidden.contiguous().clone()
                      : at::empty({B, b.width}, b.cls == kAct ? act_opts : io_opts));
    }
    s.cur = s.own;
    for (const Op& op : ops_) {
      switch (op.kind) {
        case kRmsNorm: rms_norm<T, X>(op, s); break;
        case kAdd:
          if (buffers_[op.src].cls == kAct) {
            add_rows<T, T>(s.cur[op.dst].data_ptr<T>(), s.cur[op.src].data_ptr<T>(), B,
                           buffers_[op.dst].width);
          } else {
            add_rows<T, X>(s.cur[op.dst].data_ptr<T>(), s.cur[op.src].data_ptr<X>(), B,
                           buffers_[op.dst].width);
          }
          break;
        case kScale:
          scale_rows<T>(s.cur[op.dst].data_ptr<T>(), op.scale, B, buffers_[op.dst].width);
          break;
        case kGeluTanhMul:
          gelu_tanh_mul_rows<T, X, X>(s.cur[op.src].data_ptr<X>(), s.own[op.dst].data_ptr<X>(),
                                      B, buffers_[op.dst].width);
          s.cur[op.dst] = s.own[op.dst];
          break;
        case kLinear: {
          const at::Tensor& x = s.cur[op.src];
          at::Tensor y = op.linear(x, &s.own[op.dst]).contiguous();
          op.lora.add(x, y, s.lora_slots);
          s.cur[op.dst] = y;
          break;
        }
        case kRopeStoreKV: rope_store_kv<T, X, C>(op, s); break;
        case kAttention: attention<T, X, C>(op, s); break;
        case kMoe:
          TORCH_CHECK(op.moe->num_experts() == op.moe->router.out_features(),
                      "moe: ", op.moe->num_experts(), " experts added of ",
                      op.moe->router.out_features());
          moe_rows<T, X>(*op.moe, s.cur[op.src].contiguous(), s.own[op.dst].data_ptr<X>());
          s.cur[op.dst] = s.own[op.dst];
          break;
        case kSiluMul:
          silu_mul_rows<T, X, X>(s.cur[op.src].data_ptr<X>(), s.own[op.dst].data_ptr<X>(), B,
                                 buffers_[op.dst].width);
          s.cur[op.dst] = s.own[op.dst];
          break;
      }
    }
    return s.cur[output_];
  }

  template <typename T, typename X>
  void rms_norm(const Op& op, Step& s) const {
    if (buffers_[op.src].cls == kIO) {
      rms_norm_from<T, X>(s.cur[op.src].template data_ptr<X>(), op, s);
    } else {
      rms_norm_from<T, X>(s.cur[op.src].template data_ptr<T>(), op, s);
    }
  }

  template <typename T, typename X, typename I>
  void rms_norm_from(const I* x, const Op& op, Step& s) const {
    const T* w = op.weight.data_ptr<T>();
    const int64_t n = buffers_[op.src].width;
    at::Tensor& y = s.own[op.dst];
    if (buffers_[op.dst].cls == kAct) {
      rms_norm_rows<T>(x, w, y.data_ptr<T>(), s.rows, n, op.eps);
    } else {
      rms_norm_rows<T, X>(x, w, y.data_ptr<X>(), s.rows, n, op.eps);
    }
    s.cur[op.dst] = y;
  }

  template <typename T, typename X, typename C>
  void attention(const Op& op, Step& s) const {
    const at::Tensor& cache = s.kv[op.geo.cache];
    const int64_t hq = op.geo.heads, hkv = op.geo.kv_heads, d = op.geo.head_dim;
    const int64_t block_size = cache.size(2);
    const int64_t slots_per_side = cache.size(1) * block_size * hkv * d;
    const C* base = cache.data_ptr<C>();
    PagedView<C> view{base, base + slots_per_side, s.lens.data_ptr<int32_t>(),
                      s.tables.data_ptr<int32_t>(), s.tables.size(1), block_size, op.window};
    const T* q = s.cur[op.src].template data_ptr<T>();
    X* out = s.own[op.dst].data_ptr<X>();
    if (s.chunks.empty()) {
      paged_decode_attention<T, C, X>(q, hq * d, view, s.rows, hq, hkv, d, op.scale, out,
                                      s.max_seq_len);
    } else {
      paged_prefill_attention<T, C, X>(q, hq * d, view, s.chunks, hq, hkv, d, op.scale, out,
                                       hq * d, op.window);
    }
    s.cur[op.dst] = s.own[op.dst];
  }

  // Per token: q widened to T into dst, k computed in T (the optional per-head norm, rope)
  // and stored into the cache as C; v into the cache.
  template <typename T, typename X, typename C>
  void rope_store_kv(const Op& op, Step& s) const {
    const at::Tensor& qkv = s.cur[op.src];
    const at::Tensor& cache = s.kv[op.geo.cache];
    const int64_t hq = op.geo.heads, hkv = op.geo.kv_heads, d = op.geo.head_dim;
    const int64_t B = qkv.size(0), width = qkv.size(1), half = d / 2;
    const int64_t max_pos = op.cos_half.size(0);
    const int64_t q_width = hq * d, kv_width = hkv * d;
    const int64_t num_slots = cache.size(1) * cache.size(2);
    const X* base = qkv.data_ptr<X>();
    T* q_out = s.own[op.dst].data_ptr<T>();
    C* k_cache = cache.data_ptr<C>();
    C* v_cache = k_cache + num_slots * kv_width;
    const int64_t* p = s.pos.data_ptr<int64_t>();
    const int64_t* sl = s.slots.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(p[b] >= 0 && p[b] < max_pos, "position ", p[b], " is past the rope table");
      TORCH_CHECK(sl[b] >= 0 && sl[b] < num_slots, "slot ", sl[b], " is outside the KV cache");
    }
    const T* q_norm = op.q_norm.defined() ? op.q_norm.data_ptr<T>() : nullptr;
    const T* k_norm = op.k_norm.defined() ? op.k_norm.data_ptr<T>() : nullptr;
    const float* cos_half = op.cos_half.data_ptr<float>();
    const float* sin_half = op.sin_half.data_ptr<float>();
    for_rows(B, width, [&](int64_t begin, int64_t end) {
      std::vector<T> k_row(static_cast<size_t>(kv_width));
      for (int64_t b = begin; b < end; ++b) {
        const X* src = base + b * width;
        T* qb = q_out + b * q_width;
        T* kb = k_row.data();
        C* vb = v_cache + sl[b] * kv_width;
        for (int64_t i = 0; i < q_width; ++i) qb[i] = from_f<T>(to_f(src[i]));
        for (int64_t i = 0; i < kv_width; ++i) kb[i] = from_f<T>(to_f(src[q_width + i]));
        for (int64_t i = 0; i < kv_width; ++i) {
          vb[i] = from_f<C>(round_to<T>(to_f(src[q_width + kv_width + i])));
        }
        if (q_norm != nullptr) {
          rms_norm_rows<T>(qb, q_norm, qb, hq, d, op.eps);
          rms_norm_rows<T>(kb, k_norm, kb, hkv, d, op.eps);
        }
        const float* c = cos_half + p[b] * half;
        const float* sn = sin_half + p[b] * half;
        for (int64_t hh = 0; hh < hq; ++hh) rope_head(qb + hh * d, c, sn, half);
        for (int64_t hh = 0; hh < hkv; ++hh) rope_head(kb + hh * d, c, sn, half);
        C* k_dst = k_cache + sl[b] * kv_width;
        for (int64_t i = 0; i < kv_width; ++i) k_dst[i] = from_f<C>(to_f(kb[i]));
      }
    });
    s.cur[op.dst] = s.own[op.dst];
  }

  std::vector<Buffer> buffers_;
  std::vector<Op> ops_;
  int64_t input_ = -1, output_ = -1;
  int64_t num_caches_ = 0;
  int64_t lora_slots_ = -1;  // slots of every linear's LoRA, -1 without LoRA
  // Every linear is int8 / int4: activations between them stay bf16.
  bool io_bf16_ = true;
};

}  // namespace tokenmill

namespace tokenmill {

// out[i] = i, filled by tmpool::parallel_for in chunks of at least `grain`; the chunk holding
// index `throw_at` throws instead. For the pool's tests (tests/ops/test_thread_pool.py).
at::Tensor parallel_iota(int64_t n, int64_t grain, int64_t throw_at) {
  TORCH_CHECK(n >= 0, "parallel_iota: n must be >= 0, got ", n);
  at::Tensor out = at::full({n}, -1, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  tmpool::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      TORCH_CHECK(i != throw_at, "parallel_iota: index ", i, " throws, as asked");
      o[i] = i;
    }
  });
  return out;
}

// silu(gate) * up of each row [gate | up] of a fused gate/up projection's output, computed as
// an op program computes it with activations in the input's dtype. For tests.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous() &&
                  (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16),
              "silu_mul: gate_up must be a contiguous fp32 or bf16 [rows, 2 * n] tensor");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_rows<float, float, float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, n);
  } else {
    silu_mul_rows<c10::BFloat16, c10::BFloat16, c10::BFloat16>(
        gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, n);
  }
  return out;
}

// gelu_tanh(gate) * up of each row [gate | up], as an op program computes it. For tests.
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous() &&
                  (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16),
              "gelu_tanh_mul: gate_up must be a contiguous fp32 or bf16 [rows, 2 * n] tensor");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    gelu_tanh_mul_rows<float, float, float>(gate_up.data_ptr<float>(), out.data_ptr<float>(),
                                            rows, n);
  } else {
    gelu_tanh_mul_rows<c10::BFloat16, c10::BFloat16, c10::BFloat16>(
        gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, n);
  }
  return out;
}

}  // namespace tokenmill

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<tokenmill::Program>(m, "Program")
      .def(pybind11::init<>())
      .def("add_buffer", &tokenmill::Program::add_buffer)
      .def("set_io", &tokenmill::Program::set_io)
      .def("add_rms_norm", &tokenmill::Program::add_rms_norm)
      .def("add_add", &tokenmill::Program::add_add)
      .def("add_linear", &tokenmill::Program::add_linear)
      .def("add_rope_store_kv", &tokenmill::Program::add_rope_store_kv)
      .def("add_attention", &tokenmill::Program::add_attention)
      .def("add_silu_mul", &tokenmill::Program::add_silu_mul)
      .def("add_moe", &tokenmill::Program::add_moe)
      .def("add_moe_expert", &tokenmill::Program::add_moe_expert)
      .def("add_gelu_tanh_mul", &tokenmill::Program::add_gelu_tanh_mul)
      .def("add_scale", &tokenmill::Program::add_scale)
      .def("set_lora", &tokenmill::Program::set_lora)
      .def("num_ops", &tokenmill::Program::num_ops)
      .def("num_caches", &tokenmill::Program::num_caches)
      .def("forward", &tokenmill::Program::forward,
           pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int4_linear", &tokenmill::qgemm::int4_linear,
        "x W^T for int4 W in PyTorch's CPU packing (blocks of block_n outputs), x fp32 or bf16",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scales_and_zeros"),
        pybind11::arg("group_size"), pybind11::arg("block_n"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequantize_int4_t", &tokenmill::qgemm::dequantize_int4_t,
        "the transposed bf16 weight [K, N] of an int4 weight in PyTorch's CPU packing",
        pybind11::arg("packed"), pybind11::arg("scales_and_zeros"), pybind11::arg("group_size"),
        pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("block_n"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int4_q8_linear",
        [](const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
           int64_t group_size, int64_t act_bits) {
          return tokenmill::intdot::int4_q8_linear(x, packed, scales, group_size, act_bits);
        },
        "x W^T for int4 W in q8 tiles (int_dot.h), x quantized to act_bits per block of 32",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scales"),
        pybind11::arg("group_size"), pybind11::arg("act_bits") = 8,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_q16_linear", &tokenmill::intdot::int8_q16_linear,
        "x (W * scales[:, None])^T for int8 W [N, K], x quantized to int16 per row (int_dot.h)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("scales"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_q16_tiles_linear", &tokenmill::intdot::int8_q16_tiles_linear,
        "y = x (w * scales)^T for int8 w in output tiles (pack_int8_q16_tiles), int16 "
        "activations: int8_q16_linear's bits, faster from a few rows",
        pybind11::arg("x"), pybind11::arg("tiles"), pybind11::arg("scales"),
        pybind11::arg("out_features"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int4_int8_tile_pairs", [] {
#ifdef TOKENMILL_Q8_PAIR_INT8
    return true;
#else
    return false;
#endif
  }, "whether int4 layers on int8 activations run two weight tiles a 512-bit register "
     "(AVX512-VNNI): then they beat dequantizing for a dense matmul at every row count");
  m.def("kquant_linear", &tokenmill::kquant::kquant_linear,
        "y = x W^T for W a GGUF tensor's own blocks (uint8, segments of rows of one ggml type "
        "each: `table` int64 [S, 2] of (type, rows)); x fp32 or bf16 [M, K], y in x's dtype "
        "(tokenmill/kernels/cpu/kquant.h)",
        py::arg("x"), py::arg("blocks"), py::arg("table"));
  m.def("kquant_dequantize", &tokenmill::kquant::kquant_dequantize,
        "the weight [N, K] of a GGUF tensor's blocks (see kquant_linear), fp32 or bf16",
        py::arg("blocks"), py::arg("table"), py::arg("k"), py::arg("bf16") = false);
  m.def("kquant_types", [] {
    return std::vector<int64_t>{2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 23};
  }, "the ggml types kquant_linear computes on");
  m.def("int8_linear", &tokenmill::qgemm::int8_linear,
        "x (W * scales[:, None])^T for int8 W [N, K], x fp32 or bf16",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("scales"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("prefill_attention", &tokenmill::prefill_attention,
        "causal attention of prefill chunks over the paged cache, written into out's rows",
        pybind11::arg("q"), pybind11::arg("kv_cache"), pybind11::arg("block_tables"),
        pybind11::arg("chunks"), pybind11::arg("scale"), pybind11::arg("out"),
        pybind11::arg("window") = 0, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("decode_attention", &tokenmill::decode_attention,
        "one query token per sequence over its cached tokens, written into out",
        pybind11::arg("q"), pybind11::arg("kv_cache"), pybind11::arg("block_tables"),
        pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("out"),
        pybind11::arg("window") = 0, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("prefill_head_size_supported", &tokenmill::prefill_head_size_supported,
        "whether prefill_attention has a kernel for this head size", pybind11::arg("head_dim"));
  m.def("parallel_iota", &tokenmill::parallel_iota,
        "out[i] = i filled by the extension's thread pool (throws at index throw_at)",
        pybind11::arg("n"), pybind11::arg("grain") = 1, pybind11::arg("throw_at") = -1,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gelu_tanh_mul", &tokenmill::gelu_tanh_mul,
        "gelu_tanh(gate) * up per row [gate | up], as an op program computes it (for tests)",
        pybind11::arg("gate_up"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("silu_mul", &tokenmill::silu_mul,
        "silu(gate) * up per row [gate | up], as an op program computes it (for tests)",
        pybind11::arg("gate_up"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("pool_stats", [] {
    const auto& pool = tokenmill::tmpool::Pool::get();
    const auto& s = pool.stats();
    return std::map<std::string, int64_t>{{"calls", s.calls.load()},
                                          {"caught_spinning", s.caught_spinning.load()},
                                          {"woken", s.woken.load()},
                                          {"backed_off", s.backed_off.load()},
                                          {"spin_us", pool.spin_ns() / 1000}};
  }, "how the thread pool's workers waited for its calls (counts since the pool started), "
     "and their spin time");
  m.def("configure_pool", [](bool enabled, int64_t spin_us, int64_t chunks_per_thread) {
    TORCH_CHECK(spin_us >= 0 && chunks_per_thread >= 1,
                "configure_pool: spin_us >= 0 and chunks_per_thread >= 1, got ", spin_us, " and ",
                chunks_per_thread);
    auto& settings = tokenmill::tmpool::pool_settings();
    settings.enabled = enabled;
    settings.spin_ns = spin_us * 1000;
    settings.chunks_per_thread = chunks_per_thread;
  }, "the thread pool's settings (tokenmill.envs), given before its first call",
        pybind11::arg("enabled"), pybind11::arg("spin_us"), pybind11::arg("chunks_per_thread"));
  m.def("set_pool_spin_us", [](int64_t us) {
    TORCH_CHECK(us >= 0, "set_pool_spin_us: the spin time must be >= 0 us, got ", us);
    tokenmill::tmpool::Pool::get().set_spin_ns(us * 1000);
  }, "how long the thread pool's workers spin for the next call before they sleep (0: never)",
        pybind11::arg("us"));
  m.def("set_stream_weights", [](bool on) { tokenmill::intdot::g_stream_weights = on; },
        "whether the int kernels fetch weights non-temporally (for models larger than the "
        "last-level cache)", pybind11::arg("on"));
  m.def("stream_weights", [] { return tokenmill::intdot::g_stream_weights; },
        "whether the int kernels fetch weights non-temporally");
  m.def("set_amx", [](bool on) {
#ifdef TOKENMILL_Q16_AMX
    tokenmill::intdot::g_use_amx = on;
#else
    (void)on;
#endif
  }, "whether int8_q16_tiles_linear (the output head) runs calls of 12+ rows on the AMX tiles "
        "where the CPU has them; the results are the same bits either way", pybind11::arg("on"));
  m.def("amx_in_use", [] {
#ifdef TOKENMILL_Q16_AMX
    return tokenmill::intdot::g_use_amx && tokenmill::intdot::amx_granted();
#else
    return false;
#endif
  }, "whether int8_q16_tiles_linear uses the AMX tiles: built for a CPU with AMX-INT8, granted "
        "by the kernel, not turned off by set_amx");
  m.def("int8_embedding", &tokenmill::int8_embedding,
        "rows ids of an int8 embedding table times their bf16 scales, in fp32",
        pybind11::arg("ids"), pybind11::arg("weight"), pybind11::arg("scales"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("greedy_with_logprobs", &tokenmill::greedy_with_logprobs,
        "per row of float32 logits: argmax and its logprob (logit - logsumexp)",
        pybind11::arg("logits"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("apply_token_bitmask", &tokenmill::apply_token_bitmask,
        "logits[r][t] = -inf for each r in rows and each token t that bitmask[r] forbids",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
