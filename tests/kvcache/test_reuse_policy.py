import pytest

from kvcache.reuse_policy import ReusePolicy


@pytest.mark.parametrize(
    ("policy", "mid_prompt", "prompt_done"),
    [
        (ReusePolicy.NONE, False, False),
        (ReusePolicy.ALL_REUSABLE, True, True),
        (ReusePolicy.PER_REQUEST, False, True),
    ],
)
def test_registers_on_commit(policy: ReusePolicy, mid_prompt: bool, prompt_done: bool) -> None:
    assert policy.registers_on_commit(prompt_done=False) is mid_prompt
    assert policy.registers_on_commit(prompt_done=True) is prompt_done


def test_string_values() -> None:
    assert ReusePolicy("per_request") is ReusePolicy.PER_REQUEST
    assert ReusePolicy("all_reusable").reuses
    assert not ReusePolicy("none").reuses
    with pytest.raises(ValueError):
        ReusePolicy("sometimes")
