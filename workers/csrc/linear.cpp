// y = x W^T (+ b) for a few rows of x (decode steps), fp32 on CPU.
//
// With one row, a linear layer is a matrix-vector product: every weight is read once and used
// once, so it can go no faster than the weights stream from memory. torch's MKL GEMV reaches
// about half of that on the 2-core box (and does not speed up with the second core); this
// loop comes within ~10 % of the read bandwidth with both cores (one core alone streams
// ~15 GB/s). Each thread takes a contiguous range of output rows and reads 8 of them side by
// side, with one accumulator per (weight row, x row) pair: enough independent FMAs to hide
// their latency, and a weight loaded once serves two rows of x. A row's result does not depend
// on the other rows of x nor on the thread count.
//
// Like every parallel torch op, a call waits for its slowest thread: on cores that other
// processes keep busy, torch's default thread count costs more than it gains (the serving
// workers run one thread each).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));   // an unaligned load

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }

inline float hsum(v8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// out[t * ldo + r] = dot(w row r, x row t) for R weight rows and TT input rows, all of length K.
template <int R, int TT>
inline void tile(const float* w, const float* x, int64_t K, float* out, int64_t ldo) {
  v8 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = v8{};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    v8 xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = load8(x + t * K + k);
    for (int r = 0; r < R; ++r) {
      const v8 wv = load8(w + r * K + k);
      for (int t = 0; t < TT; ++t) acc[r][t] += wv * xv[t];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) {
      float s = hsum(acc[r][t]);
      for (int64_t j = k; j < K; ++j) s += w[r * K + j] * x[t * K + j];
      out[t * ldo + r] = s;
    }
}

// kRows weight rows against every row of x: pairs of x rows (two 4-row tiles, 8 accumulators
// each), then a last odd one (one 8-row tile). Eight rows read side by side streamed best.
constexpr int64_t kRows = 8;

inline void row_group(const float* w, const float* x, int64_t T, int64_t K, float* y, int64_t N) {
  int64_t t = 0;
  for (; t + 2 <= T; t += 2) {
    tile<4, 2>(w, x + t * K, K, y + t * N, N);
    tile<4, 2>(w + 4 * K, x + t * K, K, y + t * N + 4, N);
  }
  if (t < T) tile<8, 1>(w, x + t * K, K, y + t * N, N);
}

// The last rows when kRows does not divide N: one at a time.
inline void single_row(const float* w, const float* x, int64_t T, int64_t K, float* y, int64_t N) {
  for (int64_t t = 0; t < T; ++t) tile<1, 1>(w, x + t * K, K, y + t * N, N);
}

}  // namespace

// x: [T, K], weight: [N, K], bias: [N] or None; returns [T, N].
at::Tensor linear(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear: shapes");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t T = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = at::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = (N + kRows - 1) / kRows;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kRows;
      if (n0 + kRows <= N) {
        row_group(wp + n0 * K, xp, T, K, yp + n0, N);
      } else {
        for (int64_t n = n0; n < N; ++n) single_row(wp + n * K, xp, T, K, yp + n, N);
      }
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}
