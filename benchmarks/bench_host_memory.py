"""A move's copy into host-tier memory: fresh pages vs the reservation (sparse/hostmem.py, config host_reserve).

A move packs every layer's clustered K/V into host memory (``clustered.pack``: on CUDA a gather on the
device and ``to_host``, on the CPU the C++ row copy). This times exactly that for one move of the model's
shape (default: 8,192 tokens x 32 layers x 8 KV heads x 128, bf16 = 1 GiB; random cluster order, no
k-means), the parts held until the move's end as a request holds them, then freed:

  fresh      nothing reserved: every part maps new memory and the copy pays its page faults (and, on
             CUDA, goes through the pinned staging buffers and a host-side copy on this thread);
  reserved   after ``hostmem.configure(--reserve)``: the parts come from memory touched at start and, with
             CUDA, registered with the driver (one DMA per part, no host-side copy).

Per mode ``--moves`` moves; GB/s of K/V per move (median, min, max), the parts that did not come from
the reservation, and the reservation's own time. Writes host_memory.json.

    python3 benchmarks/bench_host_memory.py --out DIR [--tokens 8192] [--layers 32] [--moves 5]
        [--reserve 4GiB] [--device cuda|cpu] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from nelssa.config import get_config, parse_bytes, set_config
from nelssa.sparse import hostmem, pack


def moves(keys, values, perm, n: int, sync) -> list[float]:
    """Seconds of each of ``n`` moves: every layer packed into host memory, held until the move ends."""
    out = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        held = [pack(k, v, perm) for k, v in zip(keys, values)]
        sync()
        out.append(time.perf_counter() - t)
        del held
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per move (a long prompt's segment)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--moves", type=int, default=5)
    ap.add_argument("--reserve", default="4GiB", help="host_reserve for the second mode (>= one move's bytes)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's threads on this thread (an engine's GPU worker runs 1: vLLM sets OMP_NUM_THREADS=1)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(a.threads)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    H, n, D, L = a.kv_heads, a.tokens, a.head_dim, a.layers
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(H, n, D, generator=g).to(dev, dtype) for _ in range(L)]
    values = [torch.randn(H, n, D, generator=g).to(dev, dtype) for _ in range(L)]
    perm = torch.stack([torch.randperm(n, generator=g) for _ in range(H)]).to(dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    nbytes = 2 * L * H * n * D * torch.finfo(dtype).bits // 8
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "tokens": n, "layers": L,
           "kv_heads": H, "head_dim": D, "dtype": a.dtype, "move_bytes": nbytes, "threads": a.threads, "modes": {}}
    pack(keys[0], values[0], perm)  # one-time set-up (staging buffers, the extension's team)

    def record(mode: str, secs: list[float], mapped: int) -> None:
        gbs = [nbytes / s / 1e9 for s in secs]
        res["modes"][mode] = {"move_s": secs, "gb_per_s_median": statistics.median(gbs), "gb_per_s_min": min(gbs),
                              "gb_per_s_max": max(gbs), "new_mappings_per_move": mapped / len(secs)}
        print(f"[host-memory] {mode:>8}: {statistics.median(gbs):6.1f} GB/s per move (min {min(gbs):.1f}, max "
              f"{max(gbs):.1f}), {mapped / len(secs):.0f} new mappings per move", flush=True)

    m0 = hostmem.stats()["misses"]
    record("fresh", moves(keys, values, perm, a.moves, sync), hostmem.stats()["misses"] - m0)
    reserve = parse_bytes(a.reserve)
    if reserve < nbytes:
        raise SystemExit(f"--reserve {a.reserve} is less than one move ({nbytes} B)")
    set_config(get_config().replace(host_reserve=reserve))
    t = time.perf_counter()
    hostmem.configure(reserve, threads=2)
    hostmem.wait_reserved()
    if dev.type == "cuda":
        hostmem.register_cuda(dev)
    res["reserve_s"] = time.perf_counter() - t
    res["host_memory"] = hostmem.stats()
    print(f"[host-memory] reserved {reserve / 2**30:.2f} GiB in {res['reserve_s']:.1f} s "
          f"(registered with CUDA: {res['host_memory']['registered_bytes'] / 2**30:.2f} GiB)", flush=True)
    m0 = hostmem.stats()["misses"]
    record("reserved", moves(keys, values, perm, a.moves, sync), hostmem.stats()["misses"] - m0)
    res["speedup"] = res["modes"]["reserved"]["gb_per_s_median"] / res["modes"]["fresh"]["gb_per_s_median"]
    with open(os.path.join(a.out, "host_memory.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
