"""The wire codec: every message round-trips, and anything malformed is a TransferProtocolError
(never another exception), including arbitrary bytes (hypothesis)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.transfer.conftest import MODEL, specs
from transfer.frame_seal import data_tag
from transfer.messages import (
    MESSAGE_TYPES,
    Challenge,
    ChunkReady,
    Hello,
    Join,
    PullError,
    PullRequest,
    ReadGrant,
    Ready,
    Refused,
    Reject,
    TransferAck,
    TransferDone,
    TransferProtocolError,
    Welcome,
    decode_message,
    encode_message,
)
from transfer.page_table import PageTable
from transfer.version import PROTOCOL_VERSION

TABLE = PageTable.from_specs(MODEL, specs(two_groups=True))
SAMPLES = [
    Hello("inst", b"\x01" * 32),
    Challenge("inst", b"\x02" * 32, b"\x03" * 32),
    Join(b"\x04" * 32, TABLE, b"\x00ucx-address"),
    Welcome(TABLE, b"\x00ucx", b"\x93export"),
    Refused("authentication failed"),
    Ready("host_shm"),
    PullRequest(
        "req",
        2**63 - 1,
        5,
        {"full": [1, 2], "extra": []},
        {"full": [9], "extra": []},
        {"full": 1, "extra": 0},
        8,
        [2048, 1024],
        3072,
        [0],
    ),  # fmt: skip
    ChunkReady("req", 7, [0, 1, 2]),
    PullError("req", 7, "expired", "the lease expired"),
    TransferDone("req", 7, 22, 3072, 3),
    ReadGrant("req", 7, 22),
    TransferAck("req", 7, 3, False, "declared history mismatch"),
    Reject("", "malformed message"),
]


def test_every_message_type_has_a_sample() -> None:
    assert sorted({type(m).__name__ for m in SAMPLES}) == sorted(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    assert decode_message(encode_message(msg)) == msg


def envelope(type_name: str, body: object, version: object = PROTOCOL_VERSION) -> bytes:
    return msgpack.packb({"v": version, "type": type_name, "body": body}, use_bin_type=True)


ACK = {"request_id": "r", "pull_id": 3, "lease_gen": 3, "ok": True, "error": ""}


@pytest.mark.parametrize(
    "data, reason",
    [
        (
            envelope("TransferAck", ACK, version=PROTOCOL_VERSION + 1),
            f"unsupported protocol version int {PROTOCOL_VERSION + 1}",
        ),
        (envelope("TransferAck", ACK, version=True), "unsupported protocol version bool True"),
        (envelope("Teleport", ACK), "unknown message type str 'Teleport'"),
        (envelope("TransferAck", {**ACK, "extra": 1}), "expected fields"),
        (envelope("TransferAck", {k: v for k, v in ACK.items() if k != "ok"}), "expected fields"),
        (envelope("TransferAck", {**ACK, "ok": 1}), "TransferAck.ok: expected bool, got int 1"),
        (
            envelope("TransferAck", {**ACK, "pull_id": True}),
            "TransferAck.pull_id: expected a non-negative int64",
        ),
        (envelope("TransferAck", {**ACK, "pull_id": -1}), "non-negative int64"),
        (envelope("TransferAck", {**ACK, "pull_id": 2**64 - 1}), "non-negative int64"),
        (
            envelope("ChunkReady", {"request_id": "r", "pull_id": 1, "chunks": [1, "2"]}),
            "ChunkReady.chunks",
        ),
        (envelope("Hello", {"instance_id": "i", "nonce": "text"}), "Hello.nonce: expected bytes"),
        (envelope("TransferAck", [1, 2]), "expected fields"),
        (msgpack.packb([1, 2, 3]), "expected a map with keys"),
        (b"", "not a msgpack message"),
        (encode_message(SAMPLES[0]) + b"\x00", "not a msgpack message"),
    ],
)
def test_malformed_messages_are_rejected_with_the_reason(data: bytes, reason: str) -> None:
    with pytest.raises(TransferProtocolError) as err:
        decode_message(data)
    assert reason in str(err.value)


def test_a_malformed_message_still_names_its_request() -> None:
    with pytest.raises(TransferProtocolError) as err:
        decode_message(
            envelope("TransferDone", {"request_id": "r9", "pull_id": 4, "declared_prompt_len": "x"})
        )
    assert (err.value.request_id, err.value.pull_id) == ("r9", 4)


def test_a_bad_page_table_in_join_is_rejected() -> None:
    wire = TABLE.to_wire()
    wire["pools"][0]["page_bytes"] = "big"
    body = {"proof": b"p", "page_table": wire, "ucx_address": b"a"}
    with pytest.raises(
        TransferProtocolError, match="Join.page_table: page table pool field 'page_bytes'"
    ):
        decode_message(envelope("Join", body))


def test_data_tags_differ_per_chunk_per_pull_and_per_link_key() -> None:
    keys = (b"k" * 32, b"l" * 32)
    tags = {data_tag(k, p, c) for k in keys for p in (1, 2, 2**63 - 1) for c in range(1000)}
    assert len(tags) == 6000 and all(0 <= t < 2**64 for t in tags)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_crash_the_decoder(data: bytes) -> None:
    try:
        decode_message(data)
    except TransferProtocolError:
        pass


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = sorted({name for cls in MESSAGE_TYPES.values() for name in cls.__dataclass_fields__})


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(sorted(MESSAGE_TYPES)),
    st.dictionaries(st.sampled_from(FIELDS), msgpack_values, max_size=12),
)
def test_well_framed_bodies_of_any_shape_never_crash_the_decoder(
    type_name: str, body: dict
) -> None:
    try:
        decode_message(envelope(type_name, body))
    except TransferProtocolError:
        pass
