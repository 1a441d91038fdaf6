// Tree attention over vLLM 0.32's CPU_ATTN paged KV cache, as one fused CPU op.
//
// The oracle is the PyTorch path in cpu_tree_attention.py (TreeAttentionPlan,
// itself checked against triton_kernels.tree_attention_ref); tests compare them.
// Built on first use by torch.utils.cpp_extension (cpu_tree_attention.py,
// load_cpu_tree_op) and registered as torch.ops.eagle_tree.tree_attention.
//
// Cache layout (the `vec`/`vec16` ISAs of CPU_ATTN, checked at start-up by
// probe_cpu_kv_layout): kv_cache [num_blocks, Hkv, block_size, 2*D]; per
// (block, kv head) the first block_size*D elements are the keys transposed,
// [D, block_size] (slot fastest), the next block_size*D the values
// [block_size, D].
//
// For query row t (flat row rows[t] of q and out) of request r = row_req[t],
// the keys are the request's ctx_lens[r] context slots (all visible) followed
// by tree_lens[r] tree slots, of which slot m is visible iff bit m of
// tree_mask[t] is set. One online softmax (flash-attention style) per
// (row, query head), one key block at a time; fp32 accumulation.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
void tree_attention_kernel(at::Tensor& out, const at::Tensor& q, const at::Tensor& rows,
                           const at::Tensor& kv_cache, const at::Tensor& block_table,
                           const at::Tensor& row_req, const at::Tensor& ctx_lens,
                           const at::Tensor& tree_lens, const at::Tensor& tree_mask,
                           double scale) {
  const int64_t T = rows.size(0);
  const int64_t Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = kv_cache.size(1), bs = kv_cache.size(2);
  const int64_t group = Hq / Hkv;
  const int64_t W = tree_mask.size(1);
  const int64_t max_blocks = block_table.size(1);
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t head_stride = bs * 2 * D, block_stride = Hkv * head_stride;

  const scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const scalar_t* kvp = kv_cache.data_ptr<scalar_t>();
  const int64_t* rowp = rows.data_ptr<int64_t>();
  const int32_t* btp = block_table.data_ptr<int32_t>();
  const int64_t* reqp = row_req.data_ptr<int64_t>();
  const int64_t* ctxp = ctx_lens.data_ptr<int64_t>();
  const int64_t* tlp = tree_lens.data_ptr<int64_t>();
  const int32_t* maskp = tree_mask.data_ptr<int32_t>();
  const float sc = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, T * Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(D), acc(D), s(bs);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = w / Hq, h = w % Hq, hk = h / group;
      const int64_t r = reqp[t];
      const int64_t ctx = ctxp[r], len = ctx + tlp[r];
      const scalar_t* qrow = qp + rowp[t] * q_s0 + h * q_s1;
      for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(qrow[d]) * sc;
      std::fill(acc.begin(), acc.end(), 0.f);
      float m = neg_inf, l = 0.f;
      const int32_t* mrow = maskp + t * W;
      for (int64_t j0 = 0, bi = 0; j0 < len && bi < max_blocks; j0 += bs, ++bi) {
        const int64_t cnt = std::min(bs, len - j0);
        const scalar_t* K = kvp + static_cast<int64_t>(btp[r * max_blocks + bi]) * block_stride +
                            hk * head_stride;
        const scalar_t* V = K + bs * D;
        for (int64_t i = 0; i < cnt; ++i) s[i] = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          const float qd = qf[d];
          const scalar_t* kr = K + d * bs;
#pragma omp simd
          for (int64_t i = 0; i < cnt; ++i) s[i] += qd * static_cast<float>(kr[i]);
        }
        float bmax = neg_inf;
        for (int64_t i = 0; i < cnt; ++i) {
          const int64_t tj = j0 + i - ctx;  // tree-key index, < 0 for context keys
          if (tj >= 0 && (tj >= 32 * W ||
                          !((static_cast<uint32_t>(mrow[tj >> 5]) >> (tj & 31)) & 1u))) {
            s[i] = neg_inf;
          } else {
            bmax = std::max(bmax, s[i]);
          }
        }
        if (bmax == neg_inf) continue;
        const float m_new = std::max(m, bmax);
        const float alpha = std::exp(m - m_new);  // 0 on the first visible block
        l *= alpha;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
        for (int64_t i = 0; i < cnt; ++i) {
          if (s[i] == neg_inf) continue;
          const float p = std::exp(s[i] - m_new);
          l += p;
          const scalar_t* vr = V + i * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] += p * static_cast<float>(vr[d]);
        }
        m = m_new;
      }
      scalar_t* orow = op + rowp[t] * o_s0 + h * o_s1;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<scalar_t>(acc[d] * inv);
    }
  });
}

void tree_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& rows,
                    const at::Tensor& kv_cache, const at::Tensor& block_table,
                    const at::Tensor& row_req, const at::Tensor& ctx_lens,
                    const at::Tensor& tree_lens, const at::Tensor& tree_mask, double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "tree_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.size(1) == out.size(1) && q.size(2) == out.size(2),
              "tree_attention: q and out must be [N, Hq, D] alike");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "tree_attention: head dim must be contiguous");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous() && kv_cache.size(3) == 2 * q.size(2),
              "tree_attention: kv_cache must be a contiguous [num_blocks, Hkv, block_size, 2*D]");
  TORCH_CHECK(q.size(1) % kv_cache.size(1) == 0, "tree_attention: Hq must be a multiple of Hkv");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "tree_attention: q, out and kv_cache must share a dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && row_req.scalar_type() == at::kLong &&
                  ctx_lens.scalar_type() == at::kLong && tree_lens.scalar_type() == at::kLong,
              "tree_attention: rows, row_req, ctx_lens, tree_lens must be int64");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && tree_mask.scalar_type() == at::kInt,
              "tree_attention: block_table and tree_mask must be int32");
  TORCH_CHECK(rows.is_contiguous() && row_req.is_contiguous() && ctx_lens.is_contiguous() &&
                  tree_lens.is_contiguous() && block_table.is_contiguous() && tree_mask.is_contiguous(),
              "tree_attention: index tensors must be contiguous");
  TORCH_CHECK(row_req.size(0) == rows.size(0) && tree_mask.size(0) == rows.size(0),
              "tree_attention: rows, row_req and tree_mask must have one entry per tree row");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "tree_attention", [&] {
    tree_attention_kernel<scalar_t>(out, q, rows, kv_cache, block_table, row_req, ctx_lens,
                                    tree_lens, tree_mask, scale);
  });
}

}  // namespace

TORCH_LIBRARY(eagle_tree, m) {
  m.def("tree_attention(Tensor(a!) out, Tensor q, Tensor rows, Tensor kv_cache, Tensor block_table, "
        "Tensor row_req, Tensor ctx_lens, Tensor tree_lens, Tensor tree_mask, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(eagle_tree, CPU, m) { m.impl("tree_attention", &tree_attention); }
