"""The host tier: owns long requests' clustered KV and runs sparse attention over it.

``engine: local`` keeps it in this process (LocalHostTier); ``engine: node`` uses a nelssa-node service
(NodeHostTier, nelssa.node.client; the service is ``nelssa-node``: nelssa.node.server, the gRPC service over
nelssa.node.state, the node's requests, devices, jobs and leases, which keeps nelssa.node.storage).
Names are loaded on first use, so ``python -m nelssa.node`` can set up OpenMP before torch loads."""

__all__ = ["HostError", "LocalHostTier", "host_tier"]


def __getattr__(name: str):
    if name in ("HostError", "LocalHostTier"):
        from nelssa.node import local
        return getattr(local, name)
    raise AttributeError(f"module 'nelssa.node' has no attribute {name!r}")


def host_tier(cfg, num_layers: int):
    """The host tier the config's ``engine`` names (both have LocalHostTier's interface)."""
    if cfg.engine == "node":
        from nelssa.node.client import NodeHostTier  # grpc is imported only when the node is used
        return NodeHostTier(cfg, num_layers, keep_centroids=cfg.handover)  # a prefill instance's: for adoption
    from nelssa.node.local import LocalHostTier
    return LocalHostTier(cfg, num_layers)
