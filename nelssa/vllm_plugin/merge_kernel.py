"""One launch that merges a split-attention layer's partial states into its output rows (CUDA only).

An offloaded row's attention is the LSE merge of up to four partial attentions over disjoint token
sets: the window's sink and recent blocks (FlashAttention), the centroid estimate of the unselected
clusters and the host tier's result over the selected ones. ``merge_into`` computes, per row r and
query head h, with M the largest of the LSEs (-inf = an empty part):

    out = sum_i exp(lse_i - M) * out_i / sum_i exp(lse_i - M)      (0 where every part is empty)

and stores it in the layer's output at the row's token index, in the output's dtype. It replaces
two LSE merges (8 launches each in torch), the casts and the write-back (the H200 profile: 46 ms of a
168 ms offloaded step). Parts are any [n, Hq, D] tensors with unit stride over D, any dtype, and LSEs
as [n, Hq] views of any strides (FlashAttention's [Hq, n] LSE passes as its transpose).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _part(o, o_s0, o_s1, lp, l_s0, l_s1, r, h, d, m, M, acc, tot):
    lv = tl.load(lp + r * l_s0 + h * l_s1)
    w = tl.exp(lv - M)  # 0 for an empty part (lse -inf), M finite
    x = tl.load(o + r * o_s0 + h * o_s1 + d, mask=m, other=0.0).to(tl.float32)
    return acc + tl.where(w > 0, w * x, 0.0), tot + w


# strides vary with the batch (FlashAttention's LSE passes as a [Hq, n] transpose: its row stride is n);
# specialised on them, the kernel recompiled whenever a lane batch's size changed, on the lane thread and
# under the GIL: the step thread stalled ~350 ms (H200, run 16, right after each long request's first
# token). Strides are plain arguments, so one compilation per part count and dtypes serves every batch.
_STRIDES = [f"{p}_s{i}" for p in ("dst", "o0", "l0", "o1", "l1", "o2", "l2", "o3", "l3") for i in (0, 1)]


@triton.jit(do_not_specialize=_STRIDES)
def _merge_kernel(dst, dst_s0, dst_s1, tok,
                  o0, o0_s0, o0_s1, l0, l0_s0, l0_s1,
                  o1, o1_s0, o1_s1, l1, l1_s0, l1_s1,
                  o2, o2_s0, o2_s1, l2, l2_s0, l2_s1,
                  o3, o3_s0, o3_s1, l3, l3_s0, l3_s1,
                  N_IN: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    M = tl.load(l0 + r * l0_s0 + h * l0_s1)
    if N_IN > 1:
        M = tl.maximum(M, tl.load(l1 + r * l1_s0 + h * l1_s1))
    if N_IN > 2:
        M = tl.maximum(M, tl.load(l2 + r * l2_s0 + h * l2_s1))
    if N_IN > 3:
        M = tl.maximum(M, tl.load(l3 + r * l3_s0 + h * l3_s1))
    M = tl.where(M == float("-inf"), 0.0, M)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    tot = 0.0
    acc, tot = _part(o0, o0_s0, o0_s1, l0, l0_s0, l0_s1, r, h, d, m, M, acc, tot)
    if N_IN > 1:
        acc, tot = _part(o1, o1_s0, o1_s1, l1, l1_s0, l1_s1, r, h, d, m, M, acc, tot)
    if N_IN > 2:
        acc, tot = _part(o2, o2_s0, o2_s1, l2, l2_s0, l2_s1, r, h, d, m, M, acc, tot)
    if N_IN > 3:
        acc, tot = _part(o3, o3_s0, o3_s1, l3, l3_s0, l3_s1, r, h, d, m, M, acc, tot)
    res = tl.where(tot > 0, acc / tot, 0.0)
    row = tl.load(tok + r)
    tl.store(dst + row * dst_s0 + h * dst_s1 + d, res.to(dst.dtype.element_ty), mask=m)


def merge_into(dst: torch.Tensor, tok: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst[tok[r], h] = LSE merge of parts' (out [n, Hq, D], lse [n, Hq]) for each row r, head h."""
    if not 1 <= len(parts) <= 4:
        raise ValueError(f"merge_into takes 1 to 4 parts, got {len(parts)}")
    n, hq, d = parts[0][0].shape
    if dst.dim() != 3 or dst.shape[1:] != (hq, d) or dst.stride(2) != 1:
        raise ValueError(f"output must be [T, {hq}, {d}] with unit stride over D, got {tuple(dst.shape)}")
    args = []
    for o, lse in parts:
        if o.shape != (n, hq, d) or lse.shape != (n, hq) or o.stride(2) != 1 or lse.dtype != torch.float32:
            raise ValueError(f"part shapes {tuple(o.shape)} / {tuple(lse.shape)} {lse.dtype}: expected "
                             f"({n}, {hq}, {d}) with unit stride over D and fp32 ({n}, {hq})")
        args += [o, o.stride(0), o.stride(1), lse, lse.stride(0), lse.stride(1)]
    while len(args) < 24:  # unused slots (N_IN excludes them at compile time)
        args += args[:6]
    if n:
        _merge_kernel[(n, hq)](dst, dst.stride(0), dst.stride(1), tok, *args, N_IN=len(parts), D=d,
                               BLOCK_D=triton.next_power_of_2(d))
