"""NELSSA sparse-attention algorithms (no vLLM imports): clustering, centroid search, host attention."""

from nelssa.sparse.attention import attend, dense_attention, merge_states, prepare_attend, sparse_attention
from nelssa.sparse.clustered import ClusteredKV, KVPart, cluster_kv, pack
from nelssa.sparse.hostmem import host_empty, host_empty_on
from nelssa.sparse.kmeans import segmented_kmeans
from nelssa.sparse.search import Selection, budget_tokens, select_clusters
from nelssa.sparse.store import CapacityError, KVStore, RequestKV

__all__ = [
    "CapacityError", "ClusteredKV", "KVPart", "KVStore", "RequestKV", "Selection", "attend", "budget_tokens",
    "cluster_kv", "dense_attention", "host_empty", "host_empty_on", "merge_states", "pack", "prepare_attend", "segmented_kmeans",
    "select_clusters", "sparse_attention",
]
