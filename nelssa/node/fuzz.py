"""Malformed decode jobs for protocol fuzzing (tests, benchmarks/bench_node.py --fuzz): each keeps a valid
job's shape but breaks one thing a node must refuse."""

from __future__ import annotations

import random

from nelssa.node.proto import nelssa_node_pb2 as pb

KINDS = ("truncated_q", "random_ids", "bad_counts", "bad_heads", "bad_layer", "bad_req_id", "bad_length",
         "bad_selected", "other_client", "bad_dtype", "random_bytes_q", "oversized_q")


def bad_jobs(good: pb.AttendJob, n: int, seed: int, num_layers: int):
    """``n`` mutations of ``good`` (one request or more), cycling through KINDS."""
    rnd = random.Random(seed)
    for i in range(n):
        j = pb.AttendJob()
        j.CopyFrom(good)
        kind = KINDS[i % len(KINDS)]
        r = j.reqs[rnd.randrange(len(j.reqs))]
        H = len(r.counts) // 8
        if kind == "truncated_q":
            j.q = j.q[:rnd.randrange(len(j.q))]
        elif kind == "random_ids":
            r.ids = rnd.randbytes(len(r.ids)) if r.ids else rnd.randbytes(8 * H)
            if not r.selected:
                r.selected = 1
                r.counts = (1).to_bytes(8, "little") * H
        elif kind == "bad_counts":
            r.counts = rnd.choice([-1, 1 << 40, r.selected + 1]).to_bytes(8, "little", signed=True) * H
        elif kind == "bad_heads":
            j.num_heads = rnd.choice([0, j.num_heads + 1, 1 << 20])
        elif kind == "bad_layer":
            j.layer = rnd.choice([num_layers, (1 << 32) - 1])
        elif kind == "bad_req_id":
            r.req_id = rnd.choice(["", "no-such-request", "x" * 10_000])
        elif kind == "bad_length":
            r.length = rnd.choice([0, 1, r.length + 1, 10 ** 12])
        elif kind == "bad_selected":
            r.selected = rnd.choice([1 << 30, r.selected + 1])
        elif kind == "other_client":
            j.client_id = rnd.choice(["", "someone-else"])
        elif kind == "bad_dtype":
            j.q_dtype = rnd.choice([0, 99])
        elif kind == "random_bytes_q":
            j.q = rnd.randbytes(rnd.randrange(1, 4096))
        else:
            j.q = j.q * 3
        yield j
