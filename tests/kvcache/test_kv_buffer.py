import dataclasses

import pytest
import torch

from kvcache.kv_buffer import allocate_buffers, layer_view, layer_views
from tests.kvcache.conftest import group_spec


def test_buffers_are_zeroed_page_major_and_views_alias_them() -> None:
    specs = [group_spec("a", (0, 3), num_pages=3, page_size=2), group_spec("b", (1,), num_pages=3)]
    buffers = allocate_buffers(specs, torch.device("cpu"))
    # [num_pages, num_kv_heads, num_layers, 2, page_size, head_dim]
    assert tuple(buffers["a"].shape) == (3, 1, 2, 2, 2, 2)
    assert buffers["a"].dtype == torch.float32 and not buffers["a"].any()
    views = layer_views(specs, buffers)
    assert sorted(views) == [0, 1, 3]
    k3, v3 = views[3]
    assert tuple(k3.shape) == (3, 2, 1, 2)  # [num_pages, page_size, Hkv, D]
    k3[2, 1, 0, 1] = 5.0
    v3[1, 0, 0, 0] = 6.0
    assert buffers["a"][2, 0, 1, 0, 1, 1] == 5.0
    assert buffers["a"][1, 0, 1, 1, 0, 0] == 6.0
    # One page is one contiguous run of page_bytes bytes.
    page = buffers["a"][2]
    assert page.is_contiguous() and page.numel() * page.element_size() == specs[0].page_bytes


def test_a_run_of_heads_of_a_page_is_one_contiguous_run() -> None:
    """Heads outermost within a page: heads [1, 3) of page 2 are bytes [head_bytes, 3 * head_bytes)
    of the page, holding every layer's keys and values of those heads."""
    spec = dataclasses.replace(group_spec("a", (0, 1), num_pages=4, page_size=2), num_kv_heads=4)
    buf = allocate_buffers([spec], torch.device("cpu"))["a"]
    torch.manual_seed(0)
    buf.copy_(torch.randn(buf.shape))
    rows = buf.view(torch.uint8).view(4, spec.page_bytes)
    run = rows[2, spec.head_bytes : 3 * spec.head_bytes].view(torch.float32)
    k, v = layer_view(buf, 1)
    expected = torch.stack([torch.stack(layer_view(buf, layer)) for layer in (0, 1)])
    # [layers, 2, pages, page_size, heads, D] -> heads 1..2 of page 2 as [heads, layers, 2, ps, D]
    assert torch.equal(run.view(2, 2, 2, 2, -1), expected[:, :, 2, :, 1:3].permute(3, 0, 1, 2, 4))
    assert torch.equal(k[2, :, 1:3], buf[2, 1:3, 1, 0].transpose(0, 1))
    assert spec.page_bytes == 4 * spec.head_bytes


def test_layer_in_two_groups_is_refused() -> None:
    specs = [group_spec("a", (0,)), group_spec("b", (0,))]
    with pytest.raises(ValueError, match="layer 0"):
        layer_views(specs, allocate_buffers(specs, torch.device("cpu")))
