// Shared helpers for the NELSSA CPU kernels: dtype loads, vector exp2, the thread pool settings.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <type_traits>
#include <functional>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace nelssa {

// ---- element loads: any KV dtype -> fp32 (loops auto-vectorise with -O3 -march=...) ----
inline void to_f32(const float* __restrict s, float* __restrict d, int n) { std::memcpy(d, s, n * sizeof(float)); }

inline void to_f32(const at::BFloat16* __restrict s, float* __restrict d, int n) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(s);
  uint32_t* o = reinterpret_cast<uint32_t*>(d);
#pragma omp simd
  for (int i = 0; i < n; ++i) o[i] = static_cast<uint32_t>(u[i]) << 16;
}

inline void to_f32(const at::Half* __restrict s, float* __restrict d, int n) {
#if defined(__AVX512F__)
  int i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i))));
  for (; i < n; ++i) d[i] = static_cast<float>(s[i]);
#else
  for (int i = 0; i < n; ++i) d[i] = static_cast<float>(s[i]);
#endif
}

// ---- exp2 over a block of lanes; x = -inf gives 0 ----
#if defined(__AVX512F__)
inline __m512 exp2_ps(__m512 x) {
  // 2^x = 2^round(x) * 2^f, f in [-0.5, 0.5]; degree-6 fit, max rel. error 2e-9 (+ fp32 rounding)
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.f));
  __m512 xi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(x, xi);
  __m512 p = _mm512_set1_ps(1.5337577497120947e-04f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3399859890341759e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618519805371761e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550329014658928e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022646248340607e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471824645996e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, xi);
}
#endif

// y[i] = 2^(x[i] - m) for i < n (n <= 16)
inline void exp2_shift16(const float* x, float m, float* y, int n) {
#if defined(__AVX512F__)
  __mmask16 k = static_cast<__mmask16>((1u << n) - 1u);
  __m512 v = _mm512_maskz_loadu_ps(k, x);
  __m512 r = exp2_ps(_mm512_sub_ps(v, _mm512_set1_ps(m)));
  _mm512_storeu_ps(y, _mm512_maskz_mov_ps(k, r));
#else
  for (int i = 0; i < n; ++i) y[i] = std::exp2(x[i] - m);
  for (int i = n; i < 16; ++i) y[i] = 0.f;
#endif
}

// ---- software prefetch: HINT = __builtin_prefetch locality (0 NTA, 1 T2, 3 T0), -1 = none ----
inline bool valid_prefetch_hint(int64_t hint) { return hint == -1 || hint == 0 || hint == 1 || hint == 3; }

template <int HINT>
inline void prefetch_bytes(const void* p, int64_t bytes) {
  if constexpr (HINT >= 0)
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o, 0, HINT);
}

// f(std::integral_constant<int, HINT>{}) for a runtime hint: the hint is a template argument of the
// loops it sits in.
template <typename F>
inline void with_prefetch_hint(int64_t hint, F&& f) {
  switch (hint) {
    case -1: f(std::integral_constant<int, -1>{}); break;
    case 0: f(std::integral_constant<int, 0>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: TORCH_CHECK(false, "prefetch hint must be one of -1 (none), 0 (NTA), 1 (T2), 3 (T0), got ", hint);
  }
}

// ---- polling: the steady clock in ns (CLOCK_MONOTONIC: Python's time.monotonic_ns) and a spin pause ----
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
// Spin until pred() or spin_us passed -> pred() (spin_us <= 0: one check).
template <typename P>
bool spin_until(int64_t spin_us, P pred) {
  if (pred()) return true;
  if (spin_us <= 0) return false;
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  for (int i = 0;; ++i) {
    for (int k = 0; k < 64; ++k) cpu_relax();
    if (pred()) return true;
    if ((i & 15) == 15 && std::chrono::steady_clock::now() > end) return pred();
  }
}

// ---- host attention pool: threads and optional core pinning (set from Python once) ----
struct PoolSettings {
  int threads = 1;
  std::vector<int> cores;  // empty: no pinning
  int64_t spin_us = 0;     // host_team.cpp 3: a team worker spins this long for the next call before it sleeps
  int generation = 0;
};
PoolSettings& pool();

// ---- the host attention call's thread team (host_team.cpp has the contract) ----
class HostTeam;
HostTeam& host_team();                                         // the calling thread's team (1)
void team_run(HostTeam& t, const std::function<void(int)>& fn);  // every member runs fn(member) (2)
void team_barrier(HostTeam& t);                                 // inside a run: all members meet (4)
int team_size(const HostTeam& t);

#define NELSSA_DISPATCH_KV(DT, NAME, ...)                                          \
  [&] {                                                                           \
    if ((DT) == at::kBFloat16) { using scalar_t = at::BFloat16; return __VA_ARGS__(); } \
    if ((DT) == at::kHalf) { using scalar_t = at::Half; return __VA_ARGS__(); }    \
    if ((DT) == at::kFloat) { using scalar_t = float; return __VA_ARGS__(); }      \
    TORCH_CHECK(false, NAME ": unsupported KV dtype ", DT);                        \
  }()

// ---- a prepared host attention call (host_call.cpp has the contract) ----
struct CancelFlag {
  std::atomic<bool> is_set{false};
};

struct RemoteJob;  // node_plane.cpp: the call's work done by nelssa-node through a native channel

// Where the calling thread's last sparse_attention_into went (seconds; the parts add up to its wall time):
// prep (checks, queries), fork (until the last pool thread entered the parallel region), tables (the
// selected clusters' spans and work items, less fork), items (the fused pass: the pool threads' mean busy
// time), wait (the fused pass's wall time beyond that: imbalance, threads descheduled), combine (the LSE
// merge and the region's end).
struct KernelSplit {
  double prep = 0, fork = 0, tables = 0, items = 0, wait = 0, combine = 0;
};
const KernelSplit& last_kernel_split();

struct HostCall {
  at::Tensor q;
  std::vector<std::vector<at::Tensor>> parts;
  std::vector<at::Tensor> cpart, cstart, csize, sel, nsel;
  double scale = 1.0;
  int64_t work_tokens = 0, prefetch_rows = 0, prefetch_hint = -1;
  at::Tensor out, lse;                  // fp32 outputs, written in place
  std::shared_ptr<CancelFlag> cancel;   // optional: set -> the call returns at once ("skipped")
  std::string fault;                    // non-empty: fails with this message (fault injection)
  std::atomic<int> state{0};            // prepared, launched, done, failed, skipped
  std::string error;                    // a failed call's message
  bool value_error = false;             // ... raised as a ValueError (bad input) by the kernel
  double seconds = 0;                   // time in the kernel
  KernelSplit split;                    // ... by part (a local call's last run)
  double started = 0, ended = 0;        // when run() began and returned (steady clock = CLOCK_MONOTONIC, s):
                                        // the lane's batch timeline (lane_host.timeline)
  int flag_slot = -1;                   // launch_flags: its ready/done flags (flag_wait.cpp), for its lifetime
  std::shared_ptr<RemoteJob> remote;    // set: run() is a round trip to nelssa-node (node_plane.cpp, 3)
  void run() noexcept;
  ~HostCall();
};
void launch_host_call(const std::shared_ptr<HostCall>& call, int64_t stream);  // on a CUDA stream
void run_host_call(const std::shared_ptr<HostCall>& call);                     // here, now
void launch_host_call_borrowed(const std::shared_ptr<HostCall>& call, int64_t stream);  // graph capture
void rearm_host_call(HostCall& call);
void mark_launched(HostCall& call);  // prepared -> launched, or "a host call runs once"
// a CUDA driver entry point (or its fallback name), looked up in libcuda.so.1 (the extension links no
// CUDA library: CPU builds of torch load it too); nullptr without a driver
void* cuda_driver_symbol(const char* name, const char* fallback = nullptr);
// the device waits for the call through flags a thread of ours serves (flag_wait.cpp has the contract)
void launch_host_call_flags(const std::shared_ptr<HostCall>& call, int64_t stream, bool arm, int64_t ops = 3);
void rearm_flags(HostCall& call);
void release_flag_slot(int slot);
std::pair<int64_t, int64_t> arm_flags_for_test(const std::shared_ptr<HostCall>& call);
bool make_host_call_flags();  // the flags now (this thread's CUDA context; outside a capture): mapped?
bool wait_event(int64_t event, double timeout_s);  // a CUDA event completed within timeout_s (no GIL)
const char* host_call_state(const HostCall& call);

// ---- nelssa-node's emulated devices: native workers running prepared calls (device_group.cpp) ----
class DeviceGroup {
 public:
  DeviceGroup(const std::vector<std::vector<int64_t>>& cores, int64_t spin_us);
  ~DeviceGroup();
  void run(const std::vector<std::shared_ptr<HostCall>>& calls);  // calls[i] on device i; waits for all
  // as run, returning once queued; done() runs on the worker that finishes the last call (device_group.cpp 6)
  void submit(const std::vector<std::shared_ptr<HostCall>>& calls, std::function<void()> done);
  void close();
  int64_t size() const;

 private:
  void enqueue(const std::vector<std::shared_ptr<HostCall>>& calls, const std::shared_ptr<void>& batch);
  struct Impl;
  std::unique_ptr<Impl> impl;
};

// ---- nelssa-node's native data plane (node_plane.cpp has the contract) ----
struct Plan {
  std::vector<std::vector<std::shared_ptr<HostCall>>> layers;  // [layer][device] (nullptr: no heads there)
};
struct PlanTable {
  std::mutex m;
  std::map<uint64_t, std::shared_ptr<Plan>> plans;
  std::shared_ptr<Plan> get(uint64_t id);
};
std::shared_ptr<PlanTable> make_plan_table();
void plan_table_add(PlanTable& t, uint64_t id, std::vector<std::vector<std::shared_ptr<HostCall>>> layers);
bool plan_table_drop(PlanTable& t, uint64_t id);
int64_t plan_table_size(PlanTable& t);

class ShmResponder {  // the node's end of a client's native channel
 public:
  ShmResponder(at::Tensor mem, int64_t slot, std::shared_ptr<DeviceGroup> group, std::shared_ptr<PlanTable> plans,
               int64_t spin_us, int64_t sleep_us);
  ~ShmResponder();
  void stop();
  std::pair<int64_t, int64_t> counts() const;  // (jobs, errors)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl;
};

struct NodeChannel {  // the client's end
  at::Tensor mem;  // keeps the mapping
  uint64_t* w = nullptr;
  uint8_t *req = nullptr, *resp = nullptr;
  int64_t slot = 0;
  double stale_s = 5.0;
  int64_t spin_ns = 20000;  // a waiting job polls (yielding past 20 us) this long before it naps
  std::atomic<int64_t> margin_ns{0};  // and polls again from this long before its answer is expected (0: naps only)
  std::atomic<int64_t> expect_ns{0};  // when an answer is expected: the recent jobs' waits (moving average)
  std::mutex m;
  uint64_t seq = 0;
  std::string broken;  // set: every later job fails at once
};
std::shared_ptr<NodeChannel> attach_node_channel(at::Tensor mem, int64_t slot, double stale_s, int64_t spin_us,
                                                 int64_t margin_us);
std::string node_channel_broken(NodeChannel& ch);

struct RemoteJob {  // one layer of one plan: the layout of wire.plan_layout
  std::shared_ptr<NodeChannel> channel;
  uint64_t plan = 0, layer = 0;
  int64_t B = 0, Hq = 0, H = 0, D = 0, S = 0, q_itemsize = 0;
  std::vector<int64_t> bounds, q_off, ids_off, counts_off, out_off, lse_off;
  double timeout_s = 30.0;
  double node_s = 0, kernel_s = 0;  // the last answer's node and kernel time
  double wait_s = 0;                // the last job's post until its answer was seen (this side)
  void run(HostCall& call);         // throws on any failure (HostCall::run keeps it as its state)
};
std::vector<int64_t> native_header_words();

// a native backtrace on stderr on a fatal signal (fatal_trace.cpp has the contract); false: already on
bool install_fatal_trace();

}  // namespace nelssa
