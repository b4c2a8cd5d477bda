// A decode step's decoder layers in one call: the CPU fast path's answer to a captured graph.
//
// At decode a batch has a handful of rows, and a step of SmolLM2-135M is 30 layers of about
// twenty small calls each. Issued one by one from Python (module calls, views, the KV write,
// the attention backend), their dispatch took a third of a batch-1 int4 step. DecodeStep holds
// the model's per-layer weights once and runs every layer in C++, calling the same kernels
// (kernels.h) and ATen ops, with the same arguments, in the same order as the Python path of
// radixserve/models/llama.py under the cpu_paged backend; its results are bitwise those of that
// path (tests/layers/test_decode_step.py). radixserve/layers/decode_step.py decides when a step
// may take it.
//
// DecodeStep(params, kinds, num_heads, num_kv_heads, head_dim, scaling, eps, small_rows,
//            kernel_rows, dense_bf16)
//   params: per layer, input_layernorm.weight, post_attention_layernorm.weight, then the
//     tensors of qkv_proj, o_proj, gate_up_proj and down_proj in that order, each linear's by
//     its kind: dense (weight, or oneDNN's packed copy), q4 (qs, d, m), q8 (qs, d), w8a8 (wq,
//     w_scale), q4, q8 or bf16 in tiles (wt), then its bias if it has one.
//   kinds: per layer and linear, kDense / kQ4 / kQ8 / kW8A8 / kQ4Tiled / kQ8Tiled /
//     kBf16Tiled, plus kBias when it has a bias.
//   small_rows: layers/linear.py's SMALL_M_ROWS (up to it a dense fp32 product is (W · xᵀ)ᵀ);
//   kernel_rows: layers/quantization.py's dense_rows() for the model's dtype (below it the
//     q4 / q8 kernels run, from it q4_dense / q8_dense), and dense_bf16 its gemm_in_bf16():
//     whether those run their GEMM in bf16.
// run(x [B, hidden], cos [B, D], sin [B, D], k_bufs, v_bufs, out_cache_loc [B], kv_rows [B, L],
//     kv_start [B], kv_end [B]) -> (x, residual)
//   x: the embeddings; returns the last layer's MLP output and the residual stream before it
//   (the model's final norm adds them). Writes each layer's K and V at out_cache_loc.
// run_lora(the same, lora_rows, lora_weights, lora_slots, lora_kernel, fp32_rows): with LoRA
//   adapters' deltas added to the four projections as lora/manager.py's LoRALinear adds them
//   (the same calls, in the same order): per group g (one adapter), lora_rows[g] its rows of x
//   (empty: all of them), and per layer and projection eight tensors in lora_weights, at
//   ((g * layers + l) * 4 + i) * 8: a_t, b (fp32, or the model's dtype where it has the kernel),
//   a_t and b in the model's dtype (empty where it is fp32), lora_delta's a and b
//   (lora_ops.cpp), and A and B in the bf16 tiles' layout (bf16_linear.cpp's
//   bf16_tiled_lora_shrink and bf16_tiled_*_lora; empty where the projection is not in
//   tiles); a projection the adapter leaves alone has empty ones. lora_slots: each row's group
//   (-1: none), or empty. With lora_kernel the deltas take lora_delta, one call per projection;
//   else, with slots, a projection in bf16 tiles takes them inside its product; else up to
//   fp32_rows rows they run in a_t's dtype, beyond in the model's dtype.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kDense = 0, kQ4 = 1, kQ8 = 2, kW8A8 = 3, kQ4Tiled = 4, kQ8Tiled = 5,
                  kBf16Tiled = 6, kBias = 8;
constexpr int64_t kKindMask = 7;
constexpr int64_t kLinearsPerLayer = 4;  // qkv_proj, o_proj, gate_up_proj, down_proj

struct Linear {
  int64_t kind = kDense;
  at::Tensor w, qs, d, m, bias;
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
};

// The LoRA groups of one run_lora call (see the header).
struct Lora {
  static constexpr size_t kPerProjection = 8;
  const std::vector<at::Tensor>& rows;
  const std::vector<at::Tensor>& weights;
  const at::Tensor& slots;
  bool kernel;
  int64_t n_layers, fp32_rows;

  // LoRALinear._tiled_operands: whether the deltas join the projection's tiled product.
  bool tiled(const Linear& lin, int64_t layer, int64_t proj) const {
    if (kernel || slots.numel() == 0 || lin.kind != kBf16Tiled) return false;
    for (size_t g = 0; g < rows.size(); ++g) {
      const size_t w = index(g, layer, proj);
      if (weights[w].numel() > 0 && weights[w + 6].numel() == 0) return false;
    }
    return true;
  }

  // The k-th of each group's tensors for one projection (see the header's order).
  std::vector<at::Tensor> each_group(int64_t layer, int64_t proj, size_t k) const {
    std::vector<at::Tensor> out;
    for (size_t g = 0; g < rows.size(); ++g) out.push_back(weights[index(g, layer, proj) + k]);
    return out;
  }

  // For bf16_tiled_*_lora: each group's B in tiles, and the rows' first products (xb: x in
  // bf16) by bf16_tiled_lora_shrink.
  std::vector<at::Tensor> expand(int64_t layer, int64_t proj) const {
    return each_group(layer, proj, 7);
  }
  at::Tensor shrink(const at::Tensor& xb, int64_t layer, int64_t proj) const {
    RECORD_FUNCTION("radixserve::bf16_tiled_lora_shrink", std::vector<c10::IValue>());
    return radixserve::bf16_tiled_lora_shrink(xb, each_group(layer, proj, 6), slots);
  }

  bool touches(int64_t layer, int64_t proj) const {
    for (size_t g = 0; g < rows.size(); ++g) {
      if (weights[index(g, layer, proj)].numel() > 0) return true;
    }
    return false;
  }

  size_t index(size_t g, int64_t layer, int64_t proj) const {
    return ((g * n_layers + layer) * kLinearsPerLayer + proj) * kPerProjection;
  }

  // LoRALinear._add_deltas: y [rows, N] += each group's (x[rows] A^T) (scaling B^T).
  void add(at::Tensor& y, const at::Tensor& x, int64_t layer, int64_t proj) const {
    RECORD_FUNCTION("radixserve::lora_deltas", std::vector<c10::IValue>());
    if (kernel) {  // one call for every group (lora_delta)
      radixserve::lora_delta(y, x, each_group(layer, proj, 4), each_group(layer, proj, 5), slots);
      return;
    }
    for (size_t g = 0; g < rows.size(); ++g) {
      const size_t w = index(g, layer, proj);
      const at::Tensor &a_t = weights[w], &b = weights[w + 1];
      const at::Tensor &a_t_model = weights[w + 2], &b_model = weights[w + 3];
      if (a_t.numel() == 0) continue;
      const bool all = rows[g].numel() == 0;
      const at::Tensor xs = all ? x : x.index_select(0, rows[g]);
      if (a_t_model.numel() > 0 && xs.size(0) > fp32_rows) {
        const at::Tensor xa = at::mm(xs, a_t_model);
        if (all) {
          y.addmm_(xa, b_model);
        } else {
          y.index_add_(0, rows[g], at::mm(xa, b_model));
        }
        continue;
      }
      const at::Tensor delta = at::mm(at::mm(xs.to(a_t.scalar_type()), a_t), b).to(y.scalar_type());
      if (all) {
        y.add_(delta);
      } else {
        y.index_add_(0, rows[g], delta);
      }
    }
  }
};

// layers/linear.py's linear(), for x [rows, K]; a prepacked (oneDNN) weight goes through
// mkldnn::_linear_pointwise, as linear() calls it.
at::Tensor dense(const at::Tensor& x, const Linear& lin, int64_t small_rows) {
  const int64_t rows = x.size(0);
  if (lin.w.is_mkldnn()) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x.contiguous(), lin.w,
                            lin.bias.defined() ? c10::IValue(lin.bias) : c10::IValue(),
                            c10::IValue(std::string("none")),
                            c10::IValue(c10::List<std::optional<c10::Scalar>>()),
                            c10::IValue(std::string(""))};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
  if (lin.w.scalar_type() != at::kFloat || x.scalar_type() != at::kFloat || rows == 0 ||
      rows > small_rows) {
    return at::linear(x, lin.w, lin.bias.defined() ? c10::optional<at::Tensor>(lin.bias)
                                                    : c10::optional<at::Tensor>());
  }
  const at::Tensor flat = rows == 1 ? at::cat({x, x}) : x;
  at::Tensor out = at::mm(lin.w, flat.t()).t().slice(0, 0, rows);
  if (lin.bias.defined()) out = out + lin.bias;
  return out.contiguous();
}

// What the rows of a step run through: QuantizedLinear.forward (layers/quantization.py) or
// linear().
struct Sizes {
  int64_t small_rows, kernel_rows;
  bool dense_bf16;
};

at::Tensor apply(const at::Tensor& x, const Linear& lin, const Sizes& sizes) {
  at::Tensor y;
  const bool kernel = x.size(0) < sizes.kernel_rows;
  switch (lin.kind) {
    case kQ4: {
      RECORD_FUNCTION(kernel ? "radixserve::q4_linear" : "radixserve::q4_dense",
                      std::vector<c10::IValue>());
      y = kernel ? radixserve::q4_linear(x, lin.qs, lin.d, lin.m)
                 : radixserve::q4_dense(x, lin.qs, lin.d, lin.m, sizes.dense_bf16);
      break;
    }
    case kQ8: {
      RECORD_FUNCTION(kernel ? "radixserve::q8_linear" : "radixserve::q8_dense",
                      std::vector<c10::IValue>());
      y = kernel ? radixserve::q8_linear(x, lin.qs, lin.d)
                 : radixserve::q8_dense(x, lin.qs, lin.d, sizes.dense_bf16);
      break;
    }
    case kQ4Tiled: {  // every row count; bf16 out for bf16 in
      RECORD_FUNCTION("radixserve::q4_tiled_linear", std::vector<c10::IValue>());
      y = radixserve::q4_tiled_linear(x, lin.w);
      break;
    }
    case kQ8Tiled: {  // likewise
      RECORD_FUNCTION("radixserve::q8_tiled_linear", std::vector<c10::IValue>());
      y = radixserve::q8_tiled_linear(x, lin.w);
      break;
    }
    case kBf16Tiled: {  // bf16 (linear()'s), its bias added inside
      RECORD_FUNCTION("radixserve::bf16_tiled_linear", std::vector<c10::IValue>());
      const at::Tensor y = radixserve::bf16_tiled_linear(
          x.to(at::kBFloat16), lin.w,
          lin.bias.defined() ? std::optional<at::Tensor>(lin.bias) : std::optional<at::Tensor>());
      return y.to(x.scalar_type());
    }
    case kW8A8: {  // in x's dtype, its bias added inside
      RECORD_FUNCTION("radixserve::w8a8_linear", std::vector<c10::IValue>());
      return radixserve::w8a8_linear(x.contiguous(), lin.qs, lin.d,
                                     lin.bias.defined() ? std::optional<at::Tensor>(lin.bias)
                                                        : std::optional<at::Tensor>());
    }
    default:
      return dense(x, lin, sizes.small_rows);
  }
  y = y.to(x.scalar_type());
  return lin.bias.defined() ? y + lin.bias : y;
}

// LlamaMLP.forward's silu_and_mul(gate_up_proj(x)): one kernel where the projection is in
// tiles (QuantizedLinear.silu_and_mul, Linear.silu_and_mul; bitwise the same), else the two.
at::Tensor gate_up_silu(const at::Tensor& x, const Linear& lin, const Sizes& sizes) {
  if (lin.kind == kBf16Tiled && !lin.bias.defined() && lin.w.size(0) % 2 == 0) {
    RECORD_FUNCTION("radixserve::bf16_tiled_silu_mul", std::vector<c10::IValue>());
    return radixserve::bf16_tiled_silu_mul(x.to(at::kBFloat16), lin.w).to(x.scalar_type());
  }
  const bool tiled = (lin.kind == kQ4Tiled || lin.kind == kQ8Tiled) && !lin.bias.defined() &&
                     lin.w.size(0) % 2 == 0 &&
                     (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat);
  if (!tiled) return radixserve::silu_and_mul(apply(x, lin, sizes));
  if (lin.kind == kQ4Tiled) {
    RECORD_FUNCTION("radixserve::q4_tiled_silu_mul", std::vector<c10::IValue>());
    return radixserve::q4_tiled_silu_mul(x, lin.w);
  }
  RECORD_FUNCTION("radixserve::q8_tiled_silu_mul", std::vector<c10::IValue>());
  return radixserve::q8_tiled_silu_mul(x, lin.w);
}

class DecodeStep : public torch::CustomClassHolder {
 public:
  DecodeStep(std::vector<at::Tensor> params, std::vector<int64_t> kinds, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, double scaling, double eps,
             int64_t small_rows, int64_t kernel_rows, bool dense_bf16)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        scaling_(scaling),
        eps_(eps),
        sizes_{small_rows, kernel_rows, dense_bf16} {
    TORCH_CHECK(kinds.size() % kLinearsPerLayer == 0, "DecodeStep: 4 linear kinds per layer");
    TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
                "DecodeStep: the query heads must group under the KV heads");
    size_t next = 0;
    auto take = [&]() -> at::Tensor {
      TORCH_CHECK(next < params.size(), "DecodeStep: fewer parameters than the kinds need");
      return params[next++];
    };
    const size_t n_layers = kinds.size() / kLinearsPerLayer;
    for (size_t l = 0; l < n_layers; ++l) {
      Layer layer;
      layer.input_norm = take();
      layer.post_norm = take();
      Linear* linears[kLinearsPerLayer] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
      for (int64_t i = 0; i < kLinearsPerLayer; ++i) {
        Linear& lin = *linears[i];
        lin.kind = kinds[l * kLinearsPerLayer + i] & kKindMask;
        if (lin.kind == kQ4) {  // (qs, d, m)
          lin.qs = take();
          lin.d = take();
          lin.m = take();
        } else if (lin.kind == kQ8 || lin.kind == kW8A8) {  // (qs, d); (wq, w_scale) for w8a8
          lin.qs = take();
          lin.d = take();
        } else {  // the weight, or its tiles
          TORCH_CHECK(lin.kind == kDense || lin.kind == kBf16Tiled || lin.kind == kQ4Tiled ||
                          lin.kind == kQ8Tiled,
                      "DecodeStep: unknown linear kind ", lin.kind);
          lin.w = take();
        }
        if (kinds[l * kLinearsPerLayer + i] & kBias) lin.bias = take();
      }
      layers_.push_back(std::move(layer));
    }
    TORCH_CHECK(next == params.size(), "DecodeStep: more parameters than the kinds use");
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  std::tuple<at::Tensor, at::Tensor> run(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                         std::vector<at::Tensor> k_bufs,
                                         std::vector<at::Tensor> v_bufs, at::Tensor out_cache_loc,
                                         at::Tensor kv_rows, at::Tensor kv_start,
                                         at::Tensor kv_end) {
    return layers(x, cos, sin, k_bufs, v_bufs, out_cache_loc, kv_rows, kv_start, kv_end, nullptr);
  }

  std::tuple<at::Tensor, at::Tensor> run_lora(
      at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_bufs,
      std::vector<at::Tensor> v_bufs, at::Tensor out_cache_loc, at::Tensor kv_rows,
      at::Tensor kv_start, at::Tensor kv_end, std::vector<at::Tensor> lora_rows,
      std::vector<at::Tensor> lora_weights, at::Tensor lora_slots, bool lora_kernel,
      int64_t fp32_rows) {
    const Lora lora{lora_rows, lora_weights, lora_slots, lora_kernel, num_layers(), fp32_rows};
    TORCH_CHECK(lora_weights.size() == lora.index(lora_rows.size(), 0, 0),
                "DecodeStep.run_lora: 32 tensors per group and layer");
    TORCH_CHECK(!lora_kernel || lora_slots.numel() > 0, "DecodeStep.run_lora: the kernel takes "
                "the rows' slots");
    return layers(x, cos, sin, k_bufs, v_bufs, out_cache_loc, kv_rows, kv_start, kv_end, &lora);
  }

 private:
  // A projection of x with its adapters' deltas (LoRALinear.forward): inside its tiled product
  // where they join it, else added after.
  at::Tensor project(const at::Tensor& x, const Linear& lin, const Lora* lora, int64_t layer,
                     int64_t proj) const {
    if (lora != nullptr && lora->tiled(lin, layer, proj)) {
      RECORD_FUNCTION("radixserve::bf16_tiled_linear_lora", std::vector<c10::IValue>());
      const at::Tensor xb = x.to(at::kBFloat16).contiguous();
      const at::Tensor y = radixserve::bf16_tiled_linear_lora(
          xb, lin.w,
          lin.bias.defined() ? std::optional<at::Tensor>(lin.bias) : std::optional<at::Tensor>(),
          lora->shrink(xb, layer, proj), lora->slots, lora->expand(layer, proj));
      return y.to(x.scalar_type());
    }
    at::Tensor y = apply(x, lin, sizes_);
    if (lora != nullptr) lora->add(y, x, layer, proj);
    return y;
  }

  std::tuple<at::Tensor, at::Tensor> layers(at::Tensor x, const at::Tensor& cos,
                                            const at::Tensor& sin, std::vector<at::Tensor>& k_bufs,
                                            std::vector<at::Tensor>& v_bufs,
                                            const at::Tensor& out_cache_loc,
                                            const at::Tensor& kv_rows, const at::Tensor& kv_start,
                                            const at::Tensor& kv_end, const Lora* lora) {
    const int64_t n_layers = num_layers();
    TORCH_CHECK(static_cast<int64_t>(k_bufs.size()) == n_layers &&
                    static_cast<int64_t>(v_bufs.size()) == n_layers,
                "DecodeStep.run: one K and one V buffer per layer");
    TORCH_CHECK(x.dim() == 2, "DecodeStep.run: x must be [B, hidden]");
    const int64_t B = x.size(0), H = num_heads_, Hkv = num_kv_heads_, D = head_dim_;
    const int64_t q_size = H * D, kv_size = Hkv * D;
    at::Tensor residual;
    for (int64_t l = 0; l < n_layers; ++l) {
      const Layer& layer = layers_[l];
      if (l == 0) {  // the embeddings become the residual stream
        residual = x;
        x = radixserve::rms_norm(x, layer.input_norm, eps_);
      } else {
        radixserve::add_rms_norm(x, residual, layer.input_norm, eps_);
      }
      // LlamaAttention.forward, with CpuPagedAttnBackend.forward's decode branch.
      at::Tensor qkv = project(x, layer.qkv, lora, l, 0);
      at::Tensor q = qkv.slice(1, 0, q_size).reshape({-1, H, D});
      at::Tensor k = qkv.slice(1, q_size, q_size + kv_size).reshape({-1, Hkv, D});
      const at::Tensor v = qkv.slice(1, q_size + kv_size, q_size + 2 * kv_size).reshape({-1, Hkv, D});
      radixserve::rotary_embedding(q, k, cos, sin);
      at::Tensor& k_buf = k_bufs[l];
      at::Tensor& v_buf = v_bufs[l];
      radixserve::store_kv(k_buf, v_buf, out_cache_loc, k, v);
      at::Tensor attn;
      {
        RECORD_FUNCTION("radixserve::decode_attention", std::vector<c10::IValue>());
        attn = std::get<0>(radixserve::decode_attention(q.reshape({B, Hkv, H / Hkv, D}), k_buf,
                                                        v_buf, kv_rows, kv_start, kv_end,
                                                        scaling_, 0));
      }
      const at::Tensor o_in = attn.to(q.scalar_type()).reshape({B, q_size});
      x = project(o_in, layer.o, lora, l, 1);
      radixserve::add_rms_norm(x, residual, layer.post_norm, eps_);
      // LlamaMLP.forward (with an adapter on gate_up: the product, its delta, then the SiLU).
      at::Tensor act;
      const Linear& gu = layer.gate_up;
      if (lora != nullptr && lora->touches(l, 2)) {
        if (lora->tiled(gu, l, 2) && !gu.bias.defined() && gu.w.size(0) % 2 == 0) {
          RECORD_FUNCTION("radixserve::bf16_tiled_silu_mul_lora", std::vector<c10::IValue>());
          const at::Tensor xb = x.to(at::kBFloat16).contiguous();
          const at::Tensor xa = lora->shrink(xb, l, 2);
          act = radixserve::bf16_tiled_silu_mul_lora(xb, gu.w, xa, lora->slots, lora->expand(l, 2))
                    .to(x.scalar_type());
        } else {
          act = radixserve::silu_and_mul(project(x, gu, lora, l, 2));
        }
      } else {
        act = gate_up_silu(x, gu, sizes_);
      }
      x = project(act, layer.down, lora, l, 3);
    }
    return {x, residual};
  }

  std::vector<Layer> layers_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scaling_, eps_;
  Sizes sizes_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, lib) {
  lib.class_<DecodeStep>("DecodeStep")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t,
                       double, double, int64_t, int64_t, bool>())
      .def("num_layers", &DecodeStep::num_layers)
      .def("run", &DecodeStep::run)
      .def("run_lora", &DecodeStep::run_lora);
}
