"""``nelssa-node`` / ``python -m nelssa.node``: run the host tier as a service (see nelssa.node.server)."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading

from nelssa.config import check_cores, get_config, mem_available, parse_bytes, parse_cores
from nelssa.node import numa


def _device_cores(spec: str, devices: int, per_device: int
                  ) -> tuple[tuple[tuple[int, ...], ...], tuple[int | None, ...]]:
    """(cores per device, NUMA node per device or None): '0-3;4-7' (one core list per device; a device on
    one node is bound to it) or, with --cores-per-device, cores of this process's affinity, device by
    device — on a machine with several NUMA nodes each device's from one node, the devices spread over
    the nodes (node/numa.py)."""
    topo = numa.topology()
    if spec:
        sets = tuple(parse_cores(s) for s in spec.split(";"))
        if len(sets) != devices:
            raise ValueError(f"--device-cores names {len(sets)} core sets for {devices} devices")
        return sets, tuple(numa.node_of(c, topo) for c in sets)
    if per_device <= 0:
        return (), ()
    return numa.place(devices, per_device, numa.affinity(), topo)


def _omp_wait_policy(cores: tuple[tuple[int, ...], ...]) -> None:
    """OpenMP threads that spin after a parallel loop (the stores' copies; torch's) steal the CPU from
    everything else where devices share cores (no pinning, or more devices x cores than the machine
    has): measured on the 2-core box, a spinning team made some decode jobs take 30 ms instead of
    0.1-0.6. Passive waiting there; libgomp's default (spin, then sleep) where every device has cores of
    its own. (The decode kernels' own teams follow ``poll_spin_us`` instead: server.serve.) Must be
    decided before torch (and libgomp) is loaded; an OMP_WAIT_POLICY in the environment wins."""
    flat = [c for cs in cores for c in cs]
    own = bool(cores) and len(set(flat)) == len(flat)
    if not own:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="nelssa-node", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="bind address (anything but loopback needs a token)")
    p.add_argument("--port", type=int, default=50151, help="gRPC port (0: any free port)")
    p.add_argument("--devices", type=int, default=1, help="emulated PNM devices")
    p.add_argument("--cores-per-device", type=int, default=0,
                   help="pin each device to this many cores of its own (0: not pinned)")
    p.add_argument("--device-cores", default="", help="explicit core lists per device, e.g. '0-3;4-7'")
    p.add_argument("--threads-per-device", type=int, default=0,
                   help="kernel threads per device (default: --cores-per-device, else 1)")
    p.add_argument("--device-memory", default="",
                   help="capacity per device, e.g. 64GiB (default: 80%% of available memory, split over the devices)")
    p.add_argument("--host-reserve", default="0",
                   help="host memory mapped and touched at start (in the background) and kept for stored KV, "
                        "e.g. 32GiB: stores then copy into memory whose page faults are paid (0: none)")
    p.add_argument("--partition", choices=("head", "cluster"), default="head")
    p.add_argument("--ingest-cores", default="", help="cores for store handling, e.g. '15' (default: not pinned)")
    p.add_argument("--token-file", default="", help="file holding the shared secret (else NELSSA_NODE_TOKEN)")
    p.add_argument("--lease-min-s", type=float, default=0.5)
    p.add_argument("--lease-max-s", type=float, default=600.0)
    p.add_argument("--max-message-bytes", default="8MiB", help="largest message / shared-memory slot")
    p.add_argument("--max-store-slot", default="4GiB",
                   help="largest store slot a same-host client may ask for (its stores through shared memory; "
                        "the memory is taken from the shared-memory file system when the slot is made; "
                        "0: stores stream over gRPC only)")
    p.add_argument("--poll-spin-us", type=int, default=2000,
                   help="the shared-memory responder and the device workers busy-poll this long after a job "
                        "before they sleep (0: always sleep)")
    p.add_argument("--metrics-port", type=int, default=-1, help="Prometheus /metrics port (-1: off, 0: any)")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.devices < 1 or a.cores_per_device < 0 or a.threads_per_device < 0:
        p.error("--devices must be >= 1, --cores-per-device and --threads-per-device >= 0")

    token = get_config().node_token
    if a.token_file:
        try:
            with open(a.token_file) as f:
                token = f.read().strip()
        except OSError as e:
            p.error(f"--token-file: {e}")
    try:
        cores, nodes = _device_cores(a.device_cores, a.devices, a.cores_per_device)
        check_cores("--device-cores", [c for d in cores for c in d])
        check_cores("--ingest-cores", parse_cores(a.ingest_cores))
    except ValueError as e:
        p.error(str(e))
    threads = a.threads_per_device or (len(cores[0]) if cores else 1)
    _omp_wait_policy(cores)
    import torch

    from nelssa._ext import ext
    from nelssa.node.server import NodeSettings, serve
    # a crash says where: Python's threads (faulthandler) and the crashing native thread's frames (the
    # responder and device threads have no Python frame)
    faulthandler.enable()
    if ext() is not None:
        ext().install_fatal_trace()
    from nelssa.node.wire import Limits
    torch.set_num_threads(1)  # the node's own torch ops are small; the kernels have their teams
    try:
        s = NodeSettings(host=a.host, port=a.port, devices=a.devices, device_cores=cores, device_nodes=nodes,
                         threads_per_device=threads,
                         device_memory=parse_bytes(a.device_memory) if a.device_memory
                         else int(0.8 * mem_available()) // a.devices, partition=a.partition,
                         ingest_cores=parse_cores(a.ingest_cores), token=token, lease_min_s=a.lease_min_s,
                         lease_max_s=a.lease_max_s, poll_spin_us=a.poll_spin_us, metrics_port=a.metrics_port,
                         host_reserve=parse_bytes(a.host_reserve),
                         limits=Limits(max_message_bytes=parse_bytes(a.max_message_bytes),
                                       max_store_slot_bytes=parse_bytes(a.max_store_slot)))
    except ValueError as e:
        raise SystemExit(f"nelssa-node: {e}") from None
    try:
        running = serve(s)
    except (ValueError, OSError) as e:  # a --host-reserve beyond the memory available, a port in use
        raise SystemExit(f"nelssa-node: {e}") from None
    if any(n is not None for n in nodes):
        logging.getLogger("nelssa.node").info("devices on NUMA nodes: %s", "; ".join(
            f"device {d}: cores {','.join(map(str, c))} node {n}" for d, (c, n) in enumerate(zip(cores, nodes))))
    # one parseable line for scripts and tests
    print(f"nelssa-node listening on {a.host}:{running.port} metrics {running.metrics_port} pid {os.getpid()}",
          flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    running.stop(grace=2.0)  # clients dropped, shared-memory files unlinked, devices stopped
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalisation: a library thread (gRPC / OpenMP) left joinable at static
    # destruction aborted the process now and then ("terminate called without an active exception").
    os._exit(0)


if __name__ == "__main__":
    main()
