"""A lane batch's inputs, made on the host and moved to the device in one copy per dtype.

The lane thread shares the GIL with vLLM's step thread, and every torch operation it issues gives the
GIL away and waits to get it back (up to a switch interval while the step thread runs Python); a
``torch.tensor(list, device="cuda")`` also synchronises the lane stream, i.e. waits for the step that
sampled the batch's tokens. Built from per-job device tensors (positions, block-table rows, window
table, budget targets: ~50 operations and three such synchronisations per batch), a replayed batch
spent ~28 ms of the lane's time before its replay (H200, run 16; the replay and its chain 52 ms).
So:

  1. The runner hands each job its block-table row from vLLM's host copy (``BlockTable.block_table.np``,
     the rows this step's inputs were made from) and its sampled token on the device.
  2. ``build`` computes, with numpy only (no torch operation, the GIL kept): positions, KV slots,
     host ends, sequence lengths, the padded block table and, for the batch graphs (lane_batch.py,
     3), the window's block table and lengths (``LaneInputs.window``); the graphs' budget targets
     are sparse.search.host_budget_targets.
  3. ``Staging`` packs named arrays into one pinned buffer per dtype and copies each to its device
     twin with one asynchronous copy on the current stream; the device tensors are views of the twin,
     each 64-byte aligned (Triton specialises on pointer alignment: H200 run 18 recompiled the
     selection kernel for a misaligned budget-target view, a ~1.5 s first capture).
     A batch graph owns its staging (its static inputs); the other paths share one per shape. The lane
     waits for each batch before the next, so a pinned buffer is never rewritten under a pending copy.
  4. The tokens are on the device (the step's sampling): one ``cat`` and, for a replay, one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nelssa.vllm_plugin import uva

_ALIGN = 64  # bytes: the alignment of every staged field (3)


@dataclass
class LaneInputs:
    """One batch's host-side inputs (2)."""
    n: int
    pos: np.ndarray          # [n] int64: the position each row computes
    slots: np.ndarray        # [n] int64: its KV slot
    host_end: list           # H per row
    seq_lens: list           # tokens with KV after the lane's write (pos + 1)
    bt: np.ndarray           # [n, nb] int32 block ids, zero-padded

    def window(self, sink: int, cap: int, bs: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(block table [n, sink // bs + cap] int32, lengths [n] int32) of the rows' device windows (the
        sink and the ``cap`` blocks from H), or None when a window does not fit (lane_batch.py, 3)."""
        he = np.asarray(self.host_end, dtype=np.int64)
        rlen = np.asarray(self.seq_lens, dtype=np.int64) - he
        if sink % bs or (he < sink).any() or rlen.max() > cap * bs:
            return None
        ridx = np.minimum(he[:, None] // bs + np.arange(cap)[None], self.bt.shape[1] - 1)
        win = np.concatenate([self.bt[:, :sink // bs], np.take_along_axis(self.bt, ridx, 1)], 1)
        return np.ascontiguousarray(win, dtype=np.int32), (sink + rlen).astype(np.int32)


def build(jobs, block_size: int) -> LaneInputs:
    """The batch's inputs from its jobs (lane.Job: ``pos``, ``host_end``, ``blocks`` a numpy row)."""
    n = len(jobs)
    pos = np.fromiter((j.pos for j in jobs), dtype=np.int64, count=n)
    nb = max(len(j.blocks) for j in jobs)
    bt = np.zeros((n, nb), dtype=np.int32)
    for i, j in enumerate(jobs):
        bt[i, :len(j.blocks)] = j.blocks
    slots = bt[np.arange(n), pos // block_size].astype(np.int64) * block_size + pos % block_size
    return LaneInputs(n, pos, slots, [j.host_end for j in jobs], [j.pos + 1 for j in jobs], bt)


class Staging:
    """Named host arrays -> device tensors, one pinned buffer and one copy per dtype (3)."""

    def __init__(self, shapes: dict[str, tuple], device: torch.device):
        self.device = device
        self.host: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        self._pairs = []
        by_dtype: dict = {}
        for name, (shape, dtype) in shapes.items():
            by_dtype.setdefault(dtype, []).append((name, tuple(shape)))
        cuda = device.type == "cuda"
        for dtype, fields in by_dtype.items():
            # every field starts 64-byte aligned: Triton specialises kernels on pointer alignment, and a
            # kernel warmed on aligned tensors recompiled (under the GIL, ~1 s) for a misaligned view
            step = _ALIGN // torch.empty(0, dtype=dtype).element_size()
            offs, total = [], 0
            for _, s in fields:
                offs.append(total)
                total += -(-int(np.prod(s)) // step) * step
            pinned = torch.empty(total, dtype=dtype, pin_memory=cuda)
            twin = torch.empty(total, dtype=dtype, device=device) if cuda else pinned
            hv = pinned.numpy()
            for (name, s), off in zip(fields, offs):
                k = int(np.prod(s))
                self.host[name] = hv[off:off + k].reshape(s)
                self.dev[name] = twin[off:off + k].view(s)
            if cuda:  # the upload a kernel through the pinned buffer's device view where there is one (uva.py)
                self._pairs.append((twin, pinned, uva.view(pinned)))

    def upload(self, **arrays) -> dict[str, torch.Tensor]:
        """Write ``arrays`` into the pinned buffers and copy them to the device (current stream); the
        device views of every field."""
        for name, a in arrays.items():
            self.host[name][...] = a
        for twin, pinned, view in self._pairs:
            if view is not None:
                uva.copy(view, twin)
            else:
                twin.copy_(pinned, non_blocking=True)
        return self.dev


def shapes(inp: LaneInputs, window: tuple | None = None) -> dict[str, tuple]:
    """The fields of a batch's staging: positions, slots, token index, block table; with a window, its
    table, lengths and the budget targets (a batch graph's static inputs)."""
    n = inp.n
    out = {"pos": ((n,), torch.int64), "slots": ((n,), torch.int64), "tok": ((n,), torch.int64)}
    if window is None:
        out["bt"] = (inp.bt.shape, torch.int32)
    else:
        out.update(win_bt=(window[0].shape, torch.int32), win_len=((n,), torch.int32),
                   target=((n,), torch.int64))
    return out
