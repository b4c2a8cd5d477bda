// The kernels of radixserve's CPU library, for the C++ code that calls them directly (the
// decode step, decode_step.cpp); Python reaches the same functions as torch.ops.radixserve.*.
// Each is documented at its definition.
#pragma once

#include <ATen/ATen.h>

#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace radixserve {

// bf16_linear.cpp
at::Tensor bf16_tiled_linear(const at::Tensor& x, const at::Tensor& wt,
                             const std::optional<at::Tensor>& bias);
at::Tensor bf16_tiled_silu_mul(const at::Tensor& x, const at::Tensor& wt);
at::Tensor bf16_tiled_linear_lora(const at::Tensor& x, const at::Tensor& wt,
                                  const std::optional<at::Tensor>& bias, const at::Tensor& xa,
                                  const at::Tensor& slots, const std::vector<at::Tensor>& bt);
at::Tensor bf16_tiled_silu_mul_lora(const at::Tensor& x, const at::Tensor& wt,
                                    const at::Tensor& xa, const at::Tensor& slots,
                                    const std::vector<at::Tensor>& bt);
at::Tensor bf16_tiled_lora_shrink(const at::Tensor& x, const std::vector<at::Tensor>& a,
                                  const at::Tensor& slots);
bool bf16_tiled_supported();
// Whether the tiles' products run on AMX here (built with it, the tile state granted).
bool bf16_tiled_amx();

// decode_attention.cpp
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_buf,
                                                    const at::Tensor& v_buf,
                                                    const at::Tensor& kv_rows,
                                                    const at::Tensor& kv_start,
                                                    const at::Tensor& kv_end, double scale,
                                                    int64_t split_tokens);

// quant_linear.cpp
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                     const at::Tensor& m);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d);
at::Tensor q4_tiled_linear(const at::Tensor& x, const at::Tensor& wt);
at::Tensor q8_tiled_linear(const at::Tensor& x, const at::Tensor& wt);
// silu_and_mul of the product with a tiled [gate; up] weight: [M, N / 2].
at::Tensor q4_tiled_silu_mul(const at::Tensor& x, const at::Tensor& wt);
at::Tensor q8_tiled_silu_mul(const at::Tensor& x, const at::Tensor& wt);
bool tiled_supported();
at::Tensor q4_dense(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                    const at::Tensor& m, bool bf16);
at::Tensor q8_dense(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, bool bf16);

// lora_ops.cpp
bool lora_delta_pairs();  // whether bf16 adapters take vdpbf16ps (B's tiles as pairs of ranks)
void lora_delta(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& a,
                const std::vector<at::Tensor>& b, const at::Tensor& slots);

// w8a8_linear.cpp
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor> w8a8_quantize_rows(const at::Tensor& x);

// fused_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps);
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor argmax_rows(const at::Tensor& x);
// The fp8 KV pool dtypes (--kv-cache-dtype fp8_e5m2 / fp8_e4m3: memory_pool.FP8_MAX) and
// the largest finite value each stores.
inline bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e5m2 || t == at::kFloat8_e4m3fn; }
inline double fp8_max(at::ScalarType t) {
  return t == at::kFloat8_e5m2 ? static_cast<float>(std::numeric_limits<c10::Float8_e5m2>::max())
                               : static_cast<float>(std::numeric_limits<c10::Float8_e4m3fn>::max());
}
// x in a KV pool's dtype, an fp8 pool's saturated first (memory_pool.to_kv_dtype's rule).
at::Tensor to_kv_dtype(const at::Tensor& x, at::ScalarType dtype);
void store_kv(at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& loc, const at::Tensor& k,
              const at::Tensor& v);

}  // namespace radixserve
