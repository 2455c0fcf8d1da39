// Python bindings of nelssa._C. Every kernel releases the GIL while it runs.
#include "common.h"

namespace nelssa {
std::tuple<at::Tensor, at::Tensor> sparse_attention(
    const at::Tensor& q, const std::vector<std::vector<at::Tensor>>& parts, const std::vector<at::Tensor>& cpart,
    const std::vector<at::Tensor>& cstart, const std::vector<at::Tensor>& csize, const std::vector<at::Tensor>& sel,
    const std::vector<at::Tensor>& nsel, double scale, int64_t work_tokens, bool touch_only,
    int64_t prefetch_rows, int64_t prefetch_hint, bool pin_out);
void copy_rows(const at::Tensor& src, const at::Tensor& si, at::Tensor& dst, const at::Tensor& di);
std::tuple<double, double> read_bandwidth(const at::Tensor& buf, int64_t iters);
std::tuple<double, double> block_read(const at::Tensor& buf, int64_t block_bytes, int64_t nblocks, int64_t seed,
                                      int64_t pf_hint);
void set_pool(int64_t threads, const std::vector<int64_t>& cores);
at::Tensor host_empty(at::IntArrayRef sizes, at::ScalarType dtype);
}  // namespace nelssa

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  m.doc() = "NELSSA CPU kernels (C++17/OpenMP)";
  m.def("sparse_attention", &nelssa::sparse_attention, release(),
        "Fused sparse attention over selected clusters -> (out [B,Hq,D] fp32, lse [B,Hq] fp32, natural log); "
        "touch_only: read the selected rows in the same order without computing (bandwidth probe); pin_out: "
        "outputs in pinned memory; NaN/Inf in the results raise ValueError",
        py::arg("q"), py::arg("parts"), py::arg("cpart"), py::arg("cstart"), py::arg("csize"), py::arg("sel"),
        py::arg("nsel"), py::arg("scale"), py::arg("work_tokens"), py::arg("touch_only"), py::arg("prefetch_rows"),
        py::arg("prefetch_hint"), py::arg("pin_out"));  // no defaults: the caller passes the config's (nelssa.sparse.attend)
  m.def("copy_rows", &nelssa::copy_rows, release(), "dst[h, di[h,i]] = src[h, si[h,i]]");
  m.def("read_bandwidth", &nelssa::read_bandwidth, release(), "(seconds, checksum) to read buf iters times");
  m.def("block_read", &nelssa::block_read, release(),
        "(seconds, checksum) to read nblocks random blocks of buf (pf_hint -1: no software prefetch)",
        py::arg("buf"), py::arg("block_bytes"), py::arg("nblocks"), py::arg("seed") = 0, py::arg("pf_hint") = -1);
  m.def("host_empty", &nelssa::host_empty, release(), "uninitialised host-tier tensor on huge pages");
  m.def("set_pool", &nelssa::set_pool, release(), "threads and optional core pinning for the kernels");
#if defined(__AVX512F__)
  m.attr("isa") = "avx512";
#elif defined(__AVX2__)
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "generic";
#endif
}
