"""nelssa-node's devices on a machine with several NUMA nodes: each device's cores and memory on one node.

A device's kernel streams its requests' K/V rows from host memory; on a machine with several NUMA nodes
a device whose cores read memory of another node reads at that node's remote bandwidth. So:

  1. ``topology(root)``: NUMA node -> its CPUs (sysfs ``node*/cpulist``), {} where the kernel shows none.
  2. ``place(devices, per_device, avail, topo)``: each device's cores (``--cores-per-device``) and node.
     With two or more nodes that have CPUs of this process's affinity, device d goes to the d-th node
     round-robin (devices spread evenly) and takes ``per_device`` consecutive cores of that node
     (wrapping within the node, with a warning, where it has fewer: devices then share cores, an
     emulation only). With one node (or none shown): consecutive cores of the affinity, device by
     device, and no node (the kernel's default placement), as before.
  3. ``node_of(cores, topo)``: the node all of an explicit core list (``--device-cores``) is on, or None
     where it spans several (or there is one node only): such a device is not bound.
  4. The device's stored K/V is allocated bound to its node (node/state.py -> hostmem.host_empty_on,
     csrc/host_pool.cpp 6), before anything touches it: the store handler's copy (on ingest cores,
     possibly of another node) then writes into the device's node, where its kernel reads.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from nelssa.config import parse_cores

log = logging.getLogger("nelssa.node")

SYSFS = "/sys/devices/system/node"


def topology(root: str = SYSFS) -> dict[int, tuple[int, ...]]:
    """NUMA node -> its CPUs, in order (1); {} without the sysfs tree."""
    out: dict[int, tuple[int, ...]] = {}
    base = Path(root)
    if not base.is_dir():
        return out
    for d in base.glob("node[0-9]*"):
        try:
            text = (d / "cpulist").read_text().strip()
        except OSError:
            continue
        out[int(d.name[4:])] = tuple(sorted(parse_cores(text))) if text else ()
    return dict(sorted(out.items()))


def place(devices: int, per_device: int, avail: list[int], topo: dict[int, tuple[int, ...]]
          ) -> tuple[tuple[tuple[int, ...], ...], tuple[int | None, ...]]:
    """(cores per device, NUMA node per device or None) for ``devices`` devices of ``per_device`` cores
    each out of the CPUs ``avail`` (2)."""
    if devices < 1 or per_device < 1:
        raise ValueError(f"placing {devices} devices of {per_device} cores")
    mine = set(avail)
    nodes = {n: [c for c in cpus if c in mine] for n, cpus in topo.items()}
    nodes = {n: cpus for n, cpus in nodes.items() if cpus}
    if len(nodes) < 2:
        if devices * per_device > len(avail):
            log.warning("%d devices x %d cores > %d cores available: devices share cores (emulation only)",
                        devices, per_device, len(avail))
        return (tuple(tuple(avail[(d * per_device + i) % len(avail)] for i in range(per_device))
                      for d in range(devices)), (None,) * devices)
    order = list(nodes)
    taken = {n: 0 for n in order}
    cores, where = [], []
    for d in range(devices):
        n = order[d % len(order)]
        cpus, k = nodes[n], taken[n]
        if k + per_device > len(cpus):
            log.warning("NUMA node %d: %d cores for its devices' %d: its devices share cores (emulation only)",
                        n, len(cpus), k + per_device)
        cores.append(tuple(cpus[(k + i) % len(cpus)] for i in range(per_device)))
        taken[n] = k + per_device
        where.append(n)
    return tuple(cores), tuple(where)


def node_of(cores: tuple[int, ...], topo: dict[int, tuple[int, ...]]) -> int | None:
    """The one node with CPUs that holds all of ``cores``, or None (3)."""
    with_cpus = {n: set(c) for n, c in topo.items() if c}
    if len(with_cpus) < 2 or not cores:
        return None
    hits = [n for n, cpus in with_cpus.items() if set(cores) <= cpus]
    return hits[0] if hits else None


def affinity() -> list[int]:
    return sorted(os.sched_getaffinity(0))
