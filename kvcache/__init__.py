"""Paged KV cache: page pools per pool group, prefix reuse, storage tensors, sizing and stats."""

from kvcache.block_hash import hash_block, hash_full_pages
from kvcache.manager import KVCacheManager
from kvcache.prefix_match import PrefixMatch
from kvcache.reuse_policy import ReusePolicy
from kvcache.sizing import KVSizingError
from kvcache.spec import FULL_GROUP, KV_ROLES, NULL_PAGE, MapperKind, PoolGroupSpec, group_name
from kvcache.stats import KVCacheStats, PoolGroupStats

__all__ = [
    "FULL_GROUP",
    "KV_ROLES",
    "NULL_PAGE",
    "KVCacheManager",
    "KVCacheStats",
    "KVSizingError",
    "MapperKind",
    "PoolGroupSpec",
    "PoolGroupStats",
    "PrefixMatch",
    "ReusePolicy",
    "group_name",
    "hash_block",
    "hash_full_pages",
]
