"""What this build speaks on the wire: the protocol version and the name of the KV page layout.

Both go into every peer's compatibility hash (page_table.compat_hash), and the protocol version into
every control message (messages.py), so peers of different builds refuse each other instead of
exchanging bytes they would read differently.
"""

from __future__ import annotations

# 7: the authenticated handshake (Hello, Challenge, Join, Welcome, Ready), one data path per link,
# the declared-history check at admission, and direct reads that hold P's lease (ReadGrant).
# 8: D sends its chunk plan (PullRequest.chunk_sizes) instead of one chunk size.
# 9: tickets list per group only the pages it holds (a window group: its window), from first_page.
# 10: every control frame from the Join on carries a MAC, and UCX data tags are keyed per link.
# 11: the proofs and the link's keys cover both instance ids with both nonces.
PROTOCOL_VERSION = 11

# The page-major layout of kvcache/spec.py: one page of a pool group is one contiguous run of bytes,
# and so is each run of consecutive heads within it (heads outermost).
PAGE_LAYOUT = "page_major[num_pages,num_kv_heads,num_layers,2,page_size,head_dim]"
