"""Transceiver: both roles of one worker's KV transfer, over one UCX runtime.

A prefill worker uses the sender role (``publish``/``cancel``), a decode worker the receiver role
(``pull``); a worker that does both (tests, a decode worker that also prefills) gets both. Each role
is its own class (KVSender, KVReceiver), usable alone; this only wires them to the same pools.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvcache.spec import PoolGroupSpec
from transfer.config import TransceiverConfig
from transfer.messages import TransferTicket
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.stats import TransferResult


class Transceiver:
    def __init__(
        self,
        buffers: Mapping[str, torch.Tensor],
        specs: Sequence[PoolGroupSpec],
        model: str,
        config: TransceiverConfig,
        release: Callable[[str], None] | None = None,
    ) -> None:
        """The sender role starts (listening) only when ``release`` is given."""
        self.sender = (
            KVSender(buffers, specs, model, config, release) if release is not None else None
        )
        try:
            self.receiver = KVReceiver(buffers, specs, model, config)
        except BaseException:
            if self.sender is not None:
                self.sender.close()
            raise

    def publish(
        self, request_id: str, page_ids: Mapping[str, Sequence[int]], declared_prompt_len: int
    ) -> TransferTicket:
        return self._sender().publish(request_id, page_ids, declared_prompt_len)

    def cancel(self, request_id: str) -> bool:
        return self._sender().cancel(request_id)

    async def pull(
        self,
        ticket: TransferTicket,
        dst_page_ids: Mapping[str, Sequence[int]],
        skip_pages: int,
        expected_prompt_len: int,
    ) -> TransferResult:
        return await self.receiver.pull(ticket, dst_page_ids, skip_pages, expected_prompt_len)

    def pull_blocking(
        self,
        ticket: TransferTicket,
        dst_page_ids: Mapping[str, Sequence[int]],
        skip_pages: int,
        expected_prompt_len: int,
    ) -> TransferResult:
        return self.receiver.pull_blocking(ticket, dst_page_ids, skip_pages, expected_prompt_len)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"recv": self.receiver.stats()}
        if self.sender is not None:
            out["send"] = self.sender.stats()
        return out

    def close(self) -> None:
        try:
            self.receiver.close()
        finally:
            if self.sender is not None:
                self.sender.close()

    def _sender(self) -> KVSender:
        if self.sender is None:
            raise RuntimeError(
                "this transceiver has no sender role (it was built without a release callback)"
            )
        return self.sender
