import pytest
import torch

from kvcache.sizing import (
    cap_pages_by_tokens,
    cuda_free_bytes,
    device_kv_budget,
    size_pool_groups,
    split_budget,
)
from tests.kvcache.conftest import group_spec

# group_spec pages: layers * 2 * page_size * 1 head * dim 2 * 4 bytes
PAGE_BYTES_2_LAYERS = 2 * 2 * 2 * 1 * 2 * 4  # 64


def test_device_budget() -> None:
    assert device_kv_budget(1000, 0.5, weights_bytes=100, activation_peak_bytes=300) == 300
    assert device_kv_budget(1000, 1.0) == 1000
    with pytest.raises(ValueError, match="no memory left"):
        device_kv_budget(100, 0.9, weights_bytes=80, activation_peak_bytes=20)
    with pytest.raises(ValueError, match="fraction"):
        device_kv_budget(100, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        device_kv_budget(100, 0.5, weights_bytes=-1)


def test_split_equal_pages_without_ratio() -> None:
    assert split_budget(1000, {"a": 64, "b": 32}, None) == {"a": 10, "b": 10}


def test_split_by_ratio() -> None:
    assert split_budget(1000, {"a": 64, "b": 32}, {"a": 3.0, "b": 1.0}) == {"a": 11, "b": 7}
    with pytest.raises(ValueError, match="exactly the groups"):
        split_budget(1000, {"a": 64}, {"b": 1.0})
    with pytest.raises(ValueError, match="> 0"):
        split_budget(1000, {"a": 64}, {"a": 0.0})


def test_cap_by_tokens_rounds_up_and_adds_null_page() -> None:
    assert cap_pages_by_tokens(100, 7, page_size=2) == 5
    assert cap_pages_by_tokens(3, 7, page_size=2) == 3
    assert cap_pages_by_tokens(100, None, page_size=2) == 100


def test_size_pool_groups_sets_num_pages_only() -> None:
    template = group_spec("full", (0, 1), num_pages=2, page_size=2)
    assert template.page_bytes == PAGE_BYTES_2_LAYERS
    (sized,) = size_pool_groups([template], budget_bytes=10 * 64 + 63)
    assert sized.num_pages == 10
    assert sized.page_bytes == template.page_bytes and sized.layer_ids == template.layer_ids
    (capped,) = size_pool_groups([template], budget_bytes=10 * 64, max_tokens=5)
    assert capped.num_pages == 4  # 3 usable pages hold 6 >= 5 tokens, plus the null page


def test_size_pool_groups_two_groups_with_ratio() -> None:
    a = group_spec("a", (0, 1), num_pages=2)  # 64 B pages
    b = group_spec("b", (2,), num_pages=2)  # 32 B pages
    sized = size_pool_groups([a, b], budget_bytes=960, pool_ratios={"a": 1.0, "b": 1.0})
    assert [s.num_pages for s in sized] == [7, 15]


def test_too_small_budget_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="need at least 2"):
        size_pool_groups([group_spec()], budget_bytes=100)


def test_cuda_free_bytes_refuses_cpu() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        cuda_free_bytes("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_free_bytes_on_gpu() -> None:
    free = cuda_free_bytes("cuda:0")
    assert 0 < free <= torch.cuda.get_device_properties(0).total_memory
