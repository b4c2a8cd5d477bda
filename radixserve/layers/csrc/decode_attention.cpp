// Paged decode attention for the CPU: one query token per request, K and V read in place from
// the KV pool through each request's row of slots (no gathered copy of the context), the query
// heads of a GQA group attended together under their KV head, and long rows split into
// segments attended in parallel and merged by their log-sum-exp (flash-decoding).
//
// decode_attention(q [B, Hkv, G, D], k_buf [S, Hkv, D], v_buf [S, Hkv, D], kv_rows [B, L] int64,
//                  kv_start [B] int64, kv_end [B] int64, scale, split_tokens)
//   -> (out [B, Hkv, G, D] fp32, lse [B, Hkv, G] fp32)
// Request b attends slots kv_rows[b, kv_start[b] : kv_end[b]]. An empty range gives out = 0 and
// lse = -inf, so that callers can merge several ranges (the cascade's shared prefix and
// private suffix) exactly. split_tokens <= 0 picks the segment length from the thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // tokens scored before their softmax update
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Segment {
  int64_t b, t0, t1;
};

// The row of one slot as floats: in place for fp32 pools, converted into `buf` otherwise.
template <typename kv_t>
inline const float* row_as_float(const kv_t* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<kv_t, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

// Online softmax over slots row[t0:t1] for all H * G queries of one request: each slot's K and
// V rows (every KV head, contiguous in the pool) are read once. m, l: [H * G]; acc: [H * G, D].
template <typename kv_t>
void attend(const float* q, int64_t H, int64_t G, int64_t D, const kv_t* k_buf, const kv_t* v_buf,
            const int64_t* row, int64_t t0, int64_t t1, float scale, float* m, float* l,
            float* acc) {
  const int64_t HG = H * G, W = H * D;
  std::vector<float> kf(W), vf(W), p(HG * kBlock);
  for (int64_t i = 0; i < HG; ++i) {
    m[i] = kNegInf;
    l[i] = 0.f;
  }
  std::fill(acc, acc + HG * D, 0.f);
  for (int64_t base = t0; base < t1; base += kBlock) {
    const int64_t n = std::min(kBlock, t1 - base);
    for (int64_t i = 0; i < n; ++i) {
      const float* k = row_as_float(k_buf + row[base + i] * W, kf.data(), W);
      for (int64_t hg = 0; hg < HG; ++hg) {
        const float* kh = k + (hg / G) * D;
        const float* qg = q + hg * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * kh[d];
        p[hg * kBlock + i] = dot * scale;
      }
    }
    for (int64_t hg = 0; hg < HG; ++hg) {
      float* ph = p.data() + hg * kBlock;
      float block_max = kNegInf;
      for (int64_t i = 0; i < n; ++i) block_max = std::max(block_max, ph[i]);
      const float new_m = std::max(m[hg], block_max);
      const float corr = std::exp(m[hg] - new_m);  // exp(-inf) = 0 on the first block
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        ph[i] = std::exp(ph[i] - new_m);
        sum += ph[i];
      }
      l[hg] = l[hg] * corr + sum;
      m[hg] = new_m;
      float* a = acc + hg * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] *= corr;
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* v = row_as_float(v_buf + row[base + i] * W, vf.data(), W);
      for (int64_t hg = 0; hg < HG; ++hg) {
        const float w = p[hg * kBlock + i];
        const float* vh = v + (hg / G) * D;
        float* a = acc + hg * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += w * vh[d];
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q_in, const at::Tensor& k_buf,
                                                    const at::Tensor& v_buf,
                                                    const at::Tensor& kv_rows_in,
                                                    const at::Tensor& kv_start_in,
                                                    const at::Tensor& kv_end_in, double scale,
                                                    int64_t split_tokens) {
  TORCH_CHECK(q_in.dim() == 4, "q must be [B, Hkv, G, D]");
  TORCH_CHECK(k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes(), "k_buf, v_buf: [S, Hkv, D]");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "k_buf and v_buf dtypes differ");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "KV buffers must be contiguous");
  const int64_t B = q_in.size(0), H = q_in.size(1), G = q_in.size(2), D = q_in.size(3);
  TORCH_CHECK(k_buf.size(1) == H && k_buf.size(2) == D, "q and KV buffers disagree on heads/dim");
  TORCH_CHECK(kv_rows_in.dim() == 2 && kv_rows_in.size(0) == B, "kv_rows must be [B, L]");
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  const at::Tensor kv_rows = kv_rows_in.to(at::kLong).contiguous();
  const at::Tensor kv_start = kv_start_in.to(at::kLong).contiguous();
  const at::Tensor kv_end = kv_end_in.to(at::kLong).contiguous();
  const int64_t L = kv_rows.size(1), S = k_buf.size(0);
  const int64_t* starts = kv_start.data_ptr<int64_t>();
  const int64_t* ends = kv_end.data_ptr<int64_t>();
  const int64_t* rows = kv_rows.data_ptr<int64_t>();

  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= starts[b] && starts[b] <= ends[b] && ends[b] <= L,
                "kv range out of its row for request ", b);
    max_len = std::max(max_len, ends[b] - starts[b]);
    for (int64_t t = starts[b]; t < ends[b]; ++t) {
      const int64_t slot = rows[b * L + t];
      TORCH_CHECK(0 <= slot && slot < S, "KV slot ", slot, " out of the pool (", S, ")");
    }
  }
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += ends[b] - starts[b];
  // Under this many (slot, head) visits the work is smaller than waking the thread pool.
  const bool serial = total * H < 16384;
  if (split_tokens <= 0 && serial) {
    split_tokens = std::max<int64_t>(1, max_len);
  } else if (split_tokens <= 0) {  // enough segments for every thread, none under 128 tokens
    const int64_t target = 4 * at::get_num_threads();
    const int64_t splits = std::max<int64_t>(1, (target + B - 1) / std::max<int64_t>(1, B));
    split_tokens = std::max<int64_t>(128, (max_len + splits - 1) / splits);
  }
  std::vector<Segment> segs;
  std::vector<int64_t> first(B + 1, 0);  // segments of request b: [first[b], first[b + 1])
  for (int64_t b = 0; b < B; ++b) {
    first[b] = static_cast<int64_t>(segs.size());
    for (int64_t t = starts[b]; t < ends[b]; t += split_tokens)
      segs.push_back({b, t, std::min(ends[b], t + split_tokens)});
  }
  first[B] = static_cast<int64_t>(segs.size());
  const int64_t n = static_cast<int64_t>(segs.size());
  const int64_t HG = H * G;
  std::vector<float> seg_m(n * HG), seg_l(n * HG), seg_acc(n * HG * D);

  const float* qp = q.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_buf.scalar_type(), "decode_attention", [&] {
    const scalar_t* kp = k_buf.data_ptr<scalar_t>();
    const scalar_t* vp = v_buf.data_ptr<scalar_t>();
    at::parallel_for(0, n, serial ? n + 1 : 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const Segment& s = segs[i];
        attend<scalar_t>(qp + s.b * HG * D, H, G, D, kp, vp, rows + s.b * L, s.t0, s.t1, fscale,
                         seg_m.data() + i * HG, seg_l.data() + i * HG, seg_acc.data() + i * HG * D);
      }
    });
  });

  at::Tensor out = at::zeros({B, H, G, D}, q.options());
  at::Tensor lse = at::full({B, H, G}, kNegInf, q.options());
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, B, serial ? B + 1 : 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t s0 = first[b], s1 = first[b + 1];
      if (s0 == s1) continue;  // empty range
      for (int64_t hg = 0; hg < HG; ++hg) {
        float mm = kNegInf;
        for (int64_t s = s0; s < s1; ++s) mm = std::max(mm, seg_m[s * HG + hg]);
        float total = 0.f;
        float* o = op + (b * HG + hg) * D;
        for (int64_t s = s0; s < s1; ++s) {
          const float w = std::exp(seg_m[s * HG + hg] - mm);
          total += seg_l[s * HG + hg] * w;
          const float* a = seg_acc.data() + (s * HG + hg) * D;
          for (int64_t d = 0; d < D; ++d) o[d] += a[d] * w;
        }
        for (int64_t d = 0; d < D; ++d) o[d] /= total;
        lp[b * HG + hg] = mm + std::log(total);
      }
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(radixserve, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor kv_rows, Tensor kv_start, "
      "Tensor kv_end, float scale, int split_tokens) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("decode_attention", &decode_attention); }
