"""frame_seal.py on its own: the link keys depend on the secret, the purpose and the whole
transcript; a frame opens only under the same key, in the other direction, in order, once; the
data tags are keyed. (The raw test peers use these same functions, so the protocol tests alone
could not see a key that ignored the secret.)"""

from __future__ import annotations

import hashlib
import hmac

import pytest

from transfer.frame_seal import MAC_BYTES, ForgedFrame, FrameSeal, data_tag, link_key
from transfer.handshake import proof, transcript

SECRET = b"s" * 32
SAID = transcript("d0", b"n" * 32, "p0", b"p" * 32)


def test_the_key_is_an_hmac_of_the_secret_over_purpose_and_transcript() -> None:
    want = hmac.new(SECRET, b"duet link control\0" + SAID, hashlib.sha256).digest()
    assert link_key(SECRET, b"control", SAID) == want
    others = {
        link_key(b"t" * 32, b"control", SAID),  # another secret
        link_key(SECRET, b"tags", SAID),  # another purpose
        link_key(SECRET, b"control", transcript("d0", b"n" * 32, "p1", b"p" * 32)),  # renamed
        link_key(SECRET, b"control", transcript("d0", b"m" * 32, "p0", b"p" * 32)),  # new nonce
    }
    assert want not in others and len(others) == 4
    # A proof is no key: P's proof, which it gives to anyone, opens nothing.
    assert proof(SECRET, b"P", SAID) != link_key(SECRET, b"control", SAID)


def test_transcripts_of_other_fields_never_read_alike() -> None:
    assert transcript("ab", b"c", "d", b"e") != transcript("a", b"bc", "d", b"e")


def pair_of(key: bytes) -> tuple[FrameSeal, FrameSeal]:
    return FrameSeal(key, b"D", b"P"), FrameSeal(key, b"P", b"D")


def test_a_frame_opens_on_the_other_side_in_order() -> None:
    d, p = pair_of(link_key(SECRET, b"control", SAID))
    first, second = d.seal(b"one"), d.seal(b"two")
    assert len(first) == 3 + MAC_BYTES
    assert p.open(first) == b"one" and p.open(second) == b"two"
    assert d.open(p.seal(b"back")) == b"back"


@pytest.mark.parametrize("how", ["other secret", "reflected", "reordered", "replayed", "altered"])
def test_a_frame_that_is_not_the_next_from_the_peer_fails(how: str) -> None:
    key = link_key(SECRET, b"control", SAID)
    d, p = pair_of(key)
    frames = [d.seal(b"one"), d.seal(b"two")]
    if how == "other secret":
        forged, _ = pair_of(link_key(b"t" * 32, b"control", SAID))
        bad, opener = forged.seal(b"one"), p
    elif how == "reflected":  # D's own frame played back to it
        bad, opener = frames[0], d
    elif how == "reordered":
        bad, opener = frames[1], p
    elif how == "replayed":
        assert p.open(frames[0]) == b"one"
        bad, opener = frames[0], p
    else:
        bad, opener = frames[0][:-1] + bytes([frames[0][-1] ^ 1]), p
    with pytest.raises(ForgedFrame):
        opener.open(bad)
    with pytest.raises(ForgedFrame):
        opener.open(b"short")


def test_data_tags_are_keyed() -> None:
    tags = link_key(SECRET, b"tags", SAID)
    want = hashlib.blake2b((7).to_bytes(8, "big") + (3).to_bytes(4, "big"), key=tags, digest_size=8)
    assert data_tag(tags, 7, 3) == int.from_bytes(want.digest(), "big")
    assert data_tag(link_key(b"t" * 32, b"tags", SAID), 7, 3) != data_tag(tags, 7, 3)
