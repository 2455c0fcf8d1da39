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
void set_pool(int64_t threads, const std::vector<int64_t>& cores, int64_t spin_us);
at::Tensor host_empty(at::IntArrayRef sizes, at::ScalarType dtype);
at::Tensor host_empty_on(at::IntArrayRef sizes, at::ScalarType dtype, int64_t node);
int64_t host_page_node(const at::Tensor& t);
void host_pool_keep(int64_t bytes);
std::tuple<int64_t, int64_t> host_pool_reserve(int64_t bytes, int64_t threads, int64_t chunk);
std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> host_pool_stats();
void copy_bytes(at::Tensor& dst, const at::Tensor& src, int64_t threads);
}  // namespace nelssa

namespace {
pybind11::dict split_dict(const nelssa::KernelSplit& k) {  // seconds by part (common.h KernelSplit)
  pybind11::dict d;
  d["prep"] = k.prep, d["fork"] = k.fork, d["tables"] = k.tables, d["items"] = k.items, d["wait"] = k.wait;
  d["combine"] = k.combine;
  return d;
}
}  // namespace

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
  m.def("last_kernel_split", [] { return split_dict(nelssa::last_kernel_split()); },
        "this thread's last sparse_attention by part (seconds; common.h KernelSplit)");
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
           py::arg("ops") = 3,
           "enqueue on the CUDA stream as stream memory operations on the call's flags, served by the "
           "extension's poller thread (csrc/flag_wait.cpp); arm=False while the stream captures; ops: 1 the "
           "ready write (and the arming) alone, 2 the wait for done alone, 3 both (flag_wait.cpp, 1b)")
      .def("arm_flags_for_test", &nelssa::arm_flags_for_test,
           "tests without a GPU: give the call its flags, arm it -> (ready, done) host addresses (int32)")
      .def_property_readonly("state", [](const nelssa::HostCall& c) { return std::string(nelssa::host_call_state(c)); })
      .def_property_readonly("error", [](const nelssa::HostCall& c) { return c.error; })
      .def_property_readonly("value_error", [](const nelssa::HostCall& c) { return c.value_error; },
                             "whether the failure was the kernel's ValueError (bad input, e.g. NaN queries)")
      .def_property_readonly("seconds", [](const nelssa::HostCall& c) { return c.seconds; })
      .def_property_readonly("started", [](const nelssa::HostCall& c) { return c.started; },
                             "when run() began (s, CLOCK_MONOTONIC: time.perf_counter's clock on Linux); 0: not run")
      .def_property_readonly("ended", [](const nelssa::HostCall& c) { return c.ended; },
                             "when run() returned (s, the same clock); 0: not run")
      .def_property_readonly("kernel_split", [](const nelssa::HostCall& c) -> py::object {
        if (c.remote || c.seconds == 0) return py::none();
        return split_dict(c.split);
      }, "a local call's last run by part (seconds; common.h KernelSplit); None for a remote or unrun call")
      .def_property_readonly("node_times", [](const nelssa::HostCall& c) -> py::object {
        if (!c.remote) return py::none();
        return py::make_tuple(c.remote->node_s, c.remote->kernel_s, c.remote->wait_s);
      }, "a remote call's last answer: (node seconds, slowest kernel seconds, seconds from its post until the "
         "answer was seen here); None for a local call")
      .def_static("remote", [](std::shared_ptr<nelssa::NodeChannel> ch, uint64_t plan, uint64_t layer,
                               std::vector<int64_t> dims, std::vector<int64_t> bounds, std::vector<int64_t> q_off,
                               std::vector<int64_t> ids_off, std::vector<int64_t> counts_off,
                               std::vector<int64_t> out_off, std::vector<int64_t> lse_off, double timeout_s,
                               at::Tensor q, std::vector<at::Tensor> sel, std::vector<at::Tensor> nsel, at::Tensor out,
                               at::Tensor lse, std::shared_ptr<nelssa::CancelFlag> cancel, std::string fault) {
             TORCH_CHECK(ch && dims.size() == 6, "remote: a channel and dims (B, Hq, H, D, S, q_itemsize)");
             auto j = std::make_shared<nelssa::RemoteJob>();
             j->channel = std::move(ch), j->plan = plan, j->layer = layer;
             j->B = dims[0], j->Hq = dims[1], j->H = dims[2], j->D = dims[3], j->S = dims[4], j->q_itemsize = dims[5];
             TORCH_CHECK(j->H > 0 && j->Hq % j->H == 0, "remote: query heads must be a multiple of KV heads");
             j->bounds = std::move(bounds), j->q_off = std::move(q_off), j->ids_off = std::move(ids_off);
             j->counts_off = std::move(counts_off), j->out_off = std::move(out_off), j->lse_off = std::move(lse_off);
             j->timeout_s = timeout_s;
             auto c = std::make_shared<nelssa::HostCall>();
             c->q = std::move(q), c->sel = std::move(sel), c->nsel = std::move(nsel);
             c->out = std::move(out), c->lse = std::move(lse), c->cancel = std::move(cancel);
             c->fault = std::move(fault), c->remote = std::move(j);
             return c;
           },
           py::arg("channel"), py::arg("plan"), py::arg("layer"), py::arg("dims"), py::arg("bounds"), py::arg("q_off"),
           py::arg("ids_off"), py::arg("counts_off"), py::arg("out_off"), py::arg("lse_off"), py::arg("timeout_s"),
           py::arg("q"), py::arg("sel"), py::arg("nsel"), py::arg("out"), py::arg("lse"), py::arg("cancel") = nullptr,
           py::arg("fault") = "",
           "a call whose work nelssa-node does through a native channel (csrc/node_plane.cpp, 3); the "
           "offsets are wire.plan_layout's");
  py::class_<nelssa::PlanTable, std::shared_ptr<nelssa::PlanTable>>(
      m, "PlanTable", "nelssa-node: one client's plans, shared by its native channels' responders")
      .def(py::init(&nelssa::make_plan_table))
      .def("add", &nelssa::plan_table_add, py::arg("plan"), py::arg("layers"),
           "layers[l][d]: the prepared HostCall of layer l on device d (None: no heads there)")
      .def("drop", &nelssa::plan_table_drop, py::arg("plan"))
      .def("__len__", &nelssa::plan_table_size);
  py::class_<nelssa::NodeChannel, std::shared_ptr<nelssa::NodeChannel>>(
      m, "NodeChannel", "a client's end of a native nelssa-node channel (csrc/node_plane.cpp)")
      .def(py::init(&nelssa::attach_node_channel), py::arg("mem"), py::arg("slot"), py::arg("stale_s"),
           py::arg("spin_us") = 20, py::arg("margin_us") = 0,
           "spin_us: a waiting job polls this long (past 20 us yielding its core) before it naps; margin_us: and "
           "from this long before its answer is expected (0: naps only)")
      .def_property("margin_us", [](const nelssa::NodeChannel& c) { return c.margin_ns.load() / 1000; },
                    [](nelssa::NodeChannel& c, int64_t us) {
                      TORCH_CHECK(us >= 0, "margin_us must be >= 0");
                      c.margin_ns.store(us * 1000);
                    })
      .def_property_readonly("expect_us", [](const nelssa::NodeChannel& c) { return c.expect_ns.load() / 1000; },
                             "when the next answer is expected (us after its post): the recent waits' moving average")
      .def_property_readonly("broken", &nelssa::node_channel_broken);
  m.def("install_fatal_trace", &nelssa::install_fatal_trace,
        "on a fatal signal, write the native frames of the crashing thread to stderr (then die as before)");
  m.def("native_header_words", &nelssa::native_header_words,
        "the native channel's header word indices, header bytes, magic and version (wire.py must match)");
  py::class_<nelssa::DeviceGroup, std::shared_ptr<nelssa::DeviceGroup>>(
      m, "DeviceGroup", "nelssa-node's emulated devices: one native worker per device, pinned to its cores; "
                        "see csrc/device_group.cpp for the contract")
      .def(py::init<const std::vector<std::vector<int64_t>>&, int64_t>(), py::arg("cores"), py::arg("spin_us") = 0)
      .def("run", &nelssa::DeviceGroup::run, release(), py::arg("calls"),
           "calls[i] (a prepared HostCall or None) on device i; returns when all returned")
      .def("close", &nelssa::DeviceGroup::close, release())
      .def("__len__", &nelssa::DeviceGroup::size);
  py::class_<nelssa::ShmResponder, std::shared_ptr<nelssa::ShmResponder>>(
      m, "ShmResponder", "nelssa-node's native thread serving one client's channel (csrc/node_plane.cpp)")
      .def(py::init<at::Tensor, int64_t, std::shared_ptr<nelssa::DeviceGroup>, std::shared_ptr<nelssa::PlanTable>,
                    int64_t, int64_t>(),
           py::arg("mem"), py::arg("slot"), py::arg("group"), py::arg("plans"), py::arg("spin_us"), py::arg("sleep_us"))
      .def("stop", &nelssa::ShmResponder::stop, release())
      .def("counts", &nelssa::ShmResponder::counts, "(jobs, errors) answered");
  m.def("make_host_call_flags", &nelssa::make_host_call_flags,
        "make the host calls' flags now, with this thread's CUDA context current and outside any stream capture "
        "(csrc/flag_wait.cpp, 1a) -> whether they are device-mapped (False: no CUDA context, as on CPU)");
  m.def("wait_event", &nelssa::wait_event, release(), py::arg("event"), py::arg("timeout_s"),
        "wait, without the GIL, until the CUDA event (torch.cuda.Event.cuda_event) completed -> True, or "
        "timeout_s passed -> False");
  m.def("copy_rows", &nelssa::copy_rows, release(), "dst[h, di[h,i]] = src[h, si[h,i]]");
  m.def("read_bandwidth", &nelssa::read_bandwidth, release(), "(seconds, checksum) to read buf iters times");
  m.def("block_read", &nelssa::block_read, release(),
        "(seconds, checksum) to read nblocks random blocks of buf (pf_hint -1: no software prefetch)",
        py::arg("buf"), py::arg("block_bytes"), py::arg("nblocks"), py::arg("seed") = 0, py::arg("pf_hint") = -1);
  m.def("host_empty", &nelssa::host_empty, release(), "uninitialised host-tier tensor on huge pages");
  m.def("host_empty_on", &nelssa::host_empty_on, release(), py::arg("sizes"), py::arg("dtype"), py::arg("node"),
        "uninitialised host-tier tensor bound to a NUMA node (host_pool.cpp, 6)");
  m.def("host_page_node", &nelssa::host_page_node, release(), py::arg("t"),
        "NUMA node of the page holding the tensor's first byte, -1 without NUMA support (host_pool.cpp, 6)");
  m.def("host_pool_keep", &nelssa::host_pool_keep, release(), py::arg("bytes"),
        "host-tier memory kept mapped when freed, for reuse (csrc/host_pool.cpp, 2)");
  m.def("host_pool_reserve", &nelssa::host_pool_reserve, release(), py::arg("bytes"), py::arg("threads"),
        py::arg("chunk"), "map and touch host-tier memory now, handed out as touched (host_pool.cpp, 3) -> (address, bytes)");
  m.def("copy_bytes", &nelssa::copy_bytes, release(), py::arg("dst"), py::arg("src"), py::arg("threads"),
        "dst = src bytewise with `threads` threads (host_pool.cpp, 5)");
  m.def("host_pool_stats", &nelssa::host_pool_stats, "(used, free, reserved bytes, hits, misses) (host_pool.cpp, 4)");
  m.def("set_pool", &nelssa::set_pool, release(), py::arg("threads"), py::arg("cores"), py::arg("spin_us") = 0,
        "threads, optional core pinning and the team's spin before sleeping (us) for the kernels");
#if defined(__AVX512F__)
  m.attr("isa") = "avx512";
#elif defined(__AVX2__)
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "generic";
#endif
}
