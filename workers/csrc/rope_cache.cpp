// Rotary embedding of a step's queries and keys, and the store of its keys and values into the
// paged cache, in one call per layer (fp32, CPU). Composed of torch ops it is a multiply, a
// concatenation, another multiply and an add for the rotation, then an index_copy_ each for K
// and V: six dispatches per layer on a few hundred floats per row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

// qkv:      [T, (Hq + 2 Hkv) * D] float32, rows of q's heads, then k's, then v's; q and k are
//           rotated in place ("rotate half": x * cos + cat(x2, x1) * signed_sin, where the sin
//           table's first half carries the minus sign, as workers/model.py's RotaryEmbedding)
// cos, sin: [T, D] float32, each row's position's
// k/v_cache:[num_blocks, block_size, Hkv, D] float32; row t's key and value go to slot slots[t]
void rope_and_cache(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                    at::Tensor slots, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "rope_and_cache: float32 only");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "rope_and_cache: contiguous tensors only");
  TORCH_CHECK(slots.scalar_type() == at::kLong, "rope_and_cache: int64 slots");
  const int64_t T = qkv.size(0), D = cos.size(1), Hq = num_heads, Hkv = num_kv_heads;
  TORCH_CHECK(qkv.size(1) == (Hq + 2 * Hkv) * D && D % 2 == 0 && D <= 1024 && cos.size(0) == T &&
              sin.sizes() == cos.sizes() && slots.numel() == T && v_cache.sizes() == k_cache.sizes() &&
              k_cache.size(2) == Hkv && k_cache.size(3) == D, "rope_and_cache: shapes disagree");
  auto sl = slots.contiguous();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)                     // as index_copy_ would: never write outside
    TORCH_CHECK(slp[t] >= 0 && slp[t] < num_slots, "rope_and_cache: slot ", slp[t], " outside the cache");
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kp = k_cache.data_ptr<float>();
  float* vp = v_cache.data_ptr<float>();
  const int64_t half = D / 2, row = (Hq + 2 * Hkv) * D, token = Hkv * D;
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / row);
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    float rot[1024];
    for (int64_t t = begin; t < end; ++t) {
      float* x = xp + t * row;
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < Hq + Hkv; ++h) {
        float* xh = x + h * D;
        for (int64_t i = 0; i < half; ++i) {
          rot[i] = xh[i] * c[i] + xh[i + half] * s[i];
          rot[i + half] = xh[i + half] * c[i + half] + xh[i] * s[i + half];
        }
        std::copy(rot, rot + D, xh);
      }
      std::copy(x + Hq * D, x + (Hq + Hkv) * D, kp + slp[t] * token);
      std::copy(x + (Hq + Hkv) * D, x + row, vp + slp[t] * token);
    }
  });
}
