// A host attention call prepared on the caller's thread and run later, on the stream it belongs to.
//
// The contract (the long lane's per-layer host job, nelssa/vllm_plugin/lane_host.py):
//   1. prepare: the caller builds a HostCall with every argument of sparse_attention_into, including
//      the outputs (preallocated fp32, pinned on CUDA builds: the device copies them back by DMA) and,
//      optionally, a CancelFlag shared by the calls of one batch.
//   2. launch(call, stream): cuLaunchHostFunc enqueues the call on a CUDA stream. The driver runs it on
//      its callback thread once the stream's earlier work (the queries' and selected ids' copies to
//      pinned memory) is done, and the stream's later work (the results' copies to the device) starts
//      only after it returned: the device waits for the host tier without any caller thread waiting,
//      and no Python runs between the two. (Or run(call) on the caller's thread: CPU, tests.)
//   3. run never throws and allocates no tensor (CUDA API calls are not allowed in a host function):
//      a failure (bad selection, NaN/Inf, injected fault) is kept as state "failed" with its message
//      and the outputs are filled with NaN, so nothing downstream can pass for an answer; a set
//      CancelFlag makes it return at once (state "skipped": every request of the batch is gone).
//   4. the caller keeps the call (its Python object) until the stream has passed it (a stream or
//      event synchronisation), then reads state, error, seconds and when it ran (started, ended: the
//      steady clock, CLOCK_MONOTONIC like Python's time.perf_counter on Linux).
//   5. Captured into a CUDA graph (launch_borrowed while the stream captures: a host node), a call
//      runs at every replay: the graph's owner keeps it as long as the graph, re-arms it before each
//      replay (state "launched") and reads its state after the replay, as in 4.
//   6. Or launch_flags (flag_wait.cpp): the device waits on flags that a thread of ours serves, and the
//      driver's worker thread never runs host attention (config lane_host_wait "flags").
#include "common.h"

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <memory>
#include <string>
#include <thread>

namespace nelssa {

void sparse_attention_into(
    const at::Tensor& q, const std::vector<std::vector<at::Tensor>>& parts, const std::vector<at::Tensor>& cpart,
    const std::vector<at::Tensor>& cstart, const std::vector<at::Tensor>& csize, const std::vector<at::Tensor>& sel,
    const std::vector<at::Tensor>& nsel, double scale, int64_t work_tokens, bool touch_only,
    int64_t prefetch_rows, int64_t prefetch_hint, at::Tensor& out, at::Tensor& lse);

enum CallState : int { PREPARED = 0, LAUNCHED = 1, DONE = 2, FAILED = 3, SKIPPED = 4 };

namespace {
double steady_seconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}
}  // namespace

void HostCall::run() noexcept {
  const auto t0 = std::chrono::steady_clock::now();
  started = ended = steady_seconds(t0);
  if (cancel && cancel->is_set.load(std::memory_order_acquire)) {
    state.store(SKIPPED, std::memory_order_release);
    return;
  }
  int st = DONE;
  try {
    if (!fault.empty()) throw std::runtime_error(fault);
    if (remote) {
      remote->run(*this);  // nelssa-node does the work (node_plane.cpp, 3)
    } else {
      sparse_attention_into(q, parts, cpart, cstart, csize, sel, nsel, scale, work_tokens, false, prefetch_rows,
                            prefetch_hint, out, lse);
      split = last_kernel_split();
    }
  } catch (const c10::ValueError& e) {  // bad input (e.g. NaN queries): the caller's to report as such
    error = e.what_without_backtrace(), st = FAILED, value_error = true;
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace(), st = FAILED;
  } catch (const std::exception& e) {
    error = e.what(), st = FAILED;
  } catch (...) {
    error = "unknown error", st = FAILED;
  }
  if (st == FAILED) {  // never a plausible result: NaN where the outputs are well-formed
    const float nan = std::numeric_limits<float>::quiet_NaN();
    if (out.defined() && out.is_contiguous() && out.scalar_type() == at::kFloat && out.device().is_cpu())
      std::fill(out.data_ptr<float>(), out.data_ptr<float>() + out.numel(), nan);
    if (lse.defined() && lse.is_contiguous() && lse.scalar_type() == at::kFloat && lse.device().is_cpu())
      std::fill(lse.data_ptr<float>(), lse.data_ptr<float>() + lse.numel(), nan);
  }
  const auto t1 = std::chrono::steady_clock::now();
  seconds = std::chrono::duration<double>(t1 - t0).count();
  ended = steady_seconds(t1);
  state.store(st, std::memory_order_release);
}

namespace {

extern "C" void nelssa_host_call_trampoline(void* p) {
  auto* call = static_cast<std::shared_ptr<HostCall>*>(p);
  (*call)->run();
  delete call;  // the caller still holds the call (4): this never frees its tensors here
}

template <typename F>
F driver_symbol(const char* name) {
  return reinterpret_cast<F>(cuda_driver_symbol(name));
}

using LaunchHostFunc = int (*)(void* stream, void (*fn)(void*), void* user_data);

LaunchHostFunc driver_launch() {
  static LaunchHostFunc fn = driver_symbol<LaunchHostFunc>("cuLaunchHostFunc");
  return fn;
}

}  // namespace

void* cuda_driver_symbol(const char* name, const char* fallback) {
  static void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return nullptr;
  void* p = dlsym(lib, name);
  return p != nullptr || fallback == nullptr ? p : dlsym(lib, fallback);
}

void mark_launched(HostCall& call) {
  int expected = PREPARED;
  TORCH_CHECK(call.state.compare_exchange_strong(expected, LAUNCHED), "a host call runs once");
}

void launch_host_call(const std::shared_ptr<HostCall>& call, int64_t stream) {
  LaunchHostFunc fn = driver_launch();
  TORCH_CHECK(fn != nullptr, "cuLaunchHostFunc is not available: no CUDA driver (libcuda.so.1) in this process");
  mark_launched(*call);
  auto* p = new std::shared_ptr<HostCall>(call);
  const int r = fn(reinterpret_cast<void*>(stream), &nelssa_host_call_trampoline, p);
  if (r != 0) {
    delete p;
    call->state.store(PREPARED);
    TORCH_CHECK(false, "cuLaunchHostFunc failed (CUresult ", r, ")");
  }
}

namespace {
extern "C" void nelssa_host_call_borrowed(void* p) { static_cast<HostCall*>(p)->run(); }
}  // namespace

void launch_host_call_borrowed(const std::shared_ptr<HostCall>& call, int64_t stream) {
  LaunchHostFunc fn = driver_launch();
  TORCH_CHECK(fn != nullptr, "cuLaunchHostFunc is not available: no CUDA driver (libcuda.so.1) in this process");
  const int r = fn(reinterpret_cast<void*>(stream), &nelssa_host_call_borrowed, call.get());
  TORCH_CHECK(r == 0, "cuLaunchHostFunc failed (CUresult ", r, ")");
}

void rearm_host_call(HostCall& call) {
  call.error.clear();
  call.value_error = false;
  call.seconds = call.started = call.ended = 0;
  call.state.store(LAUNCHED, std::memory_order_release);
  rearm_flags(call);  // served by flags (flag_wait.cpp): counts as armed again
}

HostCall::~HostCall() { release_flag_slot(flag_slot); }

bool wait_event(int64_t event, double timeout_s) {
  using Query = int (*)(void* event);
  static Query query = driver_symbol<Query>("cuEventQuery");
  TORCH_CHECK(query != nullptr, "cuEventQuery is not available: no CUDA driver (libcuda.so.1) in this process");
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0;; ++i) {
    const int r = query(reinterpret_cast<void*>(event));
    if (r == 0) return true;
    TORCH_CHECK(r == 600, "cuEventQuery failed (CUresult ", r, ")");  // 600: CUDA_ERROR_NOT_READY
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_s) return false;
    if (i < 64) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void run_host_call(const std::shared_ptr<HostCall>& call) {
  mark_launched(*call);
  call->run();
}

const char* host_call_state(const HostCall& call) {
  static const char* names[] = {"prepared", "launched", "done", "failed", "skipped"};
  return names[call.state.load(std::memory_order_acquire)];
}

}  // namespace nelssa
