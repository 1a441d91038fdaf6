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
//
// Work is split by (run of consecutive rows of one request, at most kRowTile
// rows; KV head): each key block is read once for all those rows and the
// query heads that share the KV head, the scores of a block are one small
// matrix product, and their exponentials are taken eight at a time with
// ATen's vectorized exp (SLEEF, 1-ulp) where the host has AVX2 and FMA.
// (Per (row, query head) with a scalar exp, as before, the op took 2.4-4.8x
// as long on an AVX2 host: scripts/bench_tree_op.py.)

#if defined(__AVX2__) && defined(__FMA__) && !defined(CPU_CAPABILITY)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/cpu/vec/vec.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kRowTile = 16;  // rows of one request per work item

// p[i] = exp(s[i] - m) for i < n (exp(-inf) = 0: masked keys), returns their sum.
inline float exp_shifted(const float* s, float m, float* p, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  const Vec vm(m);
  Vec vsum(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec e = (Vec::loadu(s + i) - vm).exp();
    e.store(p + i);
    vsum = vsum + e;
  }
  float lanes[Vec::size()];
  vsum.store(lanes);
  float sum = 0.f;
  for (int64_t k = 0; k < Vec::size(); ++k) sum += lanes[k];
  for (; i < n; ++i) {
    p[i] = std::exp(s[i] - m);
    sum += p[i];
  }
  return sum;
}

// s[a * bs + i] = q_a . k_i for queries a < nq (rows of qf, D floats each)
// and keys i < cnt of a block K [D, bs] (key fastest): four queries at a
// time against eight keys, so that each loaded key vector serves four
// independent multiply-adds.
inline void block_scores(const float* qf, int64_t nq, const float* K, int64_t bs, int64_t cnt,
                         int64_t D, float* s) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t L = Vec::size();
  int64_t i0 = 0;
  for (; i0 + L <= cnt; i0 += L) {
    int64_t a = 0;
    for (; a + 4 <= nq; a += 4) {
      const float *q0 = qf + a * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
      Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
      for (int64_t d = 0; d < D; ++d) {
        const Vec k = Vec::loadu(K + d * bs + i0);
        s0 = at::vec::fmadd(Vec(q0[d]), k, s0);
        s1 = at::vec::fmadd(Vec(q1[d]), k, s1);
        s2 = at::vec::fmadd(Vec(q2[d]), k, s2);
        s3 = at::vec::fmadd(Vec(q3[d]), k, s3);
      }
      s0.store(s + a * bs + i0);
      s1.store(s + (a + 1) * bs + i0);
      s2.store(s + (a + 2) * bs + i0);
      s3.store(s + (a + 3) * bs + i0);
    }
    for (; a < nq; ++a) {
      const float* qa = qf + a * D;
      Vec sa(0.f);
      for (int64_t d = 0; d < D; ++d) sa = at::vec::fmadd(Vec(qa[d]), Vec::loadu(K + d * bs + i0), sa);
      sa.store(s + a * bs + i0);
    }
  }
  for (; i0 < cnt; ++i0) {  // the block's last keys, fewer than a vector
    for (int64_t a = 0; a < nq; ++a) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += qf[a * D + d] * K[d * bs + i0];
      s[a * bs + i0] = acc;
    }
  }
}

// acc_a = acc_a * alpha[a] + sum_i p[a * bs + i] v_i for queries a < nq and
// keys i < cnt of a block V [bs, D] (dimension fastest): four queries at a
// time over eight dimensions, each loaded value vector serving four.
inline void block_values(const float* p, const float* alpha, int64_t nq, const float* V,
                         int64_t bs, int64_t cnt, int64_t D, float* acc) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t L = Vec::size();
  int64_t a = 0;
  for (; a + 4 <= nq; a += 4) {
    const float *p0 = p + a * bs, *p1 = p0 + bs, *p2 = p1 + bs, *p3 = p2 + bs;
    float *c0 = acc + a * D, *c1 = c0 + D, *c2 = c1 + D, *c3 = c2 + D;
    int64_t d0 = 0;
    for (; d0 + L <= D; d0 += L) {
      Vec a0 = Vec::loadu(c0 + d0) * Vec(alpha[a]), a1 = Vec::loadu(c1 + d0) * Vec(alpha[a + 1]),
          a2 = Vec::loadu(c2 + d0) * Vec(alpha[a + 2]), a3 = Vec::loadu(c3 + d0) * Vec(alpha[a + 3]);
      for (int64_t i = 0; i < cnt; ++i) {
        const Vec v = Vec::loadu(V + i * D + d0);
        a0 = at::vec::fmadd(Vec(p0[i]), v, a0);
        a1 = at::vec::fmadd(Vec(p1[i]), v, a1);
        a2 = at::vec::fmadd(Vec(p2[i]), v, a2);
        a3 = at::vec::fmadd(Vec(p3[i]), v, a3);
      }
      a0.store(c0 + d0);
      a1.store(c1 + d0);
      a2.store(c2 + d0);
      a3.store(c3 + d0);
    }
    for (int64_t k = 0; k < 4; ++k)  // dimensions past the last whole vector
      for (int64_t d = d0; d < D; ++d) {
        float x = acc[(a + k) * D + d] * alpha[a + k];
        for (int64_t i = 0; i < cnt; ++i) x += p[(a + k) * bs + i] * V[i * D + d];
        acc[(a + k) * D + d] = x;
      }
  }
  for (; a < nq; ++a) {
    float* ca = acc + a * D;
    const float* pa = p + a * bs;
    for (int64_t d = 0; d < D; ++d) ca[d] *= alpha[a];
    for (int64_t i = 0; i < cnt; ++i) {
      const float pi = pa[i];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ca[d] += pi * V[i * D + d];
    }
  }
}

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

  // tiles: [t0, t1) consecutive rows of one request, at most kRowTile
  std::vector<int64_t> tiles;
  for (int64_t t = 0; t < T;) {
    int64_t e = t + 1;
    while (e < T && e - t < kRowTile && reqp[e] == reqp[t]) ++e;
    tiles.push_back(t);
    t = e;
  }
  tiles.push_back(T);
  const int64_t n_tiles = static_cast<int64_t>(tiles.size()) - 1;
  const int64_t nq_max = kRowTile * group;

  at::parallel_for(0, n_tiles * Hkv, 1, [&](int64_t begin, int64_t end) {
    // per query (row of the tile x query head of the KV head): scaled query,
    // accumulator, scores of the block, running max and sum
    std::vector<float> qf(nq_max * D), acc(nq_max * D), s(nq_max * bs), pr(nq_max * bs),
        alpha(nq_max), m(nq_max), l(nq_max), kf, vf;  // kf, vf: a block's keys and values as float (other dtypes)
    if (!std::is_same<scalar_t, float>::value) {
      kf.resize(D * bs);
      vf.resize(bs * D);
    }
    for (int64_t w = begin; w < end; ++w) {
      const int64_t tile = w / Hkv, hk = w % Hkv;
      const int64_t t0 = tiles[tile], nt = tiles[tile + 1] - t0, nq = nt * group;
      const int64_t r = reqp[t0];
      const int64_t ctx = ctxp[r], len = ctx + tlp[r];
      for (int64_t a = 0; a < nq; ++a) {  // query a: row t0 + a / group, head hk*group + a % group
        const scalar_t* qrow = qp + rowp[t0 + a / group] * q_s0 + (hk * group + a % group) * q_s1;
        for (int64_t d = 0; d < D; ++d) qf[a * D + d] = static_cast<float>(qrow[d]) * sc;
      }
      std::fill(acc.begin(), acc.begin() + nq * D, 0.f);
      std::fill(m.begin(), m.begin() + nq, neg_inf);
      std::fill(l.begin(), l.begin() + nq, 0.f);
      for (int64_t j0 = 0, bi = 0; j0 < len && bi < max_blocks; j0 += bs, ++bi) {
        const int64_t cnt = std::min(bs, len - j0);
        const scalar_t* Kb = kvp + static_cast<int64_t>(btp[r * max_blocks + bi]) * block_stride +
                             hk * head_stride;
        const scalar_t* Vb = Kb + bs * D;
        const float* K;  // [D, bs]
        const float* V;  // [bs, D]
        if constexpr (std::is_same<scalar_t, float>::value) {
          K = Kb;
          V = Vb;
        } else {
          for (int64_t d = 0; d < D; ++d)
            for (int64_t i = 0; i < cnt; ++i) kf[d * bs + i] = static_cast<float>(Kb[d * bs + i]);
          for (int64_t i = 0; i < cnt; ++i)
            for (int64_t d = 0; d < D; ++d) vf[i * D + d] = static_cast<float>(Vb[i * D + d]);
          K = kf.data();
          V = vf.data();
        }
        block_scores(qf.data(), nq, K, bs, cnt, D, s.data());
        const bool has_tree_keys = j0 + cnt > ctx;
        for (int64_t a = 0; a < nq; ++a) {
          float* sa = s.data() + a * bs;
          if (has_tree_keys) {
            const int32_t* mrow = maskp + (t0 + a / group) * W;
            for (int64_t i = std::max<int64_t>(0, ctx - j0); i < cnt; ++i) {
              const int64_t tj = j0 + i - ctx;  // tree-key index
              if (tj >= 32 * W || !((static_cast<uint32_t>(mrow[tj >> 5]) >> (tj & 31)) & 1u))
                sa[i] = neg_inf;
            }
          }
          float bmax = neg_inf;
          for (int64_t i = 0; i < cnt; ++i) bmax = std::max(bmax, sa[i]);
          float* pa = pr.data() + a * bs;
          if (bmax == neg_inf) {  // nothing visible in this block
            std::fill(pa, pa + cnt, 0.f);
            alpha[a] = 1.f;
            continue;
          }
          const float m_new = std::max(m[a], bmax);
          alpha[a] = std::exp(m[a] - m_new);  // 0 on the first visible block
          l[a] = l[a] * alpha[a] + exp_shifted(sa, m_new, pa, cnt);
          m[a] = m_new;
        }
        block_values(pr.data(), alpha.data(), nq, V, bs, cnt, D, acc.data());
      }
      for (int64_t a = 0; a < nq; ++a) {
        scalar_t* orow = op + rowp[t0 + a / group] * o_s0 + (hk * group + a % group) * o_s1;
        const float inv = l[a] > 0.f ? 1.f / l[a] : 0.f;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<scalar_t>(acc[a * D + d] * inv);
      }
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
