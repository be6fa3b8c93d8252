// Llama's RMSNorm, y = w * (x / sqrt(mean(x^2) + eps)) over each row, fp32 on CPU, in one call:
// torch composes it of about a dozen ops, and a decode step runs two norms per layer on a single
// row, where each op's dispatch costs more than its arithmetic.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

// x: [..., H], weight: [H]; returns x's shape.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm: float32 only");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.numel() == H, "rms_norm: weight has ", weight.numel(), " values for rows of ", H);
  auto rows = x.reshape({-1, H}).contiguous();
  weight = weight.contiguous();
  auto y = at::empty_like(rows);
  const float* xp = rows.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  // Rows in parallel only when there are many (a prefill): one row stays on the calling thread.
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / H);
  at::parallel_for(0, rows.size(0), grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * H;
      float* yr = yp + t * H;
      float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t h = 0; h < H; ++h) sum_sq += xr[h] * xr[h];
      const float inv = 1.f / std::sqrt(sum_sq / H + feps);
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) yr[h] = wp[h] * (xr[h] * inv);
    }
  });
  return y.view(x.sizes());
}
