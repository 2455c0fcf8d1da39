// nelssa-node's native data plane: per-layer decode jobs through shared memory with no Python on
// either side (nelssa/node/wire.py "native channel" has the layout; state.py and client.py the
// control side).
//
// The contract:
//   1. A plan fixes a job's shape: the client asks the node (gRPC ``Plan``) for one over its requests
//      at their committed lengths (B requests, Hq query heads of D, S selected ids per KV head, the
//      queries' dtype, the scale). Both sides derive the byte layout of a job from the same pure
//      function (wire.plan_layout): per device its queries [B, Hq_d, D], per request its ids [H, S]
//      and counts [H] (int64; a device's share is a contiguous row range), and back per device out
//      [B, Hq_d, D] and lse [B, Hq_d] (fp32). The node prepares, for every layer and device, a
//      HostCall whose inputs and outputs ARE views of the channel's request and response slots.
//   2. A job is then: the client writes the arrays at the plan's offsets (of a request's ids only the
//      first counts[h] of each head's row: the kernel reads no more, and S is the batch's padded width,
//      ~8x the selected ids of a 100K request at 4%), the plan id and the layer,
//      then (release) the request's sequence number. The node's ShmResponder thread sees the number,
//      runs that layer's calls on the DeviceGroup (the kernel validates every id and count against the
//      request's cluster table and fails the call on any bad one), writes the status code (0 or a
//      grpc.StatusCode value), the message of a failure, its times, then (release) the response's
//      sequence number. A plan the node does not know (dropped with a freed request, never made) or a
//      layer outside it is an error answer, never a result.
//   3. The client's side is a RemoteJob attached to a HostCall (``remote``): HostCall::run does the
//      round trip instead of the kernel, so a remote call runs wherever a local one does (run() on a
//      thread, a CUDA host function, the flag poller of flag_wait.cpp). It fails (HostCall state
//      "failed", NaN outputs) on an error answer, on a closed channel, when the node shows no sign of
//      life for stale_s (its heartbeat and the job's post both older than that: a node that was only
//      paused gets stale_s from the post, before its threads have run again), or past its timeout;
//      after the last three the channel is broken and every later job on it fails at once (the Python
//      side opens a new one). It keeps the answer's node and kernel times and its own wait (post to
//      answer seen): a call's time outside the kernel splits into this side's copies, the channel's
//      two hand-offs and the node's dispatch (node/local.py). One job at a time per channel (a
//      mutex): the node answers in order. The waiting job polls the answer for 20 us, then
//      yields its core on every poll until the channel's spin_us, then naps 10 us per poll (a VM's
//      nap lasts ~60 us: spin_us is for hosts with cores to spare; on shared cores a spinning waiter
//      delays the very kernel it waits for) — except around the answer's expected time (the moving
//      average of the channel's recent waits): from margin_us before it until margin_us (or half the
//      expected wait) after it the job polls again, yielding, so an answer is seen within a poll
//      instead of a nap while the core is still given up for most of the kernel.
//   4. The responder answers every job posted after it was made (the sequence is read in its constructor,
//      not when its thread first runs, which may be after the client's first post), polls for spin_us
//      after each job (yielding its core past the first 20 us), then
//      sleeps sleep_us between polls, and writes its heartbeat (steady clock ns: CLOCK_MONOTONIC,
//      Python's time.monotonic_ns) when it is made, before its thread runs, then at least every
//      millisecond; stop() marks the channel closed (a waiting client fails at once) and joins.
//   5. Plans live in a PlanTable shared by the client's responders (a reopened channel keeps them);
//      a running job holds its plan, so dropping one (the request freed) never frees memory a kernel
//      reads.
//   6. A job's calls are submitted to the DeviceGroup (device_group.cpp, 6) and the device that finishes
//      last writes the answer: no thread wakes between the kernels' end and the answer. Meanwhile the
//      responder waits on a condition variable (beating every millisecond) until the answer is out, then
//      polls for the next job as in 4; stop() therefore returns only after a running job was answered.
#include "common.h"

#include <algorithm>
#include <condition_variable>
#include <thread>

namespace nelssa {

// header words (uint64 index) of a native channel; wire.py's NATIVE_* must match (a test checks)
enum : int {
  N_MAGIC = 0, N_VERSION = 1, N_SLOT = 2,
  N_REQ_SEQ = 8, N_REQ_PLAN = 9, N_REQ_LAYER = 10,
  N_RESP_SEQ = 16, N_RESP_CODE = 17, N_RESP_MSG = 18, N_RESP_NODE_NS = 19, N_RESP_KERNEL_NS = 20,
  N_BEAT = 24, N_CLOSED = 25,
};
constexpr int64_t kHeaderBytes = 256;
constexpr uint64_t kMagic = 0x4E454C5353415031ull;  // "NELSSAP1"
constexpr uint64_t kVersion = 1;
enum : uint64_t { C_OK = 0, C_INVALID = 3, C_NOT_FOUND = 5, C_INTERNAL = 13 };

namespace {

// both sides poll without yielding this long (a hand-off between spinning threads), then yield the core
// on every poll: on a machine whose cores the kernel's threads share, a pure spin delays the job it waits
// for by a scheduler time slice (~ms on 2 cores)
constexpr int64_t kPureSpinNs = 20000;

inline uint64_t load(const uint64_t* w, int i) { return __atomic_load_n(w + i, __ATOMIC_ACQUIRE); }
inline void store(uint64_t* w, int i, uint64_t v) { __atomic_store_n(w + i, v, __ATOMIC_RELEASE); }

// the header words of a native channel's mapping, its shape and identity (magic, version, slot) checked
uint64_t* words_of(const at::Tensor& mem, int64_t slot) {
  TORCH_CHECK(mem.device().is_cpu() && mem.scalar_type() == at::kByte && mem.dim() == 1 && mem.is_contiguous(),
              "a channel is a contiguous uint8 CPU tensor over its mapping");
  TORCH_CHECK(slot > 0 && mem.numel() == kHeaderBytes + 2 * slot, "channel of ", mem.numel(), " bytes for slot ", slot);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(mem.data_ptr()) % 64 == 0, "channel mapping not 64-byte aligned");
  auto* w = static_cast<uint64_t*>(mem.data_ptr());
  TORCH_CHECK(w[N_MAGIC] == kMagic && w[N_VERSION] == kVersion && w[N_SLOT] == static_cast<uint64_t>(slot),
              "not a native nelssa-node channel of slot ", slot);
  return w;
}

}  // namespace

// ---------------------------------------------------------------- node side

std::shared_ptr<Plan> PlanTable::get(uint64_t id) {
  std::lock_guard<std::mutex> lk(m);
  auto it = plans.find(id);
  return it == plans.end() ? nullptr : it->second;
}

std::shared_ptr<PlanTable> make_plan_table() { return std::make_shared<PlanTable>(); }

void plan_table_add(PlanTable& t, uint64_t id, std::vector<std::vector<std::shared_ptr<HostCall>>> layers) {
  auto p = std::make_shared<Plan>();
  p->layers = std::move(layers);
  std::lock_guard<std::mutex> lk(t.m);
  TORCH_CHECK(t.plans.emplace(id, std::move(p)).second, "plan ", id, " exists");
}

bool plan_table_drop(PlanTable& t, uint64_t id) {
  std::lock_guard<std::mutex> lk(t.m);
  return t.plans.erase(id) > 0;
}

int64_t plan_table_size(PlanTable& t) {
  std::lock_guard<std::mutex> lk(t.m);
  return static_cast<int64_t>(t.plans.size());
}

struct ShmResponder::Impl {
  at::Tensor mem;  // keeps the mapping
  uint64_t* w = nullptr;
  uint8_t* resp = nullptr;
  int64_t slot = 0, spin_us = 0, sleep_us = 0;
  std::shared_ptr<DeviceGroup> group;
  std::shared_ptr<PlanTable> plans;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> jobs{0}, errors{0};
  std::thread thread;

  void answer(uint64_t seq, uint64_t code, const std::string& msg, int64_t t0, double kernel_s) {
    const size_t n = std::min<size_t>(msg.size(), static_cast<size_t>(slot));
    if (n) std::memcpy(resp, msg.data(), n);
    w[N_RESP_MSG] = n;
    w[N_RESP_CODE] = code;
    w[N_RESP_NODE_NS] = static_cast<uint64_t>(now_ns() - t0);
    w[N_RESP_KERNEL_NS] = static_cast<uint64_t>(kernel_s * 1e9);
    store(w, N_RESP_SEQ, seq);
    jobs.fetch_add(1, std::memory_order_relaxed);
    if (code != C_OK) errors.fetch_add(1, std::memory_order_relaxed);
  }

  void serve(uint64_t seq) {
    const int64_t t0 = now_ns();
    const uint64_t id = w[N_REQ_PLAN], layer = w[N_REQ_LAYER];
    auto plan = plans->get(id);
    if (!plan) return answer(seq, C_NOT_FOUND, "plan " + std::to_string(id) + " is not on the node (never made, "
                                               "or dropped with a freed request)", t0, 0);
    if (layer >= plan->layers.size())
      return answer(seq, C_INVALID, "layer " + std::to_string(layer) + " outside the plan's " +
                                        std::to_string(plan->layers.size()), t0, 0);
    auto& calls = plan->layers[layer];
    for (auto& c : calls) {
      if (!c) continue;
      c->error.clear(), c->value_error = false, c->seconds = 0;
      c->state.store(0, std::memory_order_release);  // prepared: DeviceGroup::submit takes it
    }
    {
      std::lock_guard<std::mutex> lk(m);
      busy = true;
    }
    try {  // (6) answered by the device that finishes last; the job holds its plan until then
      group->submit(calls, [this, seq, t0, plan, layer] {
        finish(seq, t0, plan->layers[layer]);
        std::lock_guard<std::mutex> lk(m);  // notified under the lock: stop() may free this right after
        busy = false;
        cv.notify_all();
      });
    } catch (const std::exception& e) {
      {
        std::lock_guard<std::mutex> lk(m);
        busy = false;
      }
      return answer(seq, C_INTERNAL, std::string("device group: ") + e.what(), t0, 0);
    }
  }

  void finish(uint64_t seq, int64_t t0, const std::vector<std::shared_ptr<HostCall>>& calls) {
    double kernel = 0;
    for (auto& c : calls) {
      if (!c) continue;
      kernel = std::max(kernel, c->seconds);
      const int st = c->state.load(std::memory_order_acquire);
      if (st != 2) return answer(seq, c->value_error ? C_INVALID : C_INTERNAL, c->error, t0, kernel);
    }
    answer(seq, C_OK, "", t0, kernel);
  }

  // a job on the devices (6): the responder waits off its core, beating, until its answer is out (the
  // client posts no job before it sees the answer)
  std::mutex m;
  std::condition_variable cv;
  bool busy = false;

  void wait_answered(int64_t& beat) {
    std::unique_lock<std::mutex> lk(m);
    while (busy) {
      cv.wait_for(lk, std::chrono::milliseconds(1));
      const int64_t t = now_ns();
      if (t - beat > 1000000) w[N_BEAT] = static_cast<uint64_t>(beat = t);
    }
  }

  uint64_t first = 0;  // the channel's job sequence when the responder was made (4)

  void loop() {
    uint64_t last = first;
    int64_t idle = now_ns(), beat = 0;
    while (!stop.load(std::memory_order_acquire)) {
      const int64_t t = now_ns();
      if (t - beat > 1000000) w[N_BEAT] = static_cast<uint64_t>(beat = t);
      const uint64_t seq = load(w, N_REQ_SEQ);
      if (seq == last) {
        if (t - idle < kPureSpinNs) {
          for (int k = 0; k < 32; ++k) cpu_relax();
        } else if (t - idle < spin_us * 1000) {
          std::this_thread::yield();  // (4) a core shared with the kernel's threads is given up at once
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
        }
        continue;
      }
      last = seq;
      serve(seq);
      wait_answered(beat);
      idle = now_ns();
    }
  }
};

ShmResponder::ShmResponder(at::Tensor mem, int64_t slot, std::shared_ptr<DeviceGroup> group,
                           std::shared_ptr<PlanTable> plans, int64_t spin_us, int64_t sleep_us)
    : impl(std::make_unique<Impl>()) {
  TORCH_CHECK(group && plans, "a responder needs a device group and a plan table");
  TORCH_CHECK(spin_us >= 0 && sleep_us >= 1, "spin_us >= 0 and sleep_us >= 1");
  impl->w = words_of(mem, slot);
  impl->mem = std::move(mem);
  impl->resp = static_cast<uint8_t*>(impl->mem.data_ptr()) + kHeaderBytes + slot;
  impl->slot = slot, impl->spin_us = spin_us, impl->sleep_us = sleep_us;
  impl->group = std::move(group), impl->plans = std::move(plans);
  impl->w[N_BEAT] = static_cast<uint64_t>(now_ns());  // (4) alive from the start, before its thread first runs
  impl->first = load(impl->w, N_REQ_SEQ);  // (4) a job posted before the thread first runs is still answered
  Impl* p = impl.get();
  impl->thread = std::thread([p] { p->loop(); });
}

ShmResponder::~ShmResponder() { stop(); }

void ShmResponder::stop() {
  if (!impl->thread.joinable()) return;
  impl->stop.store(true, std::memory_order_release);
  impl->thread.join();
  store(impl->w, N_CLOSED, 1);
}

std::pair<int64_t, int64_t> ShmResponder::counts() const { return {impl->jobs.load(), impl->errors.load()}; }

// ---------------------------------------------------------------- client side

std::shared_ptr<NodeChannel> attach_node_channel(at::Tensor mem, int64_t slot, double stale_s, int64_t spin_us,
                                                 int64_t margin_us) {
  TORCH_CHECK(spin_us >= 0 && margin_us >= 0, "spin_us and margin_us must be >= 0");
  auto ch = std::make_shared<NodeChannel>();
  ch->w = words_of(mem, slot);
  ch->mem = std::move(mem);
  ch->req = static_cast<uint8_t*>(ch->mem.data_ptr()) + kHeaderBytes;
  ch->resp = ch->req + slot;
  ch->slot = slot, ch->stale_s = stale_s, ch->spin_ns = std::max<int64_t>(spin_us, 20) * 1000;
  ch->margin_ns.store(margin_us * 1000);
  ch->seq = std::max(load(ch->w, N_REQ_SEQ), load(ch->w, N_RESP_SEQ));
  return ch;
}

std::string node_channel_broken(NodeChannel& ch) {
  std::lock_guard<std::mutex> lk(ch.m);
  return ch.broken;
}

namespace {
const char* code_name(uint64_t c) {
  switch (c) {
    case 3: return "INVALID_ARGUMENT";
    case 5: return "NOT_FOUND";
    case 8: return "RESOURCE_EXHAUSTED";
    case 9: return "FAILED_PRECONDITION";
    case 13: return "INTERNAL";
    default: return "ERROR";
  }
}
}  // namespace

void RemoteJob::run(HostCall& c) {
  const int64_t n = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK(n >= 1 && static_cast<int64_t>(q_off.size()) == n && static_cast<int64_t>(ids_off.size()) == B,
              "remote job: bad layout");
  TORCH_CHECK(c.q.dim() == 3 && c.q.size(0) == B && c.q.size(1) == Hq && c.q.size(2) == D && c.q.is_contiguous() &&
                  c.q.element_size() == q_itemsize && c.q.device().is_cpu(),
              "remote job: queries must be a contiguous CPU [", B, ", ", Hq, ", ", D, "] tensor of the plan's dtype");
  TORCH_CHECK(static_cast<int64_t>(c.sel.size()) == B && static_cast<int64_t>(c.nsel.size()) == B,
              "remote job: ", B, " selections expected");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(c.sel[b].dim() == 2 && c.sel[b].size(0) == H && c.sel[b].size(1) == S && c.sel[b].is_contiguous() &&
                    c.sel[b].scalar_type() == at::kLong && c.nsel[b].numel() == H && c.nsel[b].is_contiguous() &&
                    c.nsel[b].scalar_type() == at::kLong,
                "remote job: request ", b, ": ids must be int64 [", H, ", ", S, "], counts int64 [", H, "]");
  TORCH_CHECK(c.out.scalar_type() == at::kFloat && c.out.numel() == B * Hq * D && c.out.is_contiguous() &&
                  c.lse.scalar_type() == at::kFloat && c.lse.numel() == B * Hq && c.lse.is_contiguous(),
              "remote job: outputs must be contiguous fp32 [B, Hq, D] / [B, Hq]");
  NodeChannel& ch = *channel;
  std::lock_guard<std::mutex> lk(ch.m);
  TORCH_CHECK(ch.broken.empty(), "node data plane (native shared memory): ", ch.broken);
  const int64_t G = Hq / H, isz = q_itemsize;
  const auto* q = static_cast<const uint8_t*>(c.q.data_ptr());
  for (int64_t d = 0; d < n; ++d) {
    const int64_t h0 = bounds[d], hd = bounds[d + 1] - h0, row = hd * G * D * isz;
    for (int64_t b = 0; b < B; ++b)
      if (row) std::memcpy(ch.req + q_off[d] + b * row, q + (b * Hq + h0 * G) * D * isz, row);
  }
  for (int64_t b = 0; b < B; ++b) {  // (2) of a head's row of S ids only its first counts[h] travel
    const int64_t* ids = c.sel[b].data_ptr<int64_t>();
    const int64_t* cnt = c.nsel[b].data_ptr<int64_t>();
    for (int64_t h = 0; h < H; ++h) {
      const int64_t m = std::clamp<int64_t>(cnt[h], 0, S);  // a bad count travels as it is: the node fails the job
      if (m) std::memcpy(ch.req + ids_off[b] + h * S * 8, ids + h * S, m * 8);
    }
    std::memcpy(ch.req + counts_off[b], cnt, H * 8);
  }
  ch.w[N_REQ_PLAN] = plan, ch.w[N_REQ_LAYER] = layer;
  const uint64_t seq = ++ch.seq;
  const int64_t t0 = now_ns();
  store(ch.w, N_REQ_SEQ, seq);
  const int64_t deadline = t0 + static_cast<int64_t>(timeout_s * 1e9), stale = static_cast<int64_t>(ch.stale_s * 1e9);
  const int64_t expect = ch.expect_ns.load(std::memory_order_relaxed), margin = ch.margin_ns.load(std::memory_order_relaxed);
  const int64_t late = std::max(margin, expect / 2);
  for (int64_t i = 0; load(ch.w, N_RESP_SEQ) != seq; ++i) {
    if ((i & 15) == 15) {
      const int64_t t = now_ns();
      if (load(ch.w, N_CLOSED)) ch.broken = "the node closed the channel (lease expired or node stopped)";
      else if (t > deadline) ch.broken = "no answer within " + std::to_string(timeout_s) + " s";
      else if (t - std::max(static_cast<int64_t>(load(ch.w, N_BEAT)), t0) > stale)  // (3) no sign of life since the post
        ch.broken = "the node's heartbeat is older than " + std::to_string(ch.stale_s) + " s (node dead?)";
      if (!ch.broken.empty()) TORCH_CHECK(false, "node data plane (native shared memory): ", ch.broken);
      const int64_t el = t - t0;
      const bool near = margin > 0 && el >= expect - margin && el <= expect + late;  // (3) the answer's window
      if (el > ch.spin_ns && !near) std::this_thread::sleep_for(std::chrono::microseconds(10));  // a nap (VM: ~60 us)
      else if (el > kPureSpinNs) std::this_thread::yield();  // a kernel call, on a machine with cores to spare
    }
    cpu_relax();
  }
  const int64_t waited = now_ns() - t0;
  wait_s = static_cast<double>(waited) * 1e-9;
  ch.expect_ns.store(expect ? (3 * expect + waited) / 4 : waited, std::memory_order_relaxed);
  const uint64_t code = load(ch.w, N_RESP_CODE);
  node_s = static_cast<double>(ch.w[N_RESP_NODE_NS]) * 1e-9;
  kernel_s = static_cast<double>(ch.w[N_RESP_KERNEL_NS]) * 1e-9;
  if (code != C_OK) {
    const size_t m = std::min<uint64_t>(ch.w[N_RESP_MSG], static_cast<uint64_t>(ch.slot));
    TORCH_CHECK(false, "nelssa-node job (layer ", layer, "): ", code_name(code), ": ",
                std::string(reinterpret_cast<const char*>(ch.resp), m));
  }
  auto* out = c.out.data_ptr<float>();
  auto* lse = c.lse.data_ptr<float>();
  for (int64_t d = 0; d < n; ++d) {
    const int64_t h0 = bounds[d], hq = (bounds[d + 1] - h0) * G;
    if (!hq) continue;
    const auto* o = reinterpret_cast<const float*>(ch.resp + out_off[d]);
    const auto* l = reinterpret_cast<const float*>(ch.resp + lse_off[d]);
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(out + (b * Hq + h0 * G) * D, o + b * hq * D, hq * D * 4);
      std::memcpy(lse + b * Hq + h0 * G, l + b * hq, hq * 4);
    }
  }
}

std::vector<int64_t> native_header_words() {
  return {N_MAGIC, N_VERSION, N_SLOT, N_REQ_SEQ, N_REQ_PLAN, N_REQ_LAYER, N_RESP_SEQ, N_RESP_CODE, N_RESP_MSG,
          N_RESP_NODE_NS, N_RESP_KERNEL_NS, N_BEAT, N_CLOSED, kHeaderBytes, static_cast<int64_t>(kMagic),
          static_cast<int64_t>(kVersion)};
}

}  // namespace nelssa
