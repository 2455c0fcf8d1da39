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
  py::class_<nelssa::CancelFlag, std::shared_ptr<nelssa::CancelFlag>>(
      m, "CancelFlag", "Shared by the host calls of one batch: set, they return without computing")
      .def(py::init<>())
      .def("set", [](nelssa::CancelFlag& f) { f.is_set.store(true); })
      .def("is_set", [](const nelssa::CancelFlag& f) { return f.is_set.load(); })
      .def("clear", [](nelssa::CancelFlag& f) { f.is_set.store(false); });
  py::class_<nelssa::HostCall, std::shared_ptr<nelssa::HostCall>>(
      m, "HostCall", "sparse_attention prepared now, run later on a CUDA stream (launch) or here (run); "
                     "see csrc/host_call.cpp for the contract")
      .def(py::init([](at::Tensor q, std::vector<std::vector<at::Tensor>> parts, std::vector<at::Tensor> cpart,
                       std::vector<at::Tensor> cstart, std::vector<at::Tensor> csize, std::vector<at::Tensor> sel,
                       std::vector<at::Tensor> nsel, double scale, int64_t work_tokens, int64_t prefetch_rows,
                       int64_t prefetch_hint, at::Tensor out, at::Tensor lse,
                       std::shared_ptr<nelssa::CancelFlag> cancel, std::string fault) {
             auto c = std::make_shared<nelssa::HostCall>();
             c->q = std::move(q), c->parts = std::move(parts), c->cpart = std::move(cpart);
             c->cstart = std::move(cstart), c->csize = std::move(csize), c->sel = std::move(sel);
             c->nsel = std::move(nsel), c->scale = scale, c->work_tokens = work_tokens;
             c->prefetch_rows = prefetch_rows, c->prefetch_hint = prefetch_hint;
             c->out = std::move(out), c->lse = std::move(lse), c->cancel = std::move(cancel);
             c->fault = std::move(fault);
             return c;
           }),
           py::arg("q"), py::arg("parts"), py::arg("cpart"), py::arg("cstart"), py::arg("csize"), py::arg("sel"),
           py::arg("nsel"), py::arg("scale"), py::arg("work_tokens"), py::arg("prefetch_rows"),
           py::arg("prefetch_hint"), py::arg("out"), py::arg("lse"), py::arg("cancel") = nullptr,
           py::arg("fault") = "")
      .def("launch", &nelssa::launch_host_call, release(), py::arg("stream"),
           "enqueue on the CUDA stream (its handle, torch.cuda.Stream.cuda_stream)")
      .def("run", &nelssa::run_host_call, release(), "run on this thread now")
      .def("launch_borrowed", &nelssa::launch_host_call_borrowed, release(), py::arg("stream"),
           "enqueue without handing the call to the driver (for graph capture: kept by the graph's owner)")
      .def("rearm", &nelssa::rearm_host_call, "before a graph replay: state 'launched', error cleared")
      .def("launch_flags", &nelssa::launch_host_call_flags, release(), py::arg("stream"), py::arg("arm") = true,
           "enqueue on the CUDA stream as stream memory operations on the call's flags, served by the "
           "extension's poller thread (csrc/flag_wait.cpp); arm=False while the stream captures")
      .def("arm_flags_for_test", &nelssa::arm_flags_for_test,
           "tests without a GPU: give the call its flags, arm it -> (ready, done) host addresses (int32)")
      .def_property_readonly("state", [](const nelssa::HostCall& c) { return std::string(nelssa::host_call_state(c)); })
      .def_property_readonly("error", [](const nelssa::HostCall& c) { return c.error; })
      .def_property_readonly("value_error", [](const nelssa::HostCall& c) { return c.value_error; },
                             "whether the failure was the kernel's ValueError (bad input, e.g. NaN queries)")
      .def_property_readonly("seconds", [](const nelssa::HostCall& c) { return c.seconds; });
  py::class_<nelssa::DeviceGroup, std::shared_ptr<nelssa::DeviceGroup>>(
      m, "DeviceGroup", "nelssa-node's emulated devices: one native worker per device, pinned to its cores; "
                        "see csrc/device_group.cpp for the contract")
      .def(py::init<const std::vector<std::vector<int64_t>>&, int64_t>(), py::arg("cores"), py::arg("spin_us") = 0)
      .def("run", &nelssa::DeviceGroup::run, release(), py::arg("calls"),
           "calls[i] (a prepared HostCall or None) on device i; returns when all returned")
      .def("close", &nelssa::DeviceGroup::close, release())
      .def("__len__", &nelssa::DeviceGroup::size);
  m.def("wait_event", &nelssa::wait_event, release(), py::arg("event"), py::arg("timeout_s"),
        "wait, without the GIL, until the CUDA event (torch.cuda.Event.cuda_event) completed -> True, or "
        "timeout_s passed -> False");
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
