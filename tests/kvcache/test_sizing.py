import pytest
import torch

from kvcache.sizing import (
    CudaMemory,
    KVSizingError,
    budget_shares,
    cap_pages_by_tokens,
    check_one_request_fits,
    check_share_left,
    cuda_free_bytes,
    device_kv_budget,
    host_pages_per_group,
    non_torch_growth,
    pages_per_request,
    size_pool_groups,
    split_budget,
    utilization_kv_budget,
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


def test_utilization_budget_is_the_engines_share_less_what_it_holds() -> None:
    # vLLM's gpu_memory_utilization: 0.5 of 1000 for the engine in all; it holds 200 (weights),
    # a step needs 100: the KV cache gets 200.
    assert utilization_kv_budget(1000, 700, 200, 0.5, 100) == 200
    # A share larger than what other processes left is refused (vLLM's rule), not cut down.
    with pytest.raises(ValueError, match="only 0.00 GiB were left by other processes"):
        utilization_kv_budget(1000, 150, 200, 0.9, 100)
    assert utilization_kv_budget(1000, 700, 200, 0.9, 100) == 600  # (700 + 200 >= 900)
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        utilization_kv_budget(1000, 700, 450, 0.5, 100)
    with pytest.raises(ValueError, match="utilization"):
        utilization_kv_budget(1000, 700, 200, 1.5)


def test_memory_taken_outside_torch_counts_against_the_share() -> None:
    # Since the engine started 300 left the free pool; torch's allocator grew by 200 of it, so
    # 100 went elsewhere (a library's workspace, NCCL). Another process freeing memory in between
    # is not the engine's to spend: no negative growth.
    start = CudaMemory(free=900, total=1000, torch_reserved=0)
    assert non_torch_growth(start, CudaMemory(600, 1000, 200)) == 100
    assert non_torch_growth(start, CudaMemory(950, 1000, 200)) == 0
    # The share of 0.5 (500) less the 200 torch holds, the 100 outside it and a step's 100.
    assert utilization_kv_budget(1000, 600, 200, 0.5, 100, non_torch_bytes=100) == 100
    assert utilization_kv_budget(1000, 600, 200, 0.5, 100) == 200  # (what ignoring it gave)
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        utilization_kv_budget(1000, 600, 200, 0.4, 100, non_torch_bytes=100)


def test_a_share_not_left_is_refused_before_anything_loads() -> None:
    assert check_share_left(1000, 500, 0.5) == 500
    with pytest.raises(ValueError, match="only 0.00 GiB were left by other processes"):
        check_share_left(1000, 499, 0.5)


def test_split_by_shares() -> None:
    assert split_budget(1000, {"a": 64, "b": 32}, {"a": 3.0, "b": 1.0}) == {"a": 11, "b": 7}
    assert split_budget(1000, {"a": 64, "b": 32}, {"a": 1.0, "b": 1.0}) == {"a": 7, "b": 15}


def test_pages_per_request_full_and_window() -> None:
    full = group_spec("full", (0,), page_size=4)
    window = group_spec("swa_32", (1,), page_size=4, sliding_window=32)
    need = pages_per_request([full, window], max_model_len=1000, max_step_tokens=64)
    assert need == {"full": 250, "swa_32": 25}  # ceil((32 + 64 - 2) / 4) + 1
    assert pages_per_request([window], max_model_len=40, max_step_tokens=64) == {"swa_32": 10}


def test_default_shares_are_bytes_per_token_times_tokens_held() -> None:
    full = group_spec("full", (0,), page_size=4)  # 2 * 4 * 2 * 4 = 64 B per page
    window = group_spec("swa_32", (1, 2, 3, 4, 5), page_size=4, sliding_window=32)  # 320 B
    need = {"full": 250, "swa_32": 25}
    assert budget_shares([full, window], need) == {"full": 64 * 250, "swa_32": 320 * 25}
    sized = size_pool_groups([full, window], 4 * (64 * 250 + 320 * 25), need)
    # 2/3 and 1/3 of the bytes: each group holds 3 longest requests (4 without the null pages)
    assert [s.num_pages for s in sized] == [1000, 100]


def test_pool_ratio_must_name_the_models_groups() -> None:
    full = group_spec("full", (0,))
    window = group_spec("swa_32", (1,), sliding_window=32)
    need = {"full": 10, "swa_32": 3}
    assert budget_shares([full, window], need, {"full": 3, "swa_32": 1}) == {"full": 3, "swa_32": 1}
    with pytest.raises(KVSizingError, match=r"names \['swa_64'\].*groups are \['full', 'swa_32'\]"):
        budget_shares([full, window], need, {"full": 3, "swa_64": 1})
    with pytest.raises(KVSizingError, match=r"lacks \['swa_32'\]") as e:
        budget_shares([full, window], need, {"full": 1})
    assert e.value.setting == "pool_ratio"
    with pytest.raises(KVSizingError, match="> 0"):
        budget_shares([full, window], need, {"full": 1, "swa_32": 0})


def test_cap_by_tokens_rounds_up_and_adds_null_page() -> None:
    assert cap_pages_by_tokens(100, 7, page_size=2) == 5
    assert cap_pages_by_tokens(3, 7, page_size=2) == 3
    assert cap_pages_by_tokens(100, None, page_size=2) == 100


def test_size_pool_groups_sets_num_pages_only() -> None:
    template = group_spec("full", (0, 1), num_pages=2, page_size=2)
    assert template.page_bytes == PAGE_BYTES_2_LAYERS
    (sized,) = size_pool_groups([template], 10 * 64 + 63, {"full": 3})
    assert sized.num_pages == 10
    assert sized.page_bytes == template.page_bytes and sized.layer_ids == template.layer_ids
    (capped,) = size_pool_groups([template], 10 * 64, {"full": 3}, max_tokens=5)
    assert capped.num_pages == 4  # 3 usable pages hold 6 >= 5 tokens, plus the null page
    (capped,) = size_pool_groups([template], 10 * 64, {"full": 3}, max_requests=2)
    assert capped.num_pages == 7


def test_size_pool_groups_two_groups_with_ratio() -> None:
    a = group_spec("a", (0, 1), num_pages=2)  # 64 B pages
    b = group_spec("b", (2,), num_pages=2)  # 32 B pages
    sized = size_pool_groups([a, b], 960, {"a": 1, "b": 1}, pool_ratios={"a": 1.0, "b": 1.0})
    assert [s.num_pages for s in sized] == [7, 15]


def test_too_small_budget_is_a_clear_error() -> None:
    with pytest.raises(KVSizingError, match="need at least 2"):
        size_pool_groups([group_spec()], 100, {"full": 1})


def test_one_request_must_fit_in_every_group() -> None:
    full = group_spec("full", (0,), num_pages=11)
    window = group_spec("swa_32", (1,), num_pages=3, sliding_window=32)
    check_one_request_fits([full, window], {"full": 10, "swa_32": 2}, 20)
    with pytest.raises(
        KVSizingError, match=r"group 'swa_32' has 2 usable pages, one request needs 3"
    ):
        check_one_request_fits([full, window], {"full": 10, "swa_32": 3}, 20)


def test_cuda_free_bytes_refuses_cpu() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        cuda_free_bytes("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_free_bytes_on_gpu() -> None:
    free = cuda_free_bytes("cuda:0")
    assert 0 < free <= torch.cuda.get_device_properties(0).total_memory


def test_host_tier_splits_like_the_device_pools() -> None:
    # full: 9 usable pages of 32 B (288 B); swa: 4 usable pages of 64 B (256 B) => 544 B of pools
    full = group_spec("full", (0,), num_pages=10, page_size=2)
    swa = group_spec("swa_8", (1, 2), num_pages=5, page_size=2, sliding_window=8)
    assert (full.page_bytes, swa.page_bytes) == (32, 64)
    assert host_pages_per_group([full, swa], 544) == {"full": 9, "swa_8": 4}
    assert host_pages_per_group([full, swa], 2 * 544) == {"full": 18, "swa_8": 8}
    with pytest.raises(KVSizingError, match="holds less than one page") as e:
        host_pages_per_group([full, swa], 100)  # swa: 100 * 256/544 = 47 B < one 64 B page
    assert e.value.setting == "host_tier_bytes" and "'swa_8' gets 0 of 64 B" in str(e.value)
