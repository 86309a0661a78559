// The decoder layer stack of a Llama-family model for decode-only steps, driven from C++: one
// Python call per step instead of ~30 eager ops per layer. Matmuls stay ATen calls (same kernels
// and threading as model.forward); the glue between them is decode_kernels.h.
#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "decode_kernels.h"
#include "paged_attention.h"

namespace tokenmill {

// How a projection is computed; the Python side (tokenmill/runner/fused_decode.py) extracts the
// tensors from whatever module sits in that place and refuses modules it does not know.
enum LinearKind : int64_t {
  kFloat = 0,  // at::linear(x, weight, bias)
  kInt8 = 1,  // _weight_int8pack_mm(x as bf16, int8 weight [N, K], per-channel scales [N])
  kInt4 = 2,  // _weight_int4pack_mm_for_cpu(x as bf16, packed weight, group size, scales+zeros)
};

struct LinearSpec {
  int64_t kind = kFloat;
  at::Tensor weight;
  at::Tensor bias;  // undefined when absent
  at::Tensor scales;  // kInt8 / kInt4 only
  int64_t group_size = 0;  // kInt4 only

  at::Tensor operator()(const at::Tensor& x) const {
    if (kind == kFloat) {
      return bias.defined() ? at::linear(x, weight, bias) : at::linear(x, weight);
    }
    // The quantized kernels take bf16 activations; mirror tokenmill.quant's modules, which
    // cast in, add the bias in bf16 and cast the result back to the activation dtype.
    const at::Tensor xb = x.to(at::kBFloat16);
    at::Tensor y = kind == kInt8 ? at::_weight_int8pack_mm(xb, weight, scales)
                                 : at::_weight_int4pack_mm_for_cpu(xb, weight, group_size, scales);
    if (bias.defined()) y = y + bias;
    return y.to(x.scalar_type());
  }
};

struct LayerWeights {
  at::Tensor input_norm, post_norm;
  at::Tensor q_norm, k_norm;  // undefined unless the family norms q and k per head (Qwen3)
  LinearSpec qkv, o, gate_up, down;
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
  // qkv, o, gate_up, down, each as (kind, [weight, bias-or-empty, scales-or-empty], group size).
  void add_layer(std::vector<at::Tensor> norms, std::vector<int64_t> kinds,
                 std::vector<std::vector<at::Tensor>> tensors, std::vector<int64_t> group_sizes) {
    TORCH_CHECK(norms.size() == 4 && kinds.size() == 4 && tensors.size() == 4 &&
                group_sizes.size() == 4, "add_layer: expected 4 norms and 4 linears");
    LayerWeights w;
    w.input_norm = norms[0];
    w.post_norm = norms[1];
    if (norms[2].numel() > 0) w.q_norm = norms[2];
    if (norms[3].numel() > 0) w.k_norm = norms[3];
    LinearSpec* specs[4] = {&w.qkv, &w.o, &w.gate_up, &w.down};
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(kinds[i] >= kFloat && kinds[i] <= kInt4, "unknown linear kind ", kinds[i]);
      TORCH_CHECK(tensors[i].size() == 3, "a linear is [weight, bias, scales]");
      specs[i]->kind = kinds[i];
      specs[i]->weight = tensors[i][0];
      if (tensors[i][1].numel() > 0) specs[i]->bias = tensors[i][1];
      if (tensors[i][2].numel() > 0) specs[i]->scales = tensors[i][2];
      specs[i]->group_size = group_sizes[i];
    }
    layers_.push_back(std::move(w));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [B, H] embeddings of the new tokens -> final-normed hidden states [B, H].
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& positions,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                     const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     int64_t max_seq_len) const {
    check_step(hidden, positions, kv_caches, slot_mapping, seq_lens, block_tables);
    at::NoGradGuard no_grad;
    // Our own buffer: the residual adds below write into it in place.
    at::Tensor h = hidden.contiguous().clone();
    at::Tensor out;
    AT_DISPATCH_SWITCH(h.scalar_type(), "tokenmill_fused_decode",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        out = run<float>(h, positions, kv_caches, slot_mapping, seq_lens, block_tables,
                         max_seq_len);
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        out = run<c10::BFloat16>(h, positions, kv_caches, slot_mapping, seq_lens, block_tables,
                                 max_seq_len);
      }));
    return out;
  }

 private:
  void check_step(const at::Tensor& hidden, const at::Tensor& positions,
                  const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                  const at::Tensor& seq_lens, const at::Tensor& block_tables) const {
    const int64_t B = hidden.size(0);
    TORCH_CHECK(hidden.dim() == 2 && hidden.device().is_cpu(), "hidden must be [B, H] on CPU");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == B);
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == B);
    TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.numel() == B);
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                block_tables.size(0) == B);
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_layers(), "one cache per layer");
    for (const auto& c : kv_caches) {
      TORCH_CHECK(c.dim() == 5 && c.size(0) == 2 && c.size(3) == hkv_ && c.size(4) == d_ &&
                  c.is_contiguous() && c.scalar_type() == hidden.scalar_type(),
                  "each KV cache must be contiguous [2, blocks, block_size, Hkv, D] in the "
                  "activation dtype");
    }
  }

  template <typename T>
  at::Tensor run(at::Tensor h, const at::Tensor& positions, const std::vector<at::Tensor>& kv,
                 const at::Tensor& slot_mapping, const at::Tensor& seq_lens,
                 const at::Tensor& block_tables, int64_t max_seq_len) const {
    const int64_t B = h.size(0), H = h.size(1);
    const auto pos = positions.contiguous();
    const auto slots = slot_mapping.contiguous();
    const auto lens = seq_lens.contiguous();
    const auto tables = block_tables.contiguous();
    at::Tensor x = at::empty_like(h);
    at::Tensor attn = at::empty({B, hq_ * d_}, h.options());
    at::Tensor act = at::empty({B, inter_}, h.options());
    for (size_t li = 0; li < layers_.size(); ++li) {
      const LayerWeights& w = layers_[li];
      rms_norm_rows(h.data_ptr<T>(), w.input_norm.data_ptr<T>(), x.data_ptr<T>(), B, H, eps_);
      at::Tensor qkv = w.qkv(x).contiguous();
      prepare_qkv<T>(w, qkv, pos, slots, kv[li]);
      const int64_t block_size = kv[li].size(2);
      const int64_t slots_per_side = kv[li].size(1) * block_size * hkv_ * d_;
      const T* cache = kv[li].data_ptr<T>();
      PagedView<T> view{cache, cache + slots_per_side, lens.data_ptr<int32_t>(),
                        tables.data_ptr<int32_t>(), tables.size(1), block_size};
      paged_decode_attention<T>(qkv.data_ptr<T>(), qkv.size(1), view, B, hq_, hkv_, d_,
                                1.f / std::sqrt(static_cast<float>(d_)), attn.data_ptr<T>(),
                                max_seq_len);
      at::Tensor o = w.o(attn).contiguous();
      add_inplace(h.data_ptr<T>(), o.data_ptr<T>(), B * H);
      rms_norm_rows(h.data_ptr<T>(), w.post_norm.data_ptr<T>(), x.data_ptr<T>(), B, H, eps_);
      at::Tensor gate_up = w.gate_up(x).contiguous();
      silu_mul_rows(gate_up.data_ptr<T>(), act.data_ptr<T>(), B, inter_);
      at::Tensor down = w.down(act).contiguous();
      add_inplace(h.data_ptr<T>(), down.data_ptr<T>(), B * H);
    }
    at::Tensor out = at::empty_like(h);
    rms_norm_rows(h.data_ptr<T>(), final_norm_.data_ptr<T>(), out.data_ptr<T>(), B, H, eps_);
    return out;
  }

  // Per token: optional per-head q/k norm, rope of q and k in place, then k and v into the cache.
  template <typename T>
  void prepare_qkv(const LayerWeights& w, at::Tensor& qkv, const at::Tensor& pos,
                   const at::Tensor& slots, const at::Tensor& cache) const {
    const int64_t B = qkv.size(0), width = qkv.size(1), half = d_ / 2;
    const int64_t max_pos = cos_half_.size(0);
    const int64_t kv_width = hkv_ * d_;
    const int64_t num_slots = cache.size(1) * cache.size(2);
    T* base = qkv.data_ptr<T>();
    T* k_cache = cache.data_ptr<T>();
    T* v_cache = k_cache + num_slots * kv_width;
    const int64_t* p = pos.data_ptr<int64_t>();
    const int64_t* s = slots.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(p[b] >= 0 && p[b] < max_pos, "position ", p[b], " is past the rope table");
      TORCH_CHECK(s[b] >= 0 && s[b] < num_slots, "slot ", s[b], " is outside the KV cache");
      T* q = base + b * width;
      T* k = q + hq_ * d_;
      const T* v = k + kv_width;
      if (w.q_norm.defined()) {
        rms_norm_rows(q, w.q_norm.data_ptr<T>(), q, hq_, d_, eps_);
        rms_norm_rows(k, w.k_norm.data_ptr<T>(), k, hkv_, d_, eps_);
      }
      const float* c = cos_half_.data_ptr<float>() + p[b] * half;
      const float* sn = sin_half_.data_ptr<float>() + p[b] * half;
      for (int64_t hh = 0; hh < hq_ + hkv_; ++hh) rope_head(q + hh * d_, c, sn, half);
      std::memcpy(k_cache + s[b] * kv_width, k, kv_width * sizeof(T));
      std::memcpy(v_cache + s[b] * kv_width, v, kv_width * sizeof(T));
    }
  }

  int64_t hq_, hkv_, d_, inter_;
  float eps_;
  at::Tensor final_norm_, cos_half_, sin_half_;
  std::vector<LayerWeights> layers_;
};

}  // namespace tokenmill

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<tokenmill::DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, double, at::Tensor, at::Tensor,
                          at::Tensor>())
      .def("add_layer", &tokenmill::DecoderStack::add_layer)
      .def("num_layers", &tokenmill::DecoderStack::num_layers)
      .def("forward", &tokenmill::DecoderStack::forward,
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
