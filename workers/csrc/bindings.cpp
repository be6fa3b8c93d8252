// The module's functions; each lives in its own source file. Only this one includes
// torch/extension.h (pybind11 and torch's Python API, ~3x the compile time of ATen alone).
#include <torch/extension.h>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor cu_seqlens_q, torch::Tensor context_lens,
                              torch::Tensor block_tables, double scale);
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
void rope_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                    torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads, int64_t num_kv_heads);
int64_t copy_block_runs(const std::vector<torch::Tensor>& src, const std::vector<torch::Tensor>& dst,
                        const std::vector<int64_t>& runs);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a block table (CPU, fp32)");
  m.def("linear", &linear, "x W^T (+ b) for a few rows of x, at the weights' read bandwidth (CPU, fp32)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none());
  m.def("rms_norm", &rms_norm, "Llama's RMSNorm over each row (CPU, fp32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(first half) * second half of each row (CPU, fp32)");
  m.def("rope_and_cache", &rope_and_cache,
        "rotate a step's q and k in place and store its k and v at their cache slots (CPU, fp32)");
  // Without Python's lock for the whole call (the arguments are converted before it is let go).
  m.def("copy_block_runs", &copy_block_runs,
        "copy (src block, dst block, count) runs from each source tensor into its destination (CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
