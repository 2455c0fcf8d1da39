"""The one NELSSA configuration object.

Sources, later ones win: defaults < ``additional_config["nelssa"]`` (vLLM's ``--additional-config``)
< environment variables. Every environment variable is mapped here and nowhere else (``ENV``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {s!r}")


def parse_cores(s: str | list | tuple | None) -> tuple[int, ...]:
    """'0-3,8,10-11' (or a list of ints) -> (0, 1, 2, 3, 8, 10, 11)."""
    if s is None or s == "":
        return ()
    if isinstance(s, (list, tuple)):
        return tuple(int(c) for c in s)
    out: list[int] = []
    for part in str(s).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"bad core list element {part!r} in {s!r} (use e.g. '0-3,8')")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"bad core range {part!r}")
        out.extend(range(lo, hi + 1))
    return tuple(out)


def check_cores(label: str, cores) -> None:
    """ValueError unless every core of ``cores`` exists on this machine: a thread pinned to a missing
    core fails its pin and runs unpinned, silently."""
    n = os.cpu_count() or 1
    missing = sorted(c for c in set(cores) if not 0 <= c < n)
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"{label} must be cores of this machine (0-{n - 1}); not: {shown}")


def config_json(text: str) -> dict:
    """A NELSSA config given as JSON text (``nelssa serve --nelssa``, the P/D launcher) -> dict, or
    ValueError saying why not."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(d, dict):
        raise ValueError(f"the NELSSA config must be an object, got {text!r}")
    return d


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_bytes(s: str | int) -> int:
    """'64GiB', '512MB', '1e9' or an int -> bytes."""
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(s))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {s!r} (use e.g. '64GiB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def mem_available() -> int:
    """Bytes of memory available now (MemAvailable; total physical memory where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def usable_cores() -> set[int]:
    """The cores this process may run on (its affinity; every core where the platform has none)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _default_threads() -> int:
    return max(1, min(8, len(usable_cores())))


# Software-prefetch hint of the host kernel -> the C++ code (locality of __builtin_prefetch; -1: none).
PREFETCH_HINTS = {"nta": 0, "l2": 1, "l1": 3, "none": -1}


@dataclass(frozen=True)
class NelssaConfig:
    off: bool = False             # NELSSA disabled: vLLM behaves exactly as stock (the baseline)
    T_input: int = 2048           # prompt length (tokens) from which a request is "long"
    budget: float = 0.04          # fraction of a long request's tokens attended on the host tier
    estimate: bool = True         # approximate the unselected clusters by their centroids (device)
    graphs: bool = True           # CUDA: centroid search replayed as captured graphs, one merge kernel
    select_kernel: bool = True    # CUDA: the centroid search as Triton kernels (sparse/select_kernel.py)
    lane: bool | None = None      # long lane (vllm_plugin/lane.py): offloaded requests decode apart from the
                                  # step, so short rows never wait for the host tier. None (default): on with
                                  # CUDA, off on CPU (an engine decides: vllm_nelssa_config)
    lane_switch_us: int = 200     # with the lane: Python's GIL switch interval (us) in the worker
    lane_gather_ms: float = 50.0  # the lane waits up to this long for the long requests it reported to
                                  # come back, so they run as one batch
    switch_hold_s: float = 2.0    # with the lane: a long prompt done prefilling whose switch waits only for its
                                  # last two segments' hand-off is left out of the steps until it switches (at
                                  # most this long), instead of decoding from its device blocks meanwhile: the
                                  # steps in which the second 100K prompt decoded so took 65-67 ms (H200 hol
                                  # run 77, the decode phase's first 0.2 s). 0: it decodes on the device
    lane_spec: bool = True        # with the lane: a greedy row's next token is the argmax of the lane's own
                                  # logits (the step samples from them), so the lane computes the next
                                  # positions at once and publishes them without waiting for the steps;
                                  # the steps' tokens are checked after the fact (vllm_plugin/lane_spec.py)
    lane_host_calls: bool = True  # CUDA lane: a batch enqueued whole, the device waiting for each layer's host
                                  # attention (vllm_plugin/lane_host.py, lane_host_wait); off: the lane thread
                                  # waits for it layer by layer
    lane_host_wait: str = "flags"  # CUDA lane with host calls: how the device waits for each: "flags" (stream
                                   # memory ops on pinned flags, served by the extension's own thread,
                                   # csrc/flag_wait.cpp) | "hostfn" (CUDA host functions, the driver's thread)
    lane_batch_graph: bool = True  # CUDA lane with host calls: a batch captured and replayed as one CUDA graph
                                   # (vllm_plugin/lane_batch.py); off: enqueued layer by layer
    lane_chain: bool = True       # CUDA lane with host calls: a batch as one chain on the lane's stream (the
                                  # host calls not forked onto a stream of their own, the window attention
                                  # before each), so its host waits hold one hardware queue
                                  # (vllm_plugin/lane_host.py, 3; H200 run 32: decode ITL p99 43.8 ms, was 63-73)
    lane_overlap: bool = True     # CUDA lane, one chain served by flags: each layer's estimate and window
                                  # attention run while its host call does (the flags' ready write and wait
                                  # launched apart, vllm_plugin/lane_host.py, 3a); off: before the ready write
    lane_connections: int = 32    # CUDA lane: hardware work queues the worker asks for
                                  # (CUDA_DEVICE_MAX_CONNECTIONS, default 8, max 32) before CUDA starts; a lane
                                  # graph's host waits block their queue, and a step stream sharing it waits
                                  # too (H200 profile, docs/results.md). 0: the environment's. An explicit
                                  # CUDA_DEVICE_MAX_CONNECTIONS in the environment wins
    lane_sms: int = 0             # CUDA lane: SMs the lane's kernels get to themselves (a green context; the
                                  # steps keep the rest: vllm_plugin/sm_split.py); 0: every SM shared, the
                                  # lane ahead by stream priority only. An experiment: unmeasured
    step_priority: int = -1       # CUDA: priority of the engine's step stream (vLLM's current stream, set by
                                  # the worker before its model runner is built; lower = higher priority);
                                  # the lane's streams one above it, the hand-off's side stream at 0 (the
                                  # lowest), so a hand-off's k-means never delays a step's kernels
                                  # (bench_handoff, H200: step p99 beside a 32K move 27 -> 7.8 ms). 0: vLLM's own
    stall_log_ms: float = 0.0     # log every thread's stack when the engine's step thread makes no step for this
                                  # long while it has work (vllm_plugin/watchdog.py; 0 = off)
    sink: int = 16                # first tokens kept on the device; an engine rounds it up to whole KV blocks
                                  # (vllm_nelssa_config: 64 on 64-token blocks)
    recent: int = 64              # last tokens kept on the device
    chunk: int = 1024             # generated tokens clustered and appended to the host tier at once
    long_prefills: int = 1        # long prompts prefilling at once (admission; 0: no limit)
    long_chunk: int = 768         # long-prompt tokens per step while short requests decode, at context 0;
                                  # shrinks with the context so the step's cost stays flat (0: vLLM's own).
                                  # 768 against 1024 (H100 hol runs 92/94, long_chunk_solo 2048 in both): the
                                  # first long TPOT 60.6 -> 52.2 ms, the second long TTFT 26.67 -> 26.87 s
    long_chunk_solo: int = -1     # long_chunk while no long request decodes from the host tier: a larger chunk
                                  # prefills a first long prompt sooner, and no long request's tokens decode
                                  # beside its longer steps. -1: max(4096, long_chunk) with long_chunk, else 0;
                                  # 0: long_chunk everywhere (H100 hol runs 91/92: the long TTFTs 13.04 / 27.81 ->
                                  # 11.30 / 26.67 s at 2048; stock 13.93 / 26.78. Runs 106/108, one H100:
                                  # 11.42 / 27.16 s at 2048, 9.79 / 25.01 at 4096; stock 13.99 / 27.14, 13.69 / 26.34)
    short_chunk: int = 2048       # short-prompt tokens a step adds to its decodes and long chunks while a long
                                  # request is resident and short requests decode (the step budget); 0: long_chunk.
                                  # 2048 takes two 1K prompts arriving together in one step (H100 hol runs 70/73:
                                  # decode-phase short TTFT p99 248 -> 107 ms, ITL p99 62.8 -> 36.4 ms at 1024)
    short_chunk_decode: int = -1  # short_chunk while no long prompt prefills (the resident long requests decode
                                  # or hold): the long decode phase's steps apart from the long prefill's. -1:
                                  # short_chunk. H100 hol runs 110-115: the decode phase's ITL p99 is its few
                                  # steps with two 1K prompts at 2048 (45-56 ms); short_chunk 1024 everywhere
                                  # (run 115) removed them but queued the prefill phase's prompts (TTFT p99 2.5 s)
                                  # At 1024 here (run 116, one invocation with -1): decode ITL p99 38.5 against 33.4 ms
    migrate: bool = True          # a request that grew past T_input moves to the host tier under pressure
    migrate_watermark: float = 0.9  # device KV blocks in use (fraction) from which such requests migrate
    migrate_lead_steps: int = 0   # also migrate when the free device blocks are fewer than the requests decoding
                                  # on the device take within this many steps (vLLM about to preempt; a hand-off
                                  # frees blocks only when done); 0: off. With migrate_watermark 1.0, requests
                                  # migrate only then, not while the device has headroom
    recall: bool = True           # a migrated request that grew past T_input returns to the device once the device
                                  # has room for it and for every running request to its end, nobody waiting: it
                                  # decodes at the device's pace again instead of the host tier's. Engine "local":
                                  # its KV is loaded back from the host tier (recall.py; nothing recomputed);
                                  # "node": vLLM recomputes it (a preemption). Its host KV is freed
    defer_below: int = 32768      # long prompts shorter than this stay on the device until device KV is under
                                  # pressure, then migrate as grown requests do; longer ones (and all, at 0)
                                  # are host-backed from admission on
    engine: str = "local"         # host tier: "local" (in-process pool) | "node" (a nelssa-node service)
    node_address: str = "127.0.0.1:50151"  # engine "node": the node's gRPC address
    node_token: str = field(default="", repr=False)  # engine "node": shared secret (required off loopback)
    node_transport: str = "auto"  # engine "node" data plane: native | shm | grpc | auto (native on loopback)
    node_lease_s: float = 30.0    # engine "node": lease; the node drops a client's KV this long after its last call
    handover: bool = False        # engine "node", the prefill instance of a P/D stack: its long prompts are
                                  # clustered into the node as they prefill and released there for the decode
                                  # instance, which adopts them instead of clustering them again
                                  # (vllm_plugin/handover.py)
    handover_wait_s: float = 60.0  # decode instance: how long a hand-over's adoption waits for the prefill
                                   # instance's release before it clusters the request itself (its KV came
                                   # whole over NIXL)
    handover_window: bool = True  # decode instance: a released hand-over is admitted with device blocks for
                                  # its window only and reads only those over NIXL (handover.py, 6); off: the
                                  # whole prompt's blocks, read whole, freed after the adoption
    node_spin_us: int = -1        # engine "node", native plane: a job polls its answer this long (yielding its
                                  # core past 20 us) before it naps ~10 us per poll; -1: 1000 with 8 or more
                                  # usable cores or none of the node's pinned device cores, else 20 (on shared
                                  # cores a spinning waiter delays the node's kernel: csrc/node_plane.cpp, 3)
    node_margin_us: int = 0       # engine "node", native plane: a napping job polls again (yielding) from this
                                  # long before its answer is expected (the channel's recent waits) until as long
                                  # after (at least half the wait): the answer seen within a poll, not a nap
                                  # (~60 us on a VM); 0: naps only (csrc/node_plane.cpp, 3)
    cluster_size: int = 8         # mean tokens per cluster (8 measured better than 16 on needles, see README)
    segment: int = 8192           # k-means segment length (tokens)
    tail_segment: int = -1        # a long prompt's last segment before its host range's end is handed off in
                                  # pieces of this many tokens as its prefill reaches them, so its switch waits
                                  # for a piece's move, not a whole segment's (policy.prefill_move_end); 0: off;
                                  # -1: 2048 where that divides a longer segment, else 0 (H100 hol runs 91/92:
                                  # switch holds 0.31 -> 0.23 s a request)
    iters: int = 10               # k-means iterations
    kmeans_kernel: bool = True    # CUDA: k-means as Triton kernels (sparse/kmeans_kernel.py: ~3 launches an
                                  # iteration, no logits in memory); false: torch (a bmm and an argmax over
                                  # fp32 logits, ~10 launches an iteration)
    handoff_ahead: bool | None = None  # a move's read and k-means run on a thread (and CUDA stream) of their own, one
                                  # move ahead of the packing and store of the move before it (vllm_plugin/
                                  # handoff.py, 1): on CUDA the k-means is device work, the packing a thread's
                                  # launches (H100 hol run 119p: 183 ms of k-means kernels, 35 ms of packing
                                  # spread over ~0.3 s), done one after the other they left the first 100K
                                  # prompt's hand-off 3-4 moves behind its prefill (runs 116-118). None: on
                                  # with CUDA, off on CPU (both stages would compute on the same cores)
    seed: int = 0
    use_cpp: bool = True          # C++ kernels (False: pure-torch reference path)
    pool_threads: int = field(default_factory=_default_threads)
    affinity_cores: tuple[int, ...] = ()
    pool_spin_us: int = -1        # the host attention team's workers spin this long for the next call before they
                                  # sleep (csrc/host_team.cpp 3); a spinning worker holds its core: for pools
                                  # with cores of their own (the lane's calls come ~1 ms apart). 0: sleep at once;
                                  # -1: 1000 in a CUDA process whose pool leaves cores free, else 0 (_ext.spin_us;
                                  # H100 hol runs 63/64 and 67/68: long TPOT, tok/s and short ITL p99 better in both
                                  # pairs, docs/results.md)
    host_capacity: int = 0        # host-tier bytes (0: 80% of available memory at start)
    host_reserve: int = 0         # host-tier memory mapped and touched at start in the background and kept
                                  # for reuse (sparse/hostmem.py); 0: every move writes fresh pages, every free unmaps
    host_timeout_s: float = 30.0  # a host-tier result later than this fails the request
    work_tokens: int = 512        # rows per kernel work item
    prefetch: str = "l1"          # kernel's software prefetch: l1 | l2 | nta | none (benchmark --sweep-prefetch
    prefetch_rows: int = 16       # picks per CPU; l1/16 was best or level on both measured machines, README)
    fault: str = ""               # fault injection for tests: "attend" makes every host attention fail, "store"
                                  # every move to the host tier (the requests stay on their device blocks), "recall"
                                  # every recall's read-back (the request fails)
    calibration: str = ""         # `nelssa calibrate` JSON: T_input comes from it unless T_input is given

    def __post_init__(self) -> None:
        def req(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"nelssa config: {msg}")

        for f in dataclasses.fields(self):  # a switch given as "false" or 0 would read as on (or off) silently
            v = getattr(self, f.name)
            if f.type in ("bool", "bool | None") and not (isinstance(v, bool) or (v is None and f.type != "bool")):
                raise ValueError(f"nelssa config: {f.name} must be true or false"
                                 f"{' (or null: by device)' if f.type != 'bool' else ''}, got {v!r}")
        req(isinstance(self.T_input, int) and self.T_input >= 1, f"T_input must be an int >= 1, got {self.T_input!r}")
        req(isinstance(self.budget, (int, float)) and 0 < self.budget <= 1,
            f"budget must be in (0, 1], got {self.budget!r}")
        req(self.sink >= 0 and self.recent >= 1, f"sink must be >= 0 and recent >= 1, got {self.sink}, {self.recent}")
        req(self.chunk >= 1, f"chunk must be >= 1, got {self.chunk}")
        req(isinstance(self.long_prefills, int) and self.long_prefills >= 0,
            f"long_prefills must be an int >= 0, got {self.long_prefills!r}")
        req(isinstance(self.long_chunk, int) and self.long_chunk >= 0,
            f"long_chunk must be an int >= 0, got {self.long_chunk!r}")
        req(isinstance(self.long_chunk_solo, int) and self.long_chunk_solo >= -1,
            f"long_chunk_solo must be an int >= -1 (-1: by long_chunk), got {self.long_chunk_solo!r}")
        req(self.long_chunk_solo <= 0 or self.long_chunk,
            "long_chunk_solo needs long_chunk (0: vLLM's own threshold caps every prefill chunk)")
        req(isinstance(self.switch_hold_s, (int, float)) and self.switch_hold_s >= 0,
            f"switch_hold_s must be >= 0, got {self.switch_hold_s!r}")
        req(isinstance(self.short_chunk, int) and self.short_chunk >= 0,
            f"short_chunk must be an int >= 0, got {self.short_chunk!r}")
        req(isinstance(self.short_chunk_decode, int) and self.short_chunk_decode >= -1,
            f"short_chunk_decode must be an int >= -1 (-1: short_chunk), got {self.short_chunk_decode!r}")
        req(isinstance(self.migrate_lead_steps, int) and self.migrate_lead_steps >= 0,
            f"migrate_lead_steps must be an int >= 0, got {self.migrate_lead_steps!r}")
        req(isinstance(self.migrate_watermark, (int, float)) and 0 <= self.migrate_watermark <= 1,
            f"migrate_watermark must be in [0, 1], got {self.migrate_watermark!r}")
        req(isinstance(self.defer_below, int) and self.defer_below >= 0,
            f"defer_below must be an int >= 0, got {self.defer_below!r}")
        req(self.engine in ("local", "node"), f"engine must be 'local' or 'node', got {self.engine!r}")
        req(self.node_transport in ("auto", "native", "shm", "grpc"),
            f"node_transport must be auto, native, shm or grpc, got {self.node_transport!r}")
        host, _, port = self.node_address.rpartition(":") if isinstance(self.node_address, str) else ("", "", "")
        req(bool(host) and port.isdigit() and 0 < int(port) <= 65535,
            f"node_address must be host:port with a port in [1, 65535], got {self.node_address!r}")
        req(self.node_lease_s > 0, f"node_lease_s must be > 0, got {self.node_lease_s!r}")
        req(not self.handover or self.engine == "node",
            "handover (a prefill instance releasing long prompts to its decode instance) needs engine 'node'")
        req(self.handover_wait_s > 0, f"handover_wait_s must be > 0, got {self.handover_wait_s!r}")
        req(isinstance(self.node_spin_us, int) and self.node_spin_us >= -1,
            f"node_spin_us must be an int >= -1, got {self.node_spin_us!r}")
        req(isinstance(self.node_margin_us, int) and self.node_margin_us >= 0,
            f"node_margin_us must be an int >= 0, got {self.node_margin_us!r}")
        req(self.cluster_size >= 1 and self.segment >= self.cluster_size and self.iters >= 1,
            "cluster_size >= 1, segment >= cluster_size and iters >= 1 required")
        req(isinstance(self.tail_segment, int) and (self.tail_segment in (-1, 0) or (
            self.cluster_size <= self.tail_segment <= self.segment and self.segment % self.tail_segment == 0)),
            f"tail_segment must be -1 (by segment), 0 or divide segment ({self.segment}) and be >= "
            f"cluster_size, got {self.tail_segment!r}")
        req(isinstance(self.lane_connections, int) and 0 <= self.lane_connections <= 32,
            f"lane_connections must be an int in [0, 32], got {self.lane_connections!r}")
        req(isinstance(self.lane_sms, int) and self.lane_sms >= 0, f"lane_sms must be an int >= 0, got {self.lane_sms!r}")
        req(self.lane_sms == 0 or self.lane is not False, "lane_sms needs the lane (lane is false)")
        req(isinstance(self.step_priority, int) and -2 <= self.step_priority <= 0,
            f"step_priority must be an int in [-2, 0] (torch has CUDA stream priorities 0 to -3; the lane one above), got {self.step_priority!r}")
        req(self.lane_host_wait in ("flags", "hostfn"),
            f"lane_host_wait must be 'flags' or 'hostfn', got {self.lane_host_wait!r}")
        req(self.pool_threads >= 1, f"pool_threads must be >= 1, got {self.pool_threads}")
        req(isinstance(self.pool_spin_us, int) and -1 <= self.pool_spin_us <= 1_000_000,
            f"pool_spin_us must be an int in [-1, 1000000] (-1: by the machine), got {self.pool_spin_us!r}")
        try:
            check_cores("affinity_cores", self.affinity_cores)
        except ValueError as e:
            req(False, str(e))
        req(self.host_capacity >= 0 and self.host_timeout_s > 0, "host_capacity >= 0 and host_timeout_s > 0 required")
        req(isinstance(self.host_reserve, int) and self.host_reserve >= 0,
            f"host_reserve must be bytes >= 0, got {self.host_reserve!r}")
        req(self.work_tokens >= 16, f"work_tokens must be >= 16, got {self.work_tokens}")
        req(self.prefetch_rows >= 0, f"prefetch_rows must be >= 0, got {self.prefetch_rows}")
        req(self.prefetch in PREFETCH_HINTS, f"prefetch must be one of {sorted(PREFETCH_HINTS)}, got {self.prefetch!r}")
        req(self.fault in ("", "attend", "store", "recall"),
            f"fault must be '', 'attend', 'store' or 'recall', got {self.fault!r}")
        req(isinstance(self.calibration, str), f"calibration must be a path, got {self.calibration!r}")

    @property
    def enabled(self) -> bool:
        return not self.off

    @property
    def defer_limit(self) -> int:
        """``defer_below`` in effect: 0 with ``migrate`` off (a deferred prompt leaves the device only by
        migrating, so without migration long prompts are host-backed from admission)."""
        return self.defer_below if self.migrate else 0

    @property
    def chunk_solo(self) -> int:
        """``long_chunk_solo`` in effect: -1 is max(4096, long_chunk) with a ``long_chunk``, else 0."""
        if self.long_chunk_solo >= 0:
            return self.long_chunk_solo
        return max(4096, self.long_chunk) if self.long_chunk else 0

    @property
    def tail_piece(self) -> int:
        """``tail_segment`` in effect: -1 is 2048 where that divides a longer segment (and holds a cluster),
        else 0 (whole segments)."""
        if self.tail_segment >= 0:
            return self.tail_segment
        ok = self.segment > 2048 and self.segment % 2048 == 0 and self.cluster_size <= 2048
        return 2048 if ok else 0

    def replace(self, **kw: Any) -> "NelssaConfig":
        return dataclasses.replace(self, **kw)


# Environment variable -> (field, parser). The only place environment variables are read.
ENV: dict[str, tuple[str, Any]] = {
    "NELSSA_OFF": ("off", _bool),
    "NELSSA_T_INPUT": ("T_input", int),
    "NELSSA_BUDGET": ("budget", float),
    "NELSSA_ESTIMATE": ("estimate", _bool),
    "NELSSA_GRAPHS": ("graphs", _bool),
    "NELSSA_SELECT_KERNEL": ("select_kernel", _bool),
    "NELSSA_KMEANS_KERNEL": ("kmeans_kernel", _bool),
    "NELSSA_HANDOFF_AHEAD": ("handoff_ahead", _bool),
    "NELSSA_LANE": ("lane", _bool),
    "NELSSA_STALL_LOG_MS": ("stall_log_ms", float),
    "NELSSA_SINK": ("sink", int),
    "NELSSA_RECENT": ("recent", int),
    "NELSSA_CHUNK": ("chunk", int),
    "NELSSA_LANE_SPEC": ("lane_spec", _bool),
    "NELSSA_LANE_HOST_CALLS": ("lane_host_calls", _bool),
    "NELSSA_LANE_BATCH_GRAPH": ("lane_batch_graph", _bool),
    "NELSSA_LANE_HOST_WAIT": ("lane_host_wait", str),
    "NELSSA_LANE_CONNECTIONS": ("lane_connections", int),
    "NELSSA_LANE_CHAIN": ("lane_chain", _bool),
    "NELSSA_LANE_OVERLAP": ("lane_overlap", _bool),
    "NELSSA_STEP_PRIORITY": ("step_priority", int),
    "NELSSA_LANE_SMS": ("lane_sms", int),
    "NELSSA_LONG_PREFILLS": ("long_prefills", int),
    "NELSSA_LONG_CHUNK": ("long_chunk", int),
    "NELSSA_LONG_CHUNK_SOLO": ("long_chunk_solo", int),
    "NELSSA_SHORT_CHUNK": ("short_chunk", int),
    "NELSSA_SHORT_CHUNK_DECODE": ("short_chunk_decode", int),
    "NELSSA_MIGRATE": ("migrate", _bool),
    "NELSSA_MIGRATE_WATERMARK": ("migrate_watermark", float),
    "NELSSA_MIGRATE_LEAD_STEPS": ("migrate_lead_steps", int),
    "NELSSA_RECALL": ("recall", _bool),
    "NELSSA_SWITCH_HOLD_S": ("switch_hold_s", float),
    "NELSSA_DEFER_BELOW": ("defer_below", int),
    "NELSSA_ENGINE": ("engine", str),
    "NELSSA_NODE_ADDRESS": ("node_address", str),
    "NELSSA_NODE_TOKEN": ("node_token", str),
    "NELSSA_NODE_TRANSPORT": ("node_transport", str),
    "NELSSA_NODE_LEASE_S": ("node_lease_s", float),
    "NELSSA_HANDOVER": ("handover", _bool),
    "NELSSA_HANDOVER_WAIT_S": ("handover_wait_s", float),
    "NELSSA_HANDOVER_WINDOW": ("handover_window", _bool),
    "NELSSA_NODE_SPIN_US": ("node_spin_us", int),
    "NELSSA_NODE_MARGIN_US": ("node_margin_us", int),
    "NELSSA_TAIL_SEGMENT": ("tail_segment", int),
    "NELSSA_SEED": ("seed", int),
    "NELSSA_USE_CPP": ("use_cpp", _bool),
    "NELSSA_POOL_THREADS": ("pool_threads", int),
    "NELSSA_AFFINITY_CORES": ("affinity_cores", parse_cores),
    "NELSSA_POOL_SPIN_US": ("pool_spin_us", int),
    "NELSSA_HOST_CAPACITY": ("host_capacity", parse_bytes),
    "NELSSA_HOST_RESERVE": ("host_reserve", parse_bytes),
    "NELSSA_HOST_TIMEOUT_S": ("host_timeout_s", float),
    "NELSSA_PREFETCH_ROWS": ("prefetch_rows", int),
    "NELSSA_PREFETCH": ("prefetch", str),
    "NELSSA_FAULT": ("fault", str),
    "NELSSA_CALIBRATION": ("calibration", str),
}

_FIELDS = {f.name for f in dataclasses.fields(NelssaConfig)}
_CONVERT = {"affinity_cores": parse_cores, "host_capacity": parse_bytes, "host_reserve": parse_bytes}


def load_config(additional_config: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None) -> NelssaConfig:
    """Build the config from vLLM's additional_config (its "nelssa" key) and the environment."""
    env = os.environ if env is None else env
    kw: dict[str, Any] = {}
    section = (additional_config or {}).get("nelssa")
    if section is not None:
        if not isinstance(section, Mapping):
            raise ValueError(f'additional_config["nelssa"] must be an object, got {type(section).__name__}')
        unknown = sorted(set(section) - _FIELDS)
        if unknown:
            raise ValueError(f'unknown nelssa config keys {unknown}; known: {sorted(_FIELDS)}')
        for k, v in section.items():
            kw[k] = _CONVERT[k](v) if k in _CONVERT else v
    for var, (name, parse) in ENV.items():
        if var in env:
            try:
                kw[name] = parse(env[var])
            except ValueError as e:
                raise ValueError(f"{var}={env[var]!r}: {e}") from None
    if kw.get("calibration") and "T_input" not in kw:
        kw["T_input"] = calibrated_t_input(kw["calibration"])
    return NelssaConfig(**kw)


def calibrated_t_input(path: str) -> int:
    """T_input of a `nelssa calibrate` JSON (its crossover L*(N) at the N and batch it names)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"nelssa config: cannot read calibration {path!r}: {e}") from None
    if not isinstance(doc, dict) or doc.get("kind") != "nelssa-calibration":
        raise ValueError(f"nelssa config: {path!r} is not a `nelssa calibrate` JSON")
    t = doc.get("T_input")
    if not isinstance(t, int) or t < 1:
        raise ValueError(f"nelssa config: calibration {path!r} has no crossover (T_input {t!r}: the host path "
                         "never beats dense attention there); set T_input explicitly")
    return t


def vllm_nelssa_config(additional_config: Mapping[str, Any] | None,
                       block_size: int | None = None, device_type: str | None = None) -> NelssaConfig | None:
    """The config when NELSSA is enabled for a vLLM instance: a "nelssa" section in its
    additional_config and NELSSA_OFF unset. None means stock vLLM (the baseline).

    ``device_type`` (vLLM's ``device_config.device_type``): ``handoff_ahead`` left unset is on with "cuda"
    only, and ``lane`` left unset is on with "cuda" —
    without the lane every step that carries a long request's row waits for the host tier each layer
    (on the H200 72 ms for everyone in the step against 6) — and off elsewhere (on CPU the lane's thread
    computes on the engine's own cores) and on a prefill instance that hands its long prompts over
    (``handover``: it decodes none of them).

    ``block_size`` (the engine's KV block size; every part of an engine passes the same one): the
    sink is rounded up to whole blocks. A request's first block is never freed (the host range
    starts at a block boundary), so the tokens of a partial sink block past ``sink`` were on the
    device and on the host both; and the window attention reads whole blocks from position 0 and
    from H, which a partial sink block breaks (the lane's captured batch needs it: on 64-token
    blocks a 16-token sink left every lane batch uncaptured, H200 P/D run of the 27th session).
    A P/D pair derives the same sink from the same block size (the hand-over requires it)."""
    cfg = load_config(additional_config)
    if not (cfg.enabled and "nelssa" in (additional_config or {})):
        return None
    if block_size and cfg.sink % block_size:
        cfg = cfg.replace(sink=-(-cfg.sink // block_size) * block_size)
    if cfg.lane is None:
        cfg = cfg.replace(lane=device_type == "cuda" and not cfg.handover)
    if cfg.handoff_ahead is None:
        cfg = cfg.replace(handoff_ahead=device_type == "cuda")
    return cfg


def engine_config(vllm_config: Any) -> NelssaConfig | None:
    """``vllm_nelssa_config`` of a vLLM instance's VllmConfig: its additional_config, KV block size and
    device type. The scheduler, worker, runner and model all call this, so they derive one config."""
    return vllm_nelssa_config(vllm_config.additional_config, vllm_config.cache_config.block_size,
                              vllm_config.device_config.device_type)


_current: NelssaConfig | None = None


def get_config() -> NelssaConfig:
    """The process-wide config (environment only until set_config is called)."""
    global _current
    if _current is None:
        _current = load_config()
    return _current


def set_config(cfg: NelssaConfig) -> None:
    global _current
    _current = cfg
