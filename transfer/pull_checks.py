"""What both kinds of pull check before they move a byte: the ticket against our page table and the
destination pages, and the declared history against the expected prompt length (checked once the
link is up, so that P can be told at once and free its pages)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from transfer.messages import TransferTicket
from transfer.page_table import PageTable


class PullFailed(Exception):
    pass


def source_pages(
    ticket: TransferTicket,
    own: PageTable,
    dst: Mapping[str, Sequence[int]],
    skip: int,
    pages: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, Sequence[int]]:
    """P's pages to move, one for each of ``dst`` (the ticket's pages past ``skip``; ``pages`` are
    the ticket's pages in another form, such as arrays); raises PullFailed when the ticket cannot
    be pulled into ``dst`` as it stands."""
    pages = ticket.page_ids if pages is None else pages
    if ticket.compat_hash != own.compat_hash:
        raise PullFailed(
            f"compatibility hash mismatch: the ticket's prefill worker has {ticket.compat_hash}, "
            f"we have {own.compat_hash}"
        )
    if sorted(dst) != sorted(ticket.page_ids) or skip < 0:
        raise PullFailed(
            f"destination pools {sorted(dst)} differ from the ticket's {sorted(ticket.page_ids)}"
        )
    src = {}
    for g, ids in pages.items():
        if skip > len(ids) or len(dst[g]) != len(ids) - skip:
            raise PullFailed(
                f"pool {g!r}: the ticket has {len(ids)} pages, skip_pages={skip}, so "
                f"{len(ids) - skip} destination pages are needed, got {len(dst[g])}"
            )
        src[g] = ids[skip:]
    return src


def check_declared(declared: int, expected: int) -> None:
    """KV is never trimmed or padded to fit: any other prompt length fails the pull."""
    if declared != expected:
        raise PullFailed(
            f"declared history mismatch: P declares {declared} prompt tokens, expected {expected}"
        )
