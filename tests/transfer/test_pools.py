"""transfer/pools.py: a segment's page ids where its copy runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transfer.mapper import Segment
from transfer.pools import segment_ids


def _segment() -> Segment:
    return Segment("full", "full", np.array([5, 3, 9]), np.array([1, 2, 7]), 64)


def test_segment_ids_on_the_cpu() -> None:
    src, dst = segment_ids(_segment(), torch.device("cpu"))
    assert src.dtype == dst.dtype == torch.int64
    assert src.tolist() == [5, 3, 9] and dst.tolist() == [1, 2, 7]
    half = segment_ids(_segment().part(1, 3), torch.device("cpu"))
    assert [t.tolist() for t in half] == [[3, 9], [2, 7]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_segment_ids_go_up_without_waiting_for_the_model_stream() -> None:
    # The copy's side stream follows the model stream (as in paths/cuda_ipc.py); the ids must be
    # queued on it, not copied while the caller (D's event loop) waits for the model's work.
    device = torch.device("cuda", torch.cuda.current_device())
    model, side = torch.cuda.default_stream(device), torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(2_000_000_000)  # the model stream busy for about a second
    side.wait_stream(model)
    with torch.cuda.stream(side):
        src, dst = segment_ids(_segment(), device)
    assert not model.query()  # returned while the model's work still ran
    side.synchronize()
    assert src.device == dst.device == device
    assert src.tolist() == [5, 3, 9] and dst.tolist() == [1, 2, 7]
