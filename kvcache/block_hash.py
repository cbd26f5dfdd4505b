"""Chained block hashes: the identity of a page's content in the prefix index.

One pure function, imported by every role (prefill and decode workers, the router), so that the same
prompt gives the same hashes in every process and on every host. A page's hash covers its parent's
hash, so equal hashes mean equal *prefixes*, not just equal pages.

Never Python's ``hash()``: it is salted per process for str/bytes and differs across interpreters.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# 256-bit hashes. A hit is trusted on its hash alone (the tokens are not compared), so a
# collision serves one prompt another's KV. 64 bits were plenty against accidents but not
# against a client: a colliding pair of pages costs about 2**32 hashes (minutes on one core),
# and a victim whose prompt shares the attacker's prefix and then holds one of the pair (a
# document the attacker wrote) would read the other's KV (vLLM moved to SHA-256 for the same
# reason, CVE-2025-25183). Hashes are Python ints everywhere they travel (Ray, the router's
# index), of any size.
_DIGEST_BYTES = 32
_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def hash_block(
    parent_hash: int | None,
    token_ids: Sequence[int],
    extra_key: bytes | None = None,
) -> int:
    """Hash of one page of tokens, chained to the hash of the page before it.

    Args:
        parent_hash: the hash of the previous page of the same sequence, or None for the first page.
        token_ids: the token ids of this page (normally exactly ``page_size`` of them), each a
            signed 64-bit integer.
        extra_key: optional bytes that must also match for a hit (e.g. a model or adapter id).

    Returns:
        An unsigned 256-bit integer, identical in every process for identical arguments.
    """
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    if parent_hash is None:
        h.update(_NO_PARENT)
    else:
        h.update(_HAS_PARENT + parent_hash.to_bytes(_DIGEST_BYTES, "little"))
    # Length-prefixed so that (extra, tokens) boundaries can never be confused.
    extra = extra_key or b""
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def hash_full_pages(
    token_ids: Sequence[int],
    page_size: int,
    extra_key: bytes | None = None,
    *,
    parent_hash: int | None = None,
    max_pages: int | None = None,
) -> list[int]:
    """Chained hashes of every *full* page of ``token_ids`` (a trailing partial page is skipped).

    Args:
        token_ids: the sequence, starting at the first token covered by the first hash returned.
        page_size: tokens per page.
        extra_key: passed to every ``hash_block`` call.
        parent_hash: hash of the page before ``token_ids[0]`` (None at the start of a sequence);
            lets callers extend an existing chain without rehashing it.
        max_pages: hash at most this many pages.

    Returns:
        One hash per full page, in order.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    num_pages = len(token_ids) // page_size
    if max_pages is not None:
        num_pages = min(num_pages, max_pages)
    hashes: list[int] = []
    parent = parent_hash
    for i in range(num_pages):
        parent = hash_block(parent, token_ids[i * page_size : (i + 1) * page_size], extra_key)
        hashes.append(parent)
    return hashes
