"""The centroid search as Triton kernels: 3B + 2 launches per layer (B + 1 without the estimate) for B
requests instead of ~45 per request.

``search.select_clusters`` in torch is, per layer, a bmm per request, a softmax, two sorts (argsort of
the masses, sort of the kept ids), a cumsum, gathers, masks and the estimate's softmax and bmm: on the
H200 (run 12's profile) 139 operations per layer of a lane batch, the scoring bmm reading the
centroids at ~170 GB/s and the sorts 4.3 ms of a 28 ms batch. Here the same result, per layer:

  1. ``_score_kernel`` (per request; grid: KV heads x tiles of ``BLOCK_C`` clusters): each program
     reads its tile of centroids once (GEMV-shaped: the GQA group's few query heads against many
     centroids) and writes the scaled logits into a padded [B, H, G, Cmax] buffer, -inf for empty
     clusters and for the padding past the request's clusters, and the padded sizes [B, H, Cmax].
  2. ``_select_kernel`` (grid: B x H, one program per request and KV head):
     a. softmax statistics per query head (running max and sum over tiles of ``BLOCK`` clusters);
     b. the mass of each cluster, the group's softmax probabilities summed (-1 for empty clusters),
        into a scratch row;
     c. the threshold: the largest mass T (searched over its float32 bits, which order non-negative
        floats, ``K``-ary: K-1 candidates per pass over the row, 8 passes for 31 bits) such that the
        clusters of mass >= T hold at least the request's budget of tokens (T = 0 when all of them
        hold fewer). The search starts from the row's own range (b keeps the smallest and the largest
        non-empty mass), so close masses take fewer passes: 4-5 of the 8 for rows of near-uniform masses
        (small logits), 7 for random unit-scale ones, none where every mass is the same float; a pass over
        a range already one wide is skipped. vLLM's dummy weights (uniform in +-1e-3) give logits of ~1e-8
        and such rows, so a benchmark on them times this kernel without its passes, a real model's with ~7.
        (Passes after the first two over only the clusters still in range, compacted, made this kernel
        slower in the hol run, 211 against 132 us a layer, likely as with such rows no cluster leaves the
        range; docs/results.md, 2026-12-06.) This replaces sorting by mass: a cluster of mass > T is
        selected, and of those of mass == T, in ascending id, each while the tokens before it (mass > T,
        then earlier ties) are fewer than the budget, which is exactly the torch path's rule (descending
        mass, ties by ascending id, keep while the tokens before are fewer than the budget);
     d. the selected ids, compacted in ascending order (a prefix sum per tile plus a carry), the row
        padded with ``Cmax`` to Cmax entries, and the count;
     e. with ``ESTIMATE`` (``_weights_kernel``, grid B x H, launched with 3: a search that defers its
        estimate leaves both until the caller asks, lane_host.py 3a): over the unselected non-empty
        clusters, each counting as size x exp(logit), the log-sum-exp per query head, and the softmax
        weights written over the logits (0 elsewhere).
  3. ``_estimate_kernel`` (per request, with ``ESTIMATE``; grid: KV heads x splits of ``SPLIT``
     clusters): the weights times the value means, partial sums per split, summed by one ``sum``.
Outputs as the torch path's: ids [B, H, Cmax] int64 ascending (the first ``counts`` valid, then
Cmax), counts [B, H] int64, the estimate (out [B, Hq, D], lse [B, Hq]) fp32. The products round the
queries (and the weights) to the centroids' dtype and accumulate in fp32, like the torch path's
bmm; sums run in another order, so masses can differ in the last bits from torch's and a near-tie
may go the other way.
Runs on CUDA, and on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``: the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 64     # clusters per scoring program
BLOCK = 1024     # clusters per tile of the selection
SBLOCK = 512     # clusters per tile of the threshold search
K = 16           # candidates per pass of the threshold search (8 passes cover the 31 bits)
PASSES = 8
SPLIT = 128      # clusters per program of the estimate
BLOCK_E = 64     # clusters per step of an estimate program


@triton.jit(do_not_specialize=["C", "CMAX", "sq_h", "sc_h", "sc_c", "ss_h", "b"])
def _score_kernel(q_ptr, c_ptr, s_ptr, lg_ptr, sz_ptr, C, CMAX, scale, b,
                  sq_h, sc_h, sc_c, ss_h,
                  G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_C: tl.constexpr, IEEE: tl.constexpr):
    h = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    offs_g = tl.arange(0, BLOCK_G)
    in_c = offs_c < C
    cen = tl.load(c_ptr + h * sc_h + offs_c[:, None] * sc_c + offs_d[None, :],
                  mask=in_c[:, None] & (offs_d[None, :] < D), other=0.0)
    q = tl.load(q_ptr + h * sq_h + offs_g[:, None] * D + offs_d[None, :],
                mask=(offs_g[:, None] < G) & (offs_d[None, :] < D), other=0.0)
    q = q.to(c_ptr.dtype.element_ty)  # as the torch path: queries in the centroids' dtype, fp32 accumulation
    if IEEE:
        lg = tl.dot(q, tl.trans(cen), input_precision="ieee")
    else:
        lg = tl.dot(q, tl.trans(cen))
    sz = tl.load(s_ptr + h * ss_h + offs_c, mask=in_c, other=0)
    lg = tl.where((sz > 0)[None, :], lg * scale, float("-inf"))
    row = (b * tl.num_programs(0) + h).to(tl.int64)
    in_row = offs_c < CMAX
    tl.store(sz_ptr + row * CMAX + offs_c, sz, mask=in_row)
    tl.store(lg_ptr + (row * G + offs_g[:, None]) * CMAX + offs_c[None, :], lg,
             mask=(offs_g[:, None] < G) & in_row[None, :])


@triton.jit
def _softmax_stats(lrow, srow, mrow, CMAX, offs_g, in_g, offs, REST: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_G: tl.constexpr):
    """Max and sum of exp over a row, per query head -> (max, sum) [BLOCK_G]: running per element
    over the tiles, reduced once. With ``REST``: only the unselected non-empty clusters (scratch
    mass >= 0), logits + log(size)."""
    m = tl.full([BLOCK_G, BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_G, BLOCK], tl.float32)
    for start in range(0, CMAX, BLOCK):
        c = start + offs
        in_c = c < CMAX
        x = tl.load(lrow + offs_g[:, None] * CMAX + c[None, :], mask=in_g[:, None] & in_c[None, :],
                    other=float("-inf"))
        if REST:
            mass = tl.load(mrow + c, mask=in_c, other=-1.0)
            szf = tl.load(srow + c, mask=in_c, other=1).to(tl.float32)
            x = tl.where((mass >= 0)[None, :], x + tl.log(tl.maximum(szf, 1.0))[None, :], float("-inf"))
        nm = tl.maximum(m, x)
        safe = tl.where(nm == float("-inf"), 0.0, nm)
        s = s * tl.exp(m - safe) + tl.exp(x - safe)
        m = nm
    mx = tl.max(m, 1)
    safe = tl.where(mx == float("-inf"), 0.0, mx)
    return mx, tl.sum(s * tl.exp(m - safe[:, None]), 1)


@triton.jit(do_not_specialize=["H", "CMAX"])
def _select_kernel(lg_ptr, sz_ptr, target_ptr, mass_ptr, ids_ptr, cnt_ptr, H, CMAX,
                   G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK: tl.constexpr, SBLOCK: tl.constexpr,
                   K: tl.constexpr, PASSES: tl.constexpr, ESTIMATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = row // H
    lrow = lg_ptr + row * G * CMAX
    srow = sz_ptr + row * CMAX
    mrow = mass_ptr + row * CMAX
    target = tl.load(target_ptr + b).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    offs_g = tl.arange(0, BLOCK_G)
    in_g = offs_g < G
    # a. softmax statistics per query head
    m, s = _softmax_stats(lrow, srow, mrow, CMAX, offs_g, in_g, offs, False, BLOCK, BLOCK_G)
    safe_m = tl.where(m == float("-inf"), 0.0, m)
    inv_s = tl.where(s > 0, 1.0 / s, 0.0)
    # b. masses (-1: empty); the non-empty ones' smallest and largest bits and their tokens, for c's range
    b_lo = tl.full([BLOCK], 0x7FFFFFFF, tl.int32)
    b_hi = tl.full([BLOCK], -1, tl.int32)
    n_tok = tl.zeros([BLOCK], tl.int64)
    for start in range(0, CMAX, BLOCK):
        c = start + offs
        in_c = c < CMAX
        x = tl.load(lrow + offs_g[:, None] * CMAX + c[None, :], mask=in_g[:, None] & in_c[None, :],
                    other=float("-inf"))
        p = tl.exp(x - safe_m[:, None]) * inv_s[:, None]
        mass = tl.sum(tl.where(in_g[:, None], p, 0.0), 0)
        sz = tl.load(srow + c, mask=in_c, other=0)
        full = sz > 0
        tl.store(mrow + c, tl.where(full, mass, -1.0), mask=in_c)
        mbits = mass.to(tl.int32, bitcast=True)
        b_lo = tl.minimum(b_lo, tl.where(full, mbits, 0x7FFFFFFF))
        b_hi = tl.maximum(b_hi, tl.where(full, mbits, -1))
        n_tok += tl.where(full, sz, 0).to(tl.int64)
    tl.debug_barrier()  # the row's masses, written by all threads, are read across threads from here
    # c. threshold: the largest T with tokens(mass >= T) >= target, K-ary over the float bits;
    # invariant: tokens(>= lo) >= target (or lo = 0), tokens(>= hi) < target, s_hi = tokens(>= hi).
    # It starts from the row's own range: lo = the smallest mass's bits when all the row's tokens reach the
    # target, hi = one above the largest's (no cluster at or above it), so a row of close masses needs fewer
    # passes; a pass over a range already one wide would change nothing and is skipped.
    lo = tl.where(tl.sum(n_tok, 0) >= target, tl.min(b_lo, 0), 0).to(tl.int64)
    hi = (tl.max(b_hi, 0) + 1).to(tl.int64)
    hi = tl.maximum(hi, lo + 1)
    s_hi = tl.zeros([], tl.int64)
    ks = tl.arange(0, K)
    soffs = tl.arange(0, SBLOCK)
    for _ in range(PASSES):
        step = (hi - lo + K - 1) // K
        cand = lo + ks.to(tl.int64) * step                    # [K]; cand[0] = lo
        cand32 = tl.minimum(cand, 0x7FFFFFFF).to(tl.int32)
        part = tl.zeros([K, SBLOCK], tl.int32)                # per element, reduced once per pass
        end = tl.where(hi - lo > 1, CMAX, 0).to(tl.int32)    # 0: the range is one wide, nothing to narrow
        for start in range(0, end, SBLOCK):
            c = start + soffs
            in_c = c < CMAX
            bits = tl.load(mrow + c, mask=in_c, other=-1.0).to(tl.int32, bitcast=True)
            sz = tl.load(srow + c, mask=in_c, other=0)
            part += tl.where(bits[None, :] >= cand32[:, None], sz[None, :], 0)
        acc = tl.sum(part, 1).to(tl.int64)
        ok = (acc >= target) & (ks > 0) & (cand < hi)
        n_ok = tl.sum(ok.to(tl.int64), 0)
        new_lo = lo + n_ok * step
        nxt = (ks == n_ok + 1) & (cand < hi)                  # the first candidate below the target
        has = tl.sum(nxt.to(tl.int64), 0) > 0
        s_hi = tl.where(has, tl.sum(tl.where(nxt, acc, 0), 0), s_hi)
        hi = tl.where(has, new_lo + step, hi)
        lo = new_lo
    # now hi == lo + 1: s_hi = tokens(mass > lo)
    # d. compaction in ascending id; ties at lo in ascending id while the tokens before stay < target
    n_sel = tl.zeros([], tl.int64)
    tie_before = s_hi
    for start in range(0, CMAX, BLOCK):
        c = start + offs
        in_c = c < CMAX
        mass = tl.load(mrow + c, mask=in_c, other=-1.0)
        bits = mass.to(tl.int32, bitcast=True).to(tl.int64)
        sz = tl.load(srow + c, mask=in_c, other=0).to(tl.int64)
        tie = (bits == lo) & in_c
        tsz = tl.where(tie, sz, 0)
        before = tie_before + tl.cumsum(tsz, 0) - tsz
        sel = ((bits > lo) | (tie & (before < target))) & in_c
        sel_i = sel.to(tl.int64)
        pos = n_sel + tl.cumsum(sel_i, 0) - sel_i
        tl.store(ids_ptr + row * CMAX + pos, c.to(tl.int64), mask=sel)
        if ESTIMATE:
            tl.store(mrow + c, tl.where(sel, -2.0, mass), mask=in_c)  # -2: selected, -1: empty
        n_sel += tl.sum(sel_i, 0)
        tie_before += tl.sum(tsz, 0)
    for start in range(0, CMAX, BLOCK):
        c = start + offs
        tl.store(ids_ptr + row * CMAX + c, tl.zeros([BLOCK], tl.int64) + CMAX, mask=(c >= n_sel) & (c < CMAX))
    tl.store(cnt_ptr + row, n_sel)


@triton.jit(do_not_specialize=["CMAX"])
def _weights_kernel(lg_ptr, sz_ptr, mass_ptr, lse_ptr, CMAX,
                    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK: tl.constexpr):
    """2e (grid: B x H, after _select_kernel with ESTIMATE): the estimate's log-sum-exp and weights over the
    unselected non-empty clusters (scratch mass >= 0; the selection marked the selected -2)."""
    row = tl.program_id(0).to(tl.int64)
    lrow = lg_ptr + row * G * CMAX
    srow = sz_ptr + row * CMAX
    mrow = mass_ptr + row * CMAX
    offs = tl.arange(0, BLOCK)
    offs_g = tl.arange(0, BLOCK_G)
    in_g = offs_g < G
    em, es = _softmax_stats(lrow, srow, mrow, CMAX, offs_g, in_g, offs, True, BLOCK, BLOCK_G)
    lse = tl.where(es > 0, em + tl.log(es), float("-inf"))
    safe = tl.where(es > 0, lse, 0.0)
    tl.store(lse_ptr + row * G + offs_g, lse, mask=in_g)
    for start in range(0, CMAX, BLOCK):
        c = start + offs
        in_c = c < CMAX
        rest = tl.load(mrow + c, mask=in_c, other=-1.0) >= 0
        szf = tl.load(srow + c, mask=in_c, other=1).to(tl.float32)
        mk = in_g[:, None] & in_c[None, :]
        x = tl.load(lrow + offs_g[:, None] * CMAX + c[None, :], mask=mk, other=float("-inf"))
        w = tl.exp(x + tl.log(tl.maximum(szf, 1.0))[None, :] - safe[:, None])
        w = tl.where(rest[None, :] & (es > 0)[:, None], w, 0.0)
        tl.store(lrow + offs_g[:, None] * CMAX + c[None, :], w, mask=mk)


@triton.jit(do_not_specialize=["C", "CMAX", "sv_h", "sv_c", "b", "H"])
def _estimate_kernel(w_ptr, v_ptr, part_ptr, C, CMAX, b, H, sv_h, sv_c,
                     G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     SPLIT: tl.constexpr, BLOCK_E: tl.constexpr, ROUND_W: tl.constexpr):
    h = tl.program_id(0)
    sp = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    row = (b * H + h).to(tl.int64)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(sp * SPLIT, sp * SPLIT + SPLIT, BLOCK_E):
        c = start + offs_e
        in_c = c < C
        w = tl.load(w_ptr + (row * G + offs_g[:, None]) * CMAX + c[None, :],
                    mask=(offs_g[:, None] < G) & in_c[None, :], other=0.0)
        v = tl.load(v_ptr + h * sv_h + c[:, None] * sv_c + offs_d[None, :],
                    mask=in_c[:, None] & (offs_d[None, :] < D), other=0.0)
        if ROUND_W:  # as the torch path's bmm: the weights in the value means' 16-bit dtype
            acc = tl.dot(w.to(v.dtype), v, acc)
        else:
            acc = tl.dot(w, v.to(tl.float32), acc, input_precision="ieee")
    n_split = tl.num_programs(1)
    out = part_ptr + ((h * n_split + sp) * BLOCK_G + offs_g[:, None]) * D + offs_d[None, :]
    tl.store(out, acc, mask=(offs_g[:, None] < G) & (offs_d[None, :] < D))


def search(q: torch.Tensor, ckvs: list, target: torch.Tensor, scale: float, estimate: bool, defer: bool = False):
    """q [B, H, G, D] on the centroids' device, ``target`` [B] int64 there -> (ids [B, H, Cmax] int64,
    counts [B, H] int64, estimate (out [B, H*G, D], lse [B, H*G]) fp32 or None); see the module
    docstring. Kernels only: no host synchronisation, capturable in a CUDA graph.
    ``defer`` (with ``estimate``): the estimate as a function that enqueues 2e and 3 (on the stream current when
    it is called, after this call's kernels) and returns it, so a caller can let the ids go first."""
    B, H, G, D = q.shape
    dev = q.device
    cmax = max(c.num_clusters for c in ckvs)
    bg, bd = max(16, triton.next_power_of_2(G)), triton.next_power_of_2(D)
    logits = torch.empty(B, H, G, cmax, dtype=torch.float32, device=dev)
    sizes = torch.empty(B, H, cmax, dtype=torch.int32, device=dev)
    mass = torch.empty(B, H, cmax, dtype=torch.float32, device=dev)
    ids = torch.empty(B, H, cmax, dtype=torch.int64, device=dev)
    counts = torch.empty(B, H, dtype=torch.int64, device=dev)
    q = q.contiguous()
    for b, c in enumerate(ckvs):
        cen, sz = c.centroids, c.sizes
        assert cen.stride(2) == 1 and sz.stride(1) == 1, "centroids/sizes must be contiguous in their last dim"
        _score_kernel[(H, triton.cdiv(cmax, BLOCK_C))](
            q[b], cen, sz, logits, sizes, c.num_clusters, cmax, scale, b,
            q.stride(1), cen.stride(0), cen.stride(1), sz.stride(0),
            G=G, BLOCK_G=bg, D=D, BLOCK_D=bd, BLOCK_C=BLOCK_C, IEEE=cen.dtype == torch.float32, num_warps=4)
    _select_kernel[(B * H,)](logits, sizes, target, mass, ids, counts, H, cmax,
                             G=G, BLOCK_G=triton.next_power_of_2(G), BLOCK=BLOCK, SBLOCK=SBLOCK, K=K,
                             PASSES=PASSES, ESTIMATE=estimate, num_warps=16)
    if not estimate:
        return ids, counts, None

    def finish():  # 2e, then 3: the weights (written over the logits) times the value means
        lse = torch.empty(B, H, G, dtype=torch.float32, device=dev)
        _weights_kernel[(B * H,)](logits, sizes, mass, lse, cmax, G=G, BLOCK_G=triton.next_power_of_2(G),
                                  BLOCK=BLOCK, num_warps=16)
        out = torch.empty(B, H, G, D, dtype=torch.float32, device=dev)
        for b, c in enumerate(ckvs):
            vm = c.vmeans
            n_split = max(1, triton.cdiv(c.num_clusters, SPLIT))
            part = torch.empty(H, n_split, bg, D, dtype=torch.float32, device=dev)
            round_w = dev.type == "cuda" and vm.dtype in (torch.bfloat16, torch.float16)
            _estimate_kernel[(H, n_split)](logits, vm, part, c.num_clusters, cmax, b, H, vm.stride(0),
                                           vm.stride(1), G=G, BLOCK_G=bg, D=D, BLOCK_D=bd, SPLIT=SPLIT,
                                           BLOCK_E=BLOCK_E, ROUND_W=round_w, num_warps=4)
            torch.sum(part[:, :, :G], 1, out=out[b])
        return out.view(B, H * G, D), lse.view(B, H * G)
    return ids, counts, (finish if defer else finish())
