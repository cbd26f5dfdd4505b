from kvcache.prefix_match import PrefixMatch


def test_num_pages_counts_block_hashes() -> None:
    m = PrefixMatch(
        num_tokens=4, page_ids={"full": [3, 1]}, block_hashes=[10, 20], num_query_tokens=9
    )
    assert m.num_pages == 2
