import pytest
import torch

from kvcache.kv_buffer import allocate_buffers, layer_views
from tests.kvcache.conftest import group_spec


def test_buffers_are_zeroed_page_major_and_views_alias_them() -> None:
    specs = [group_spec("a", (0, 3), num_pages=3, page_size=2), group_spec("b", (1,), num_pages=3)]
    buffers = allocate_buffers(specs, torch.device("cpu"))
    assert tuple(buffers["a"].shape) == (3, 2, 2, 2, 1, 2)
    assert buffers["a"].dtype == torch.float32 and not buffers["a"].any()
    views = layer_views(specs, buffers)
    assert sorted(views) == [0, 1, 3]
    k3, v3 = views[3]
    k3[2, 1, 0, 1] = 5.0
    v3[1, 0, 0, 0] = 6.0
    assert buffers["a"][2, 1, 0, 1, 0, 1] == 5.0
    assert buffers["a"][1, 1, 1, 0, 0, 0] == 6.0
    # One page is one contiguous run of page_bytes bytes.
    page = buffers["a"][2]
    assert page.is_contiguous() and page.numel() * page.element_size() == specs[0].page_bytes


def test_layer_in_two_groups_is_refused() -> None:
    specs = [group_spec("a", (0,)), group_spec("b", (0,))]
    with pytest.raises(ValueError, match="layer 0"):
        layer_views(specs, allocate_buffers(specs, torch.device("cpu")))
