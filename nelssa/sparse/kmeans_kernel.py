"""Spherical k-means iterations as Triton kernels: 3 launches per iteration, no logits in memory.

kmeans.segmented_kmeans in torch is, per iteration of a group of layers, a bmm writing fp32 logits
[H, n, C] (1 GiB for 8 layers' 8 KV heads, 8,192 tokens and 512 clusters), an argmax reading them back
and ~8 small operations for the update. A background move of a long prompt runs them beside the
engine's steps: on the H100 (hol run 119p's profile) one 8K-token move of 32 layers launched ~1,150
kernels on the hand-off stream, of which the argmax's reduction took 95 ms and the bmm 36 of its 183 ms of
device time, and its thread, sharing the GIL with the step and lane threads, issued ~5 launches a
millisecond. Here, per iteration:

  1. ``sums.zero_()``: the members' sums and counts [H, C, D + 1] fp32;
  2. ``_assign_kernel`` (grid: tiles of ``BLOCK_N`` tokens x H): each program holds its tokens' unit rows,
     scores them against every centroid in tiles of ``BLOCK_C`` (``tl.dot``, fp32 accumulation) keeping a
     running maximum and its index, writes the labels and, with ``ACC``, adds each row (in fp32) and a 1
     to its cluster's sums and count (atomics);
  3. ``_finish_kernel`` (grid: tiles of ``BLOCK_C`` clusters x H): each cluster's centroid becomes its
     normalised sum where it has members (an empty one keeps its centroid), written in fp32 and in the
     similarity dtype the next assignment reads.
The last, global assignment is ``_assign_kernel`` without ``ACC``.

The rule is the torch path's: the nearest centroid by dot product, ties to the lowest index (the
running maximum takes a tile's value only when strictly larger, and a tile's own maximum its first
index), new centroid = normalised sum of the members. The products accumulate in another order than
cuBLAS's, so a token whose two best centroids are within the last bits of each other may go the other
way; the sums' atomics are unordered (as torch's scatter_add on CUDA).
Runs on CUDA, and on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``: the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 128  # tokens per assignment program
BLOCK_C = 64   # centroids per scoring tile
NUM_WARPS = 8  # per assignment program. At a move's shape (16 layers' 8 KV heads, an 8K segment, 1,024
               # clusters) on an H100, an iteration took 2.03 ms at 128x64x8 against 2.53 at 64x64x4 and 3.96
               # in torch (benchmarks/bench_kmeans_kernel.py, docs/results.md 2026-12-07; labels agree 1.0);
               # 128x128x8 tied
BLOCK_F = 32   # centroids per finishing program


@triton.jit(do_not_specialize=["n", "C", "sx_h", "sc_h", "sl_h", "ss_h"])
def _assign_kernel(x_ptr, c_ptr, lab_ptr, s_ptr, n, C, sx_h, sx_n, sc_h, sc_c, sl_h, ss_h, ss_c,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                   ACC: tl.constexpr, IEEE: tl.constexpr):
    h = tl.program_id(1).to(tl.int64)  # offsets in int64: H x L x D may pass 2^31 in one group
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    in_r = rows < n
    in_d = d < D
    x = tl.load(x_ptr + h * sx_h + rows[:, None] * sx_n + d[None, :], mask=in_r[:, None] & in_d[None, :], other=0.0)
    best = tl.full([BLOCK_N], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK_N], tl.int32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        in_c = cols < C
        cen = tl.load(c_ptr + h * sc_h + cols[:, None] * sc_c + d[None, :], mask=in_c[:, None] & in_d[None, :],
                      other=0.0)
        if IEEE:
            s = tl.dot(x, tl.trans(cen), input_precision="ieee")
        else:
            s = tl.dot(x, tl.trans(cen))
        s = tl.where(in_c[None, :], s, float("-inf"))
        m, a = tl.max(s, axis=1, return_indices=True, return_indices_tie_break_left=True)
        take = m > best
        best = tl.where(take, m, best)
        arg = tl.where(take, a + c0, arg)
    tl.store(lab_ptr + h * sl_h + rows, arg.to(tl.int64), mask=in_r)
    if ACC:
        row = s_ptr + h * ss_h + arg * ss_c
        tl.atomic_add(row[:, None] + d[None, :], x.to(tl.float32), mask=in_r[:, None] & in_d[None, :], sem="relaxed")
        tl.atomic_add(row + D, tl.full([BLOCK_N], 1.0, tl.float32), mask=in_r, sem="relaxed")


@triton.jit(do_not_specialize=["C", "ss_h", "sc_h", "so_h"])
def _finish_kernel(s_ptr, c_ptr, o_ptr, C, ss_h, ss_c, sc_h, sc_c, so_h, so_c,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr):
    h = tl.program_id(1).to(tl.int64)  # offsets in int64: H x L x D may pass 2^31 in one group
    cols = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
    d = tl.arange(0, BLOCK_D)
    in_c = cols < C
    m = in_c[:, None] & (d[None, :] < D)
    s = tl.load(s_ptr + h * ss_h + cols[:, None] * ss_c + d[None, :], mask=m, other=0.0)
    cnt = tl.load(s_ptr + h * ss_h + cols * ss_c + D, mask=in_c, other=0.0)
    old = tl.load(c_ptr + h * sc_h + cols[:, None] * sc_c + d[None, :], mask=m, other=0.0)
    norm = tl.sqrt(tl.sum(s * s, axis=1))
    new = tl.where((cnt > 0)[:, None], s / tl.maximum(norm, 1e-12)[:, None], old)
    tl.store(c_ptr + h * sc_h + cols[:, None] * sc_c + d[None, :], new, mask=m)
    tl.store(o_ptr + h * so_h + cols[:, None] * so_c + d[None, :], new.to(o_ptr.dtype.element_ty), mask=m)


def _check(x: torch.Tensor, cent: torch.Tensor) -> None:
    if x.stride(2) != 1 or cent.stride(2) != 1:
        raise ValueError("kmeans kernels: rows and centroids must be contiguous in their last dim")
    if x.dtype != cent.dtype or x.shape[0] != cent.shape[0] or x.shape[2] != cent.shape[2]:
        raise ValueError(f"kmeans kernels: rows {tuple(x.shape)} {x.dtype} and centroids {tuple(cent.shape)} "
                         f"{cent.dtype} do not match")


def assign(x: torch.Tensor, cent: torch.Tensor, labels: torch.Tensor, sums: torch.Tensor | None = None, *,
           block_n: int = BLOCK_N, block_c: int = BLOCK_C, num_warps: int = NUM_WARPS) -> None:
    """Labels [H, n] int64 (written) of unit rows x [H, n, D] against centroids cent [H, C, D] (same dtype):
    the nearest by dot product (2). With ``sums`` [H, C, D + 1] fp32 (zeroed by the caller), each row is also
    added to its cluster's sum and 1 to its count. ``block_n``, ``block_c``, ``num_warps``: the tiling
    (benchmarks/bench_kmeans_kernel.py compares some on the GPU)."""
    _check(x, cent)
    H, n, D = x.shape
    if labels.shape != (H, n) or labels.dtype != torch.int64 or labels.stride(1) != 1:
        raise ValueError(f"kmeans kernels: labels must be [H, n] int64, contiguous rows; got {tuple(labels.shape)} "
                         f"{labels.dtype}")
    acc = sums is not None
    if acc and (sums.shape != (H, cent.shape[1], D + 1) or sums.dtype != torch.float32 or sums.stride(2) != 1):
        raise ValueError(f"kmeans kernels: sums must be [H, C, D + 1] fp32, got {tuple(sums.shape)} {sums.dtype}")
    s = sums if acc else labels  # a placeholder pointer without ACC
    _assign_kernel[(triton.cdiv(n, block_n), H)](
        x, cent, labels, s, n, cent.shape[1], x.stride(0), x.stride(1), cent.stride(0), cent.stride(1),
        labels.stride(0), s.stride(0) if acc else 0, s.stride(1) if acc else 0,
        D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_N=block_n, BLOCK_C=block_c, ACC=acc,
        IEEE=x.dtype == torch.float32, num_warps=num_warps)


def finish(sums: torch.Tensor, cent: torch.Tensor, out: torch.Tensor) -> None:
    """Centroids from the sums (3): ``cent`` [H, C, D] fp32 updated in place, ``out`` (same shape, the
    similarity dtype) written with them."""
    H, C, D = cent.shape
    if cent.dtype != torch.float32 or cent.stride(2) != 1 or out.shape != cent.shape or out.stride(2) != 1:
        raise ValueError("kmeans kernels: finish needs fp32 centroids and an output of their shape")
    _finish_kernel[(triton.cdiv(C, BLOCK_F), H)](
        sums, cent, out, C, sums.stride(0), sums.stride(1), cent.stride(0), cent.stride(1), out.stride(0),
        out.stride(1), D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_F=BLOCK_F, num_warps=4)
