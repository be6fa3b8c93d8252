// Paged attention for CPU, fp32: queries attend to keys read in place from the block table.
//
// One call covers a batch of sequences, each with a run of queries (1 when decoding, a chunk
// when prefilling on top of cached context). Query i of sequence s sits at position
// context_lens[s] - q_len(s) + i and attends causally to keys 0..that position. No gather,
// no padding: each (sequence, kv head) walks only its own blocks. The G query heads that
// share a KV head are scored together, so every key and value row is loaded once per group.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// DD > 0: the head size known when compiled (32, 64, 128: the loops unroll into whole vectors,
// no remainder code; measured 2x on a decode step of 32 sequences at D = 32); 0: `n`.
template <int DD>
inline float dot(const float* a, const float* b, int64_t n) {
  const int64_t len = DD > 0 ? DD : n;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < len; ++i) acc += a[i] * b[i];
  return acc;
}

// Blocks sit at random places in the pool: ask for the next one while working on this one.
inline void prefetch_block(const float* p, int64_t floats) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < floats * 4; off += 64) __builtin_prefetch(c + off, 0, 1);
}

template <int DD>
inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  const int64_t len = DD > 0 ? DD : n;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) y[i] += alpha * x[i];
}

// Calls f(t, row) for tokens t = 0..num_keys-1 of one sequence, `row` pointing at the token's
// K (or V) for all kv heads: block by block through its table, prefetching the next block.
template <class F>
inline void for_each_token(const float* cache, const int64_t* table, int64_t num_keys, int64_t block_size,
                           int64_t block_stride, int64_t token_stride, F&& f) {
  for (int64_t t = 0, b = 0; t < num_keys; ++b) {
    const float* block = cache + table[b] * block_stride;
    const int64_t n = std::min(block_size, num_keys - t);
    if (t + n < num_keys) prefetch_block(cache + table[b + 1] * block_stride, block_stride);
    for (int64_t j = 0; j < n; ++j, ++t) f(t, block + j * token_stride);
  }
}

}  // namespace

namespace {

template <int DD>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cu,
            const at::Tensor& ctx, const at::Tensor& bt, double scale, at::Tensor& out) {
  const int64_t Hq = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv, S = ctx.size(0), W = bt.size(1);

  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* cup = cu.data_ptr<int64_t>();
  const int64_t* ctxp = ctx.data_ptr<int64_t>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t token_stride = Hkv * D;               // between keys in one block
  const int64_t block_stride = block_size * token_stride;
  const float fscale = static_cast<float>(scale);

  // Work items: query rows. Each row handles all its heads, so every block is read front
  // to back (all heads of a token are adjacent): the hardware prefetcher keeps up, where a
  // per-head walk would touch 128 bytes of every 512 and stall on memory.
  std::vector<int64_t> row_seq(cup[S]);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t r = cup[s]; r < cup[s + 1]; ++r) row_seq[r] = s;

  at::parallel_for(0, cup[S], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;             // head-major: scores[head * num_keys + t]
    std::vector<float> acc(Hq * D);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t s = row_seq[row];
      const int64_t q_len = cup[s + 1] - cup[s];
      const int64_t num_keys = ctxp[s] - q_len + (row - cup[s]) + 1;   // causal
      const int64_t* table = btp + s * W;
      const float* qrow = qp + row * Hq * D;
      scores.resize(num_keys * Hq);
      float* sc = scores.data();
      // Pass 1: scores, block by block (no per-key division).
      for_each_token(kp, table, num_keys, block_size, block_stride, token_stride,
                     [&](int64_t t, const float* ktok) {
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t qh = h * G + g;
            sc[qh * num_keys + t] = dot<DD>(qrow + qh * D, ktok + h * D, D) * fscale;
          }
      });
      // Pass 2: softmax per query head over contiguous scores (vectorizes, exp included).
      float inv[1024];
      for (int64_t qh = 0; qh < Hq; ++qh) {
        float* x = sc + qh * num_keys;
        float m = x[0];
        for (int64_t t = 1; t < num_keys; ++t) m = std::max(m, x[t]);
        float denom = 0.f;
#pragma omp simd reduction(+ : denom)
        for (int64_t t = 0; t < num_keys; ++t) {
          x[t] = std::exp(x[t] - m);
          denom += x[t];
        }
        inv[qh] = 1.f / denom;
      }
      // Pass 3: weighted sum of values, block by block.
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_token(vp, table, num_keys, block_size, block_stride, token_stride,
                     [&](int64_t t, const float* vtok) {
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t qh = h * G + g;
            axpy<DD>(sc[qh * num_keys + t], vtok + h * D, acc.data() + qh * D, D);
          }
      });
      float* orow = op + row * Hq * D;
      for (int64_t qh = 0; qh < Hq; ++qh)
        for (int64_t d = 0; d < D; ++d) orow[qh * D + d] = acc[qh * D + d] * inv[qh];
    }
  });
}

}  // namespace

// q:            [T, Hq, D]  float32, rows of all sequences back to back
// k/v_cache:    [num_blocks, block_size, Hkv, D] float32
// cu_seqlens_q: [S + 1] int64, query rows of sequence s are cu[s]..cu[s+1]
// context_lens: [S] int64, keys of sequence s (cached context plus its queries)
// block_tables: [S, W] int64
// returns       [T, Hq, D]
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                              at::Tensor cu_seqlens_q, at::Tensor context_lens,
                              at::Tensor block_tables, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat,
              "paged_attention: float32 only");
  TORCH_CHECK(q.size(1) <= 1024, "paged_attention: at most 1024 query heads");
  q = q.contiguous();
  auto cu = cu_seqlens_q.contiguous();
  auto ctx = context_lens.contiguous();
  auto bt = block_tables.contiguous();
  auto out = at::empty_like(q);
  switch (q.size(2)) {
    case 32: attend<32>(q, k_cache, v_cache, cu, ctx, bt, scale, out); break;
    case 64: attend<64>(q, k_cache, v_cache, cu, ctx, bt, scale, out); break;
    case 128: attend<128>(q, k_cache, v_cache, cu, ctx, bt, scale, out); break;
    default: attend<0>(q, k_cache, v_cache, cu, ctx, bt, scale, out);
  }
  return out;
}
