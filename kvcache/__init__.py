"""Paged KV cache: page pools per pool group, prefix reuse, storage tensors, sizing and stats."""

from kvcache.block_hash import hash_block, hash_full_pages
from kvcache.manager import KVCacheManager
from kvcache.prefix_match import PrefixMatch
from kvcache.reuse_policy import ReusePolicy
from kvcache.spec import KV_ROLES, NULL_PAGE, MapperKind, PoolGroupSpec
from kvcache.stats import KVCacheStats, PoolGroupStats

__all__ = [
    "KV_ROLES",
    "NULL_PAGE",
    "KVCacheManager",
    "KVCacheStats",
    "MapperKind",
    "PoolGroupSpec",
    "PoolGroupStats",
    "PrefixMatch",
    "ReusePolicy",
    "hash_block",
    "hash_full_pages",
]
