// A native backtrace on a fatal signal, for processes whose crashing thread has no Python frame
// (nelssa-node's responder and device threads, a CUDA host function): Python's faulthandler shows the
// Python threads only.
//
// The contract:
//   1. install_fatal_trace() (once; later calls do nothing) sets a handler for SIGSEGV, SIGBUS, SIGFPE,
//      SIGILL and SIGABRT, keeping the handler it replaces (Python's faulthandler when enabled first).
//   2. On such a signal the handler writes to stderr, with no allocation: the signal, the faulting
//      address, the thread id, then the thread's frames (glibc backtrace_symbols_fd: object(+offset),
//      which `addr2line -f -C -e <object> <offset>` resolves), then restores the handler it replaced
//      and lets the signal take its course (a fault re-executes and meets that handler; a raised signal
//      is raised again): the process still dies as it would have, faulthandler's dump included.
#include "common.h"

#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace nelssa {

namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
struct sigaction g_prev[sizeof(kSignals) / sizeof(kSignals[0])];
std::atomic<bool> g_installed{false};

void put(const char* s) { (void)!write(2, s, strlen(s)); }

void put_hex(uint64_t v) {
  char b[19] = "0x";
  int n = 2;
  for (int i = 60; i >= 0; i -= 4) {
    const int d = (v >> i) & 15;
    if (n > 2 || d || i == 0) b[n++] = static_cast<char>(d < 10 ? '0' + d : 'a' + d - 10);
  }
  b[n] = 0;
  put(b);
}

void put_dec(int64_t v) {
  char b[24];
  int n = 0;
  uint64_t u = v < 0 ? -static_cast<uint64_t>(v) : static_cast<uint64_t>(v);
  do b[n++] = static_cast<char>('0' + u % 10); while (u /= 10);
  if (v < 0) b[n++] = '-';
  char r[24];
  for (int i = 0; i < n; ++i) r[i] = b[n - 1 - i];
  r[n] = 0;
  put(r);
}

void on_fatal(int sig, siginfo_t* info, void*) {
  put("\nnelssa: fatal signal ");
  put_dec(sig);
  put(sig == SIGSEGV ? " (SIGSEGV)" : sig == SIGBUS ? " (SIGBUS)" : sig == SIGFPE ? " (SIGFPE)"
                                                  : sig == SIGILL ? " (SIGILL)" : " (SIGABRT)");
  put(" at address ");
  put_hex(reinterpret_cast<uint64_t>(info ? info->si_addr : nullptr));
  put(" in thread ");
  put_dec(static_cast<int64_t>(syscall(SYS_gettid)));
  put("; native frames:\n");
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  put("nelssa: end of native frames\n");
  for (size_t i = 0; i < sizeof(kSignals) / sizeof(kSignals[0]); ++i)
    if (kSignals[i] == sig) sigaction(sig, &g_prev[i], nullptr);
  if (!info || info->si_code <= 0) raise(sig);  // sent, not a fault: send it again to the restored handler
}

}  // namespace

bool install_fatal_trace() {
  if (g_installed.exchange(true)) return false;
  void* warm[2];
  backtrace(warm, 2);  // loads the unwinder now: the first backtrace() may allocate
  for (size_t i = 0; i < sizeof(kSignals) / sizeof(kSignals[0]); ++i) {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_fatal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(kSignals[i], &sa, &g_prev[i]);
  }
  return true;
}

}  // namespace nelssa
