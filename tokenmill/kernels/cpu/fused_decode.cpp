// The decoder layer stack of a Llama-family model for decode-only steps, driven from C++: one
// Python call per step instead of ~30 eager ops per layer. Matmuls stay ATen calls (same kernels
// and threading as model.forward); the glue between them is decode_kernels.h.
#include <torch/extension.h>

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "decode_kernels.h"
#include "embedding.h"
#include "greedy_sample.h"
#include "int_dot.h"
#include "lora_kernels.h"
#include "paged_attention.h"
#include "prefill_attention.h"
#include "quant_gemm.h"
#include "thread_pool.h"
#include "token_bitmask.h"

namespace tokenmill {

// How a projection is computed; the Python side (tokenmill/runner/fused_decode.py) extracts the
// tensors from whatever module sits in that place and refuses modules it does not know.
enum LinearKind : int64_t {
  kFloat = 0,  // at::linear(x, weight, bias)
  kInt8 = 1,  // _weight_int8pack_mm(x as bf16, int8 weight [N, K], per-channel scales [N])
  kInt4 = 2,  // _weight_int4pack_mm_for_cpu(x as bf16, packed weight, group size, scales+zeros)
};

// Whether this thread runs a decode-only step of the stack (LinearSpec picks its int4
// activation bits by it); set for the length of DecoderStack::forward.
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
    if (kind != kInt4) return weight.size(0);
    return q8_packed.defined() ? q8_packed.size(0) * intdot::kTileN : scales.size(1);
  }

  bool own_at(int64_t rows) const {
    return kind != kFloat && own_kernel > 0 && rows >= own_min_rows && rows < dense_min_rows;
  }

  // The module's dense path on bf16 activations xb.
  at::Tensor dense(const at::Tensor& xb) const {
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
  // compute (they cast in, add the bias in bf16 and cast back; the stack skips the casts when
  // every projection is quantized, see DecoderStack::io_bf16_); float ones keep x's dtype.
  // `out`, where given, is a buffer of the result's shape that our int4 kernel may write into
  // instead of allocating (the stack's per-step buffers); other routes allocate as before.
  at::Tensor operator()(const at::Tensor& x, const at::Tensor* out = nullptr) const {
    if (kind == kFloat) {
      return bias.defined() ? at::linear(x, weight, bias) : at::linear(x, weight);
    }
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
  // contiguous in one dtype (the stack's activations between projections).
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

struct LayerWeights {
  at::Tensor input_norm, post_norm;
  at::Tensor q_norm, k_norm;  // undefined unless the family norms q and k per head (Qwen3)
  LinearSpec qkv, o, gate_up, down;
  LoraSlots qkv_lora, o_lora, gate_up_lora, down_lora;  // undefined without LoRA
};

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
               double eps, at::Tensor final_norm, at::Tensor cos_half, at::Tensor sin_half)
      : hq_(num_heads), hkv_(num_kv_heads), d_(head_dim), inter_(intermediate),
        eps_(static_cast<float>(eps)), final_norm_(std::move(final_norm)),
        cos_half_(std::move(cos_half)), sin_half_(std::move(sin_half)) {
    TORCH_CHECK(hq_ % hkv_ == 0, "num_heads must be a multiple of num_kv_heads");
    TORCH_CHECK(cos_half_.scalar_type() == at::kFloat && cos_half_.is_contiguous() &&
                    cos_half_.size(1) * 2 == d_,
                "rope tables must be contiguous fp32 [max_positions, head_dim / 2]");
    TORCH_CHECK(sin_half_.sizes() == cos_half_.sizes() && sin_half_.is_contiguous());
  }

  // norms: input, post-attention, q, k (q/k as empty tensors when absent); linears in the order
  // qkv, o, gate_up, down, each as (kind, [weight, bias-or-empty, scales-or-empty, q8 packed
  // weight-or-empty, q8 scales-or-empty], group size, [own kernel, own min rows, activation
  // bits, dense min rows, dense in bf16, dense block width]: see LinearSpec).
  void add_layer(std::vector<at::Tensor> norms, std::vector<int64_t> kinds,
                 std::vector<std::vector<at::Tensor>> tensors, std::vector<int64_t> group_sizes,
                 std::vector<std::vector<int64_t>> own_kernels) {
    TORCH_CHECK(norms.size() == 4 && kinds.size() == 4 && tensors.size() == 4 &&
                group_sizes.size() == 4 && own_kernels.size() == 4,
                "add_layer: expected 4 norms and 4 linears");
    LayerWeights w;
    w.input_norm = norms[0];
    w.post_norm = norms[1];
    if (norms[2].numel() > 0) w.q_norm = norms[2];
    if (norms[3].numel() > 0) w.k_norm = norms[3];
    LinearSpec* specs[4] = {&w.qkv, &w.o, &w.gate_up, &w.down};
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(kinds[i] >= kFloat && kinds[i] <= kInt4, "unknown linear kind ", kinds[i]);
      TORCH_CHECK(tensors[i].size() == 5,
                  "a linear is [weight, bias, scales, q8 packed weight, q8 scales]");
      specs[i]->kind = kinds[i];
      specs[i]->weight = tensors[i][0];
      if (tensors[i][1].numel() > 0) specs[i]->bias = tensors[i][1];
      if (tensors[i][2].numel() > 0) specs[i]->scales = tensors[i][2];
      if (tensors[i][3].numel() > 0) {
        TORCH_CHECK(kinds[i] == kInt4 && tensors[i][4].numel() > 0,
                    "q8 tiles are for int4 linears, with their scales");
        specs[i]->q8_packed = tensors[i][3];
        specs[i]->q8_scales = tensors[i][4];
      }
      specs[i]->group_size = group_sizes[i];
      TORCH_CHECK(own_kernels[i].size() == 7,
                  "row dispatch is [own kernel's block width, its min rows, activation bits, "
                  "dense min rows, dense in bf16, dense block width, decode activation bits]");
      specs[i]->own_kernel = own_kernels[i][0];
      specs[i]->own_min_rows = own_kernels[i][1];
      specs[i]->act_bits = own_kernels[i][2];
      specs[i]->dense_min_rows = own_kernels[i][3];
      specs[i]->dense_type = own_kernels[i][4] ? at::kBFloat16 : at::kFloat;
      specs[i]->dense_block_n = own_kernels[i][5];
      specs[i]->decode_act_bits = own_kernels[i][6];
      TORCH_CHECK((specs[i]->act_bits == 0) == (specs[i]->decode_act_bits == 0),
                  "integer activations in prompt steps and decode steps alike, or in neither");
      TORCH_CHECK(specs[i]->act_bits == 0 || kinds[i] == kInt8 || specs[i]->q8_packed.defined(),
                  "int4 on integer activations needs the weight in q8 tiles");
    }
    for (const LinearSpec* spec : specs) io_bf16_ = io_bf16_ && spec->kind != kFloat;
    layers_.push_back(std::move(w));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The LoRA slots of layer `layer`'s projections: [A, B] of qkv, o, gate_up, down in turn.
  void set_lora(int64_t layer, std::vector<at::Tensor> tensors) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "set_lora: no layer ", layer);
    TORCH_CHECK(tensors.size() == 8, "set_lora: expected A and B of 4 projections");
    LayerWeights& w = layers_[layer];
    LoraSlots* slots[4] = {&w.qkv_lora, &w.o_lora, &w.gate_up_lora, &w.down_lora};
    for (int i = 0; i < 4; ++i) {
      const at::Tensor &a = tensors[2 * i], &b = tensors[2 * i + 1];
      TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) &&
                      a.size(1) == b.size(1) && a.scalar_type() == b.scalar_type() &&
                      (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) &&
                      a.is_contiguous() && b.is_contiguous(),
                  "set_lora: contiguous fp32 or bf16 A [slots, R, in] and B [slots, R, out]");
      slots[i]->a = a;
      slots[i]->b = b;
    }
  }

  // hidden [T, H] embeddings of the new tokens -> final-normed hidden states [T, H]. A
  // decode-only step (one token per sequence, token b of sequence b) has no `chunks`; any
  // other step gives each sequence's (first row, query length, context length, block-table
  // row), four numbers a sequence, and its attention is prefill_attention.h's.
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
    // pool (a 200-token prompt's TTFT 110 -> 97 ms on a Zen 5). Every layer routes alike.
    DecodeOnlyStep step_kind(chunks.empty());
    std::optional<tmpool::RouteToOpenMP> openmp;
    if (!chunks.empty() && !layers_.empty()) {
      const LayerWeights& w = layers_.front();
      const int64_t rows = hidden.size(0);
      if (!w.qkv.own_at(rows) || !w.o.own_at(rows) || !w.gate_up.own_at(rows) ||
          !w.down.own_at(rows)) {
        openmp.emplace();
      }
    }
    // Our own buffer: the residual adds below write into it in place.
    at::Tensor h = hidden.contiguous().clone();
    at::Tensor out;
    // bf16 between the projections when all of them are quantized, as model.forward rounds
    // the quantized layers' inputs (tokenmill's kernels and PyTorch's alike).
    const bool io_bf16 = io_bf16_;
    // The cache's own dtype: the activations', or fp16 under fp32 activations.
    const bool fp16_cache = kv_caches.front().scalar_type() == at::kHalf;
    auto with_cache = [&](auto x_tag) {
      using X = decltype(x_tag);
      out = fp16_cache ? run<float, X, c10::Half>(h, positions, kv_caches, slot_mapping, seq_lens,
                                                  block_tables, max_seq_len, chunks, lora_slots)
                       : run<float, X, float>(h, positions, kv_caches, slot_mapping, seq_lens,
                                              block_tables, max_seq_len, chunks, lora_slots);
    };
    AT_DISPATCH_SWITCH(h.scalar_type(), "tokenmill_fused_decode",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        if (io_bf16) {
          with_cache(c10::BFloat16{});
        } else {
          with_cache(float{});
        }
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        out = run<c10::BFloat16, c10::BFloat16, c10::BFloat16>(
            h, positions, kv_caches, slot_mapping, seq_lens, block_tables, max_seq_len, chunks,
            lora_slots);
      }));
    return out;
  }

 private:
  // The step's LoRA slot of each row (-1: none), on a stack that has LoRA slots.
  void check_lora(const std::optional<at::Tensor>& slots, int64_t rows) const {
    if (!slots.has_value()) return;
    const LayerWeights& w = layers_.front();
    TORCH_CHECK(w.qkv_lora.a.defined(), "LoRA rows, but the stack has no LoRA slots");
    TORCH_CHECK(slots->scalar_type() == at::kInt && slots->dim() == 1 &&
                    slots->numel() == rows && slots->is_contiguous() && slots->device().is_cpu(),
                "LoRA slots are a contiguous int32 [rows] tensor");
    const int32_t* s = slots->data_ptr<int32_t>();
    const int64_t num_slots = w.qkv_lora.a.size(0);
    for (int64_t i = 0; i < rows; ++i) {
      TORCH_CHECK(s[i] >= -1 && s[i] < num_slots, "LoRA slot ", s[i], " does not exist");
    }
  }

  void check_step(const at::Tensor& hidden, const at::Tensor& positions,
                  const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                  const at::Tensor& seq_lens, const at::Tensor& block_tables,
                  const std::vector<int64_t>& chunks) const {
    const int64_t T = hidden.size(0);
    // Sequences: one per token in a decode-only step, one per chunk otherwise.
    const int64_t num_seqs = chunks.empty() ? T : static_cast<int64_t>(chunks.size() / 4);
    TORCH_CHECK(hidden.dim() == 2 && hidden.device().is_cpu(), "hidden must be [T, H] on CPU");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == T);
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T);
    TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.numel() == num_seqs);
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                block_tables.size(0) == num_seqs && block_tables.is_contiguous());
    TORCH_CHECK(chunks.size() % 4 == 0, "chunks are (first row, query length, context, row)");
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_layers(), "one cache per layer");
    TORCH_CHECK(!kv_caches.empty(), "no KV caches");
    const at::ScalarType cache_type = kv_caches.front().scalar_type();
    TORCH_CHECK(cache_type == hidden.scalar_type() ||
                    (cache_type == at::kHalf && hidden.scalar_type() == at::kFloat),
                "the KV cache must be in the activation dtype, or fp16 under fp32 activations, "
                "not ", cache_type);
    for (const auto& c : kv_caches) {
      TORCH_CHECK(c.dim() == 5 && c.size(0) == 2 && c.size(3) == hkv_ && c.size(4) == d_ &&
                  c.is_contiguous() && c.scalar_type() == cache_type,
                  "each KV cache must be contiguous [2, blocks, block_size, Hkv, D], all in "
                  "one dtype");
    }
  }

  // T: the activation (residual) dtype; X: what the projections take and return, bf16 when
  // every one is quantized (no casts around the int kernels), else T; C: the KV cache's. The
  // roundings are those of model.forward either way: there the int kernels' bf16 output is
  // widened to T exactly, T values are rounded to bf16 on the way in, and k and v are computed
  // in T and rounded to C as they are stored.
  template <typename T, typename X, typename C>
  at::Tensor run(at::Tensor h, const at::Tensor& positions, const std::vector<at::Tensor>& kv,
                 const at::Tensor& slot_mapping, const at::Tensor& seq_lens,
                 const at::Tensor& block_tables, int64_t max_seq_len,
                 const std::vector<int64_t>& chunk_args,
                 const std::optional<at::Tensor>& lora_slots) const {
    const int64_t B = h.size(0), H = h.size(1);  // B: the step's tokens
    const auto pos = positions.contiguous();
    const auto slots = slot_mapping.contiguous();
    const auto lens = seq_lens.contiguous();
    const auto tables = block_tables.contiguous();
    const auto x_opts = h.options().dtype(c10::CppTypeToScalarType<X>::value);
    at::Tensor x = at::empty({B, H}, x_opts);
    at::Tensor q = at::empty({B, hq_ * d_}, h.options());
    at::Tensor attn = at::empty({B, hq_ * d_}, x_opts);
    at::Tensor act = at::empty({B, inter_}, x_opts);
    // The projections' outputs, the same shapes every layer: one buffer each for the step.
    TORCH_CHECK(!layers_.empty(), "the decoder stack has no layers");
    const LayerWeights& first = layers_.front();
    at::Tensor qkv_out = at::empty({B, first.qkv.out_features()}, x_opts);
    at::Tensor o_out = at::empty({B, H}, x_opts);
    at::Tensor gate_up_out = at::empty({B, 2 * inter_}, x_opts);
    at::Tensor down_out = at::empty({B, H}, x_opts);
    const std::vector<PrefillChunk> chunks =
        prefill_chunks(chunk_args, B, tables, kv.front().size(1), kv.front().size(2));
    for (size_t li = 0; li < layers_.size(); ++li) {
      const LayerWeights& w = layers_[li];
      rms_norm_rows<T, X>(h.data_ptr<T>(), w.input_norm.data_ptr<T>(), x.data_ptr<X>(), B, H,
                          eps_);
      at::Tensor qkv = w.qkv(x, &qkv_out).contiguous();
      w.qkv_lora.add(x, qkv, lora_slots);
      prepare_qkv<T, X, C>(w, qkv, q, pos, slots, kv[li]);
      const int64_t block_size = kv[li].size(2);
      const int64_t slots_per_side = kv[li].size(1) * block_size * hkv_ * d_;
      const C* cache = kv[li].data_ptr<C>();
      PagedView<C> view{cache, cache + slots_per_side, lens.data_ptr<int32_t>(),
                        tables.data_ptr<int32_t>(), tables.size(1), block_size};
      const float scale = 1.f / std::sqrt(static_cast<float>(d_));
      if (chunks.empty()) {
        paged_decode_attention<T, C, X>(q.data_ptr<T>(), hq_ * d_, view, B, hq_, hkv_, d_, scale,
                                        attn.data_ptr<X>(), max_seq_len);
      } else {
        paged_prefill_attention<T, C, X>(q.data_ptr<T>(), hq_ * d_, view, chunks, hq_, hkv_, d_,
                                         scale, attn.data_ptr<X>(), hq_ * d_);
      }
      at::Tensor o = w.o(attn, &o_out).contiguous();
      w.o_lora.add(attn, o, lora_slots);
      add_rows<T, X>(h.data_ptr<T>(), o.data_ptr<X>(), B, H);
      rms_norm_rows<T, X>(h.data_ptr<T>(), w.post_norm.data_ptr<T>(), x.data_ptr<X>(), B, H,
                          eps_);
      at::Tensor gate_up = w.gate_up(x, &gate_up_out).contiguous();
      w.gate_up_lora.add(x, gate_up, lora_slots);
      silu_mul_rows<T, X, X>(gate_up.data_ptr<X>(), act.data_ptr<X>(), B, inter_);
      at::Tensor down = w.down(act, &down_out).contiguous();
      w.down_lora.add(act, down, lora_slots);
      add_rows<T, X>(h.data_ptr<T>(), down.data_ptr<X>(), B, H);
    }
    at::Tensor out = at::empty_like(h);
    rms_norm_rows<T>(h.data_ptr<T>(), final_norm_.data_ptr<T>(), out.data_ptr<T>(), B, H, eps_);
    return out;
  }

  // Per token: q widened to T into `q`, k computed in T (the optional per-head norm, rope) and
  // stored into the cache as C; v into the cache.
  template <typename T, typename X, typename C>
  void prepare_qkv(const LayerWeights& w, const at::Tensor& qkv, at::Tensor& q,
                   const at::Tensor& pos, const at::Tensor& slots, const at::Tensor& cache) const {
    const int64_t B = qkv.size(0), width = qkv.size(1), half = d_ / 2;
    const int64_t max_pos = cos_half_.size(0);
    const int64_t q_width = hq_ * d_, kv_width = hkv_ * d_;
    const int64_t num_slots = cache.size(1) * cache.size(2);
    const X* base = qkv.data_ptr<X>();
    T* q_out = q.data_ptr<T>();
    C* k_cache = cache.data_ptr<C>();
    C* v_cache = k_cache + num_slots * kv_width;
    const int64_t* p = pos.data_ptr<int64_t>();
    const int64_t* s = slots.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(p[b] >= 0 && p[b] < max_pos, "position ", p[b], " is past the rope table");
      TORCH_CHECK(s[b] >= 0 && s[b] < num_slots, "slot ", s[b], " is outside the KV cache");
    }
    for_rows(B, width, [&](int64_t begin, int64_t end) {
      std::vector<T> k_row(static_cast<size_t>(kv_width));
      for (int64_t b = begin; b < end; ++b) {
        const X* src = base + b * width;
        T* qb = q_out + b * q_width;
        T* kb = k_row.data();
        C* vb = v_cache + s[b] * kv_width;
        for (int64_t i = 0; i < q_width; ++i) qb[i] = from_f<T>(to_f(src[i]));
        for (int64_t i = 0; i < kv_width; ++i) kb[i] = from_f<T>(to_f(src[q_width + i]));
        for (int64_t i = 0; i < kv_width; ++i) {
          vb[i] = from_f<C>(round_to<T>(to_f(src[q_width + kv_width + i])));
        }
        if (w.q_norm.defined()) {
          rms_norm_rows<T>(qb, w.q_norm.data_ptr<T>(), qb, hq_, d_, eps_);
          rms_norm_rows<T>(kb, w.k_norm.data_ptr<T>(), kb, hkv_, d_, eps_);
        }
        const float* c = cos_half_.data_ptr<float>() + p[b] * half;
        const float* sn = sin_half_.data_ptr<float>() + p[b] * half;
        for (int64_t hh = 0; hh < hq_; ++hh) rope_head(qb + hh * d_, c, sn, half);
        for (int64_t hh = 0; hh < hkv_; ++hh) rope_head(kb + hh * d_, c, sn, half);
        C* k_dst = k_cache + s[b] * kv_width;
        for (int64_t i = 0; i < kv_width; ++i) k_dst[i] = from_f<C>(to_f(kb[i]));
      }
    });
  }

  int64_t hq_, hkv_, d_, inter_;
  float eps_;
  at::Tensor final_norm_, cos_half_, sin_half_;
  std::vector<LayerWeights> layers_;
  // Every projection of every layer is int8 / int4: activations between them stay bf16.
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
// the stack computes it with activations in the input's dtype. For tests.
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

}  // namespace tokenmill

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<tokenmill::DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, double, at::Tensor, at::Tensor,
                          at::Tensor>())
      .def("add_layer", &tokenmill::DecoderStack::add_layer)
      .def("set_lora", &tokenmill::DecoderStack::set_lora)
      .def("num_layers", &tokenmill::DecoderStack::num_layers)
      .def("forward", &tokenmill::DecoderStack::forward,
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
  m.def("int8_linear", &tokenmill::qgemm::int8_linear,
        "x (W * scales[:, None])^T for int8 W [N, K], x fp32 or bf16",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("scales"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("prefill_attention", &tokenmill::prefill_attention,
        "causal attention of prefill chunks over the paged cache, written into out's rows",
        pybind11::arg("q"), pybind11::arg("kv_cache"), pybind11::arg("block_tables"),
        pybind11::arg("chunks"), pybind11::arg("scale"), pybind11::arg("out"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("decode_attention", &tokenmill::decode_attention,
        "one query token per sequence over its cached tokens, written into out",
        pybind11::arg("q"), pybind11::arg("kv_cache"), pybind11::arg("block_tables"),
        pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("out"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("prefill_head_size_supported", &tokenmill::prefill_head_size_supported,
        "whether prefill_attention has a kernel for this head size", pybind11::arg("head_dim"));
  m.def("parallel_iota", &tokenmill::parallel_iota,
        "out[i] = i filled by the extension's thread pool (throws at index throw_at)",
        pybind11::arg("n"), pybind11::arg("grain") = 1, pybind11::arg("throw_at") = -1,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("silu_mul", &tokenmill::silu_mul,
        "silu(gate) * up per row [gate | up], as the decoder stack computes it (for tests)",
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
