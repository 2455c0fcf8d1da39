"""The host tier: owns long requests' clustered KV and runs sparse attention over it.

``engine: local`` keeps it in this process (LocalHostTier); ``engine: node`` uses a nelssa-node service
(NodeHostTier, nelssa.node.client; the service is nelssa.node.server, ``nelssa-node``)."""

from nelssa.node.local import HostError, LocalHostTier

__all__ = ["HostError", "LocalHostTier", "host_tier"]


def host_tier(cfg, num_layers: int):
    """The host tier the config's ``engine`` names (both have LocalHostTier's interface)."""
    if cfg.engine == "node":
        from nelssa.node.client import NodeHostTier  # grpc is imported only when the node is used
        return NodeHostTier(cfg, num_layers)
    return LocalHostTier(cfg, num_layers)
