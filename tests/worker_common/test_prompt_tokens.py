"""PromptTokens: packed int32 ids across pickling, the list built once on first use."""

from __future__ import annotations

import pickle

import pytest

from engine.sampling_params import SamplingParams
from worker_common.messages import GenerateRequest
from worker_common.prompt_tokens import PromptTokens


def test_round_trip_and_sequence_behaviour() -> None:
    ids = [0, 1, 2**31 - 1, 49151, 7]
    p = PromptTokens(ids)
    assert len(p) == 5 and p.tolist() == ids and list(p) == ids
    assert p[2] == 2**31 - 1 and p[-1] == 7 and p[1:3] == [1, 2**31 - 1]
    assert p == ids and p == PromptTokens(ids) and p != PromptTokens(ids[:-1])
    assert len(p.packed) == 4 * len(ids)


def test_unpickled_ids_stay_packed_until_first_use() -> None:
    ids = list(range(5000))
    back = pickle.loads(pickle.dumps(PromptTokens(ids)))
    assert not back.materialized
    assert len(back) == 5000 and back[:4] == [0, 1, 2, 3]  # neither builds the list
    assert not back.materialized
    assert back.tolist() == ids and back.materialized
    assert back.tolist() is back.tolist()  # built once


def test_pickling_sends_the_packed_bytes_even_after_the_list_was_built() -> None:
    ids = list(range(1000, 33000))
    p = PromptTokens(ids)
    p.tolist()
    blob = pickle.dumps(p, protocol=5)
    assert p.packed in blob and len(blob) < len(p.packed) + 200  # one buffer, not 32k ints
    back = pickle.loads(blob)
    assert not back.materialized and back == ids


@pytest.mark.parametrize("bad", [[2**31], [-(2**31) - 1], [1.5], ["3"]])
def test_ids_outside_int32_are_refused(bad: list) -> None:
    with pytest.raises(ValueError, match="int32"):
        PromptTokens(bad)


def test_a_generate_request_packs_a_list_and_keeps_it_packed_through_pickling() -> None:
    req = GenerateRequest("r", [5, 6, 7], SamplingParams(max_tokens=3), 0.0)
    assert isinstance(req.prompt_token_ids, PromptTokens)
    back = pickle.loads(pickle.dumps(req))
    assert not back.prompt_token_ids.materialized and back.prompt_token_ids == [5, 6, 7]
    assert back.sampling == SamplingParams(max_tokens=3)
    with pytest.raises(TypeError, match="SamplingParams"):
        GenerateRequest("r", [1], {"max_tokens": 3}, 0.0)  # type: ignore[arg-type]
