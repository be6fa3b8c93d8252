// The gated MLP's activation, silu(gate) * up, with gate and up the two halves of each row of
// the fused gate/up projection: one call where torch takes a split, a silu and a product.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

// x: [T, 2 I]; returns [T, I].
at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % 2 == 0,
              "silu_and_mul: float32 [rows, 2 * width] only");
  x = x.contiguous();
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto y = at::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / I);   // one row: inline
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = xp + t * 2 * I;
      const float* up = gate + I;
      float* out = yp + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return y;
}
