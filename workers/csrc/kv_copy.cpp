// The copies of a same-node KV handoff (workers/kv_shm.py): runs of blocks between two caches,
// every layer's K and V, in one call. The binding lets go of Python's lock for the whole call,
// so the pulling thread takes it back once per pull; a copy_ per tensor and run from Python
// takes it back after each one and waits up to the interpreter's switch interval (5 ms) each
// time the engine loop's thread holds it, which made a pull of 24 copies 10x slower beside a
// busy decode loop.
#include <ATen/ATen.h>

#include <vector>

// src[i] and dst[i]: [num_blocks, ...] with the same shape past dim 0 and the same dtype (views
// of a cache, a head slice included); runs: (src block, dst block, count) triples, each copied
// from src[i] into dst[i] for every i. Returns the bytes copied.
int64_t copy_block_runs(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst,
                        const std::vector<int64_t>& runs) {
  TORCH_CHECK(src.size() == dst.size(), "copy_block_runs: ", src.size(), " sources for ", dst.size(),
              " destinations");
  TORCH_CHECK(runs.size() % 3 == 0, "copy_block_runs: runs are (src, dst, count) triples");
  int64_t nbytes = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    const at::Tensor& s = src[i];
    const at::Tensor& d = dst[i];
    TORCH_CHECK(s.dim() >= 1 && s.dim() == d.dim() && s.sizes().slice(1) == d.sizes().slice(1) &&
                s.scalar_type() == d.scalar_type() && s.device().is_cpu() && d.device().is_cpu(),
                "copy_block_runs: tensor ", i, "'s source and destination differ past their blocks");
    for (size_t r = 0; r < runs.size(); r += 3) {
      const int64_t s0 = runs[r], d0 = runs[r + 1], n = runs[r + 2];
      TORCH_CHECK(n > 0 && s0 >= 0 && d0 >= 0 && s0 + n <= s.size(0) && d0 + n <= d.size(0),
                  "copy_block_runs: blocks ", s0, "+", n, " -> ", d0, "+", n, " outside the caches (",
                  s.size(0), " and ", d.size(0), " blocks)");
    }
  }
  for (size_t i = 0; i < src.size(); ++i) {
    for (size_t r = 0; r < runs.size(); r += 3) {
      at::Tensor to = dst[i].narrow(0, runs[r + 1], runs[r + 2]);
      to.copy_(src[i].narrow(0, runs[r], runs[r + 2]));
      nbytes += to.numel() * to.element_size();
    }
  }
  return nbytes;
}
