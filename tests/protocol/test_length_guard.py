"""LengthGuard follows the structure of any valid stream, cut anywhere, and stops at the first header that claims
more than a message may hold, as soon as that header's bytes are in."""
import struct

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from daemon_protocol.length_guard import LengthGuard

LIMIT = 1 << 20
OVERSIZED = {
    "str32": b"\xdb" + struct.pack(">I", LIMIT + 1),
    "bin32": b"\xc6" + struct.pack(">I", LIMIT + 1),
    "ext32": b"\xc9" + struct.pack(">I", LIMIT + 1) + b"\x05",
    "array32": b"\xdd" + struct.pack(">I", LIMIT + 1),
    "map32": b"\xdf" + struct.pack(">I", LIMIT // 2 + 1),  # a key and a value per entry
}

leaves = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
          | st.text(max_size=300) | st.binary(max_size=300)
          # fixext 1/2/4/8/16, ext 8 and ext 16, their data 0xc1 (the byte that starts nothing: a header misread
          # anywhere lands on one)
          | st.builds(msgpack.ExtType, st.integers(0, 127),
                      st.sampled_from([1, 2, 4, 8, 16, 0, 3, 17, 300]).map(lambda n: b"\xc1" * n)))
objects = st.recursive(leaves, lambda children: st.lists(children, max_size=20)
                       | st.dictionaries(st.text(max_size=5), children, max_size=10), max_leaves=60)


def feed_in_pieces(guard: LengthGuard, data: bytes, cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(data)]
    for start, end in zip(bounds, bounds[1:]):
        guard.feed(data[start:end])


@settings(max_examples=150, deadline=None)
@given(st.lists(objects, min_size=1, max_size=4), st.sampled_from(sorted(OVERSIZED)),
       st.sampled_from(["top level", "in an array", "in a map"]), st.booleans(), st.data())
def test_valid_objects_pass_and_the_header_after_them_is_caught(values, oversized, where, every_byte, data):
    """Whatever the cuts (a few, or between every two bytes, where every header is read by the guard rather
    than skipped by msgpack), the valid objects pass; the oversized header after them, at the top level or
    inside a container, raises once its last byte is fed, not before."""
    stream = b"".join(msgpack.packb(value) for value in values)
    stream += {"top level": b"", "in an array": b"\x92" + msgpack.packb(values[0]), "in a map": b"\x81\xa1k"}[where]
    cuts = list(range(len(stream))) if every_byte else data.draw(st.lists(st.integers(0, len(stream)), max_size=8))
    guard = LengthGuard(LIMIT)
    feed_in_pieces(guard, stream, cuts)
    header = OVERSIZED[oversized]
    for byte in header[:-1]:
        guard.feed(bytes([byte]))
    with pytest.raises(ValueError, match="more than the 1048576 bytes a message may hold"):
        guard.feed(header[-1:])


def test_long_bodies_spanning_many_reads():
    value = {"text": "é" * 200_000, "blob": b"\x00" * 300_000, "ids": list(range(70_000))}
    packed = msgpack.packb(value) + OVERSIZED["str32"]
    guard = LengthGuard(LIMIT)
    feed_in_pieces(guard, packed[:-1], list(range(1, len(packed) - 1, 4093)))
    with pytest.raises(ValueError):
        guard.feed(packed[-1:])


@pytest.mark.parametrize("header, allowed", [
    (b"\xc5" + struct.pack(">H", 1000), True), (b"\xc5" + struct.pack(">H", 1001), False),
    (b"\xda" + struct.pack(">H", 1001), False), (b"\xc8" + struct.pack(">H", 1001) + b"\x01", False),
    (b"\xdc" + struct.pack(">H", 1000), True), (b"\xdc" + struct.pack(">H", 1001), False),
    (b"\xde" + struct.pack(">H", 500), True), (b"\xde" + struct.pack(">H", 501), False),
])
def test_the_limit_is_inclusive(header, allowed):
    guard = LengthGuard(1000)
    if allowed:
        guard.feed(header)
    else:
        with pytest.raises(ValueError, match="more than the 1000 bytes"):
            guard.feed(header)


def test_a_byte_that_starts_no_object():
    with pytest.raises(ValueError):
        LengthGuard(LIMIT).feed(b"\x92\x01\xc1")
