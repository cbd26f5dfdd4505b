import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.block_hash import hash_block, hash_full_pages


def test_hash_is_256_bit_and_deterministic() -> None:
    """256 bits: a hit is trusted on its hash, and 64 bits let a client make a colliding pair of
    pages in about 2**32 hashes (block_hash.py)."""
    hashes = [hash_block(None, [1, 2, i]) for i in range(16)]
    assert all(0 <= h < 2**256 for h in hashes)
    assert max(hashes).bit_length() > 248  # (all 16 under 2**248: odds 2**-128)
    assert hashes[3] == hash_block(None, [1, 2, 3])
    assert hash_block(hashes[0], [4]) != hash_block(hashes[0] % 2**64, [4])  # the whole parent


def test_hash_depends_on_parent_tokens_and_extra_key() -> None:
    base = hash_block(None, [1, 2])
    assert hash_block(None, [2, 1]) != base
    assert hash_block(7, [1, 2]) != base
    assert hash_block(0, [1, 2]) != base  # parent 0 is not "no parent"
    assert hash_block(None, [1, 2], b"lora-a") != base
    assert hash_block(None, [1, 2], b"lora-a") != hash_block(None, [1, 2], b"lora-b")


def test_hash_is_stable_across_processes() -> None:
    # Another interpreter with another str-hash salt must agree (Python's hash() would not).
    code = "from kvcache.block_hash import hash_block; print(hash_block(123, [5, 6, 7], b'x'))"
    repo_root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=repo_root,
        env={**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(repo_root)},
    ).stdout.strip()
    assert out == str(hash_block(123, [5, 6, 7], b"x"))


def test_full_pages_are_chained_and_partial_page_skipped() -> None:
    tokens = [1, 2, 3, 4, 5]
    h1 = hash_block(None, [1, 2])
    h2 = hash_block(h1, [3, 4])
    assert hash_full_pages(tokens, 2) == [h1, h2]
    assert hash_full_pages(tokens, 2, max_pages=1) == [h1]
    assert hash_full_pages([3, 4, 5], 2, parent_hash=h1) == [h2]
    assert hash_full_pages([1], 2) == []


def test_same_page_after_different_prefix_hashes_differently() -> None:
    a = hash_full_pages([1, 2, 9, 9], 2)
    b = hash_full_pages([3, 4, 9, 9], 2)
    assert a[1] != b[1]


def test_bad_page_size_raises() -> None:
    with pytest.raises(ValueError, match="page_size"):
        hash_full_pages([1, 2], 0)
