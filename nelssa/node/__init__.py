"""The host tier: owns long requests' clustered KV and runs sparse attention over it."""

from nelssa.node.local import HostError, LocalHostTier

__all__ = ["HostError", "LocalHostTier"]
