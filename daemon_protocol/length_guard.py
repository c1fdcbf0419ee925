"""Catch a MessagePack length that claims more than a message may hold, at its header.

msgpack's unpacker checks an array's or map's count at its header, but a string's, binary's or extension's
length only once the whole body has arrived: a header claiming 300 MiB makes it wait for 300 MiB, swallowing
every request after it into a string that never completes, with nothing logged. LengthGuard reads the same
bytes and walks their headers, resuming where it stopped at each read, and raises ValueError at the first length
or count above the limit. Elements that have arrived whole are skipped by msgpack's own parser; only the
headers of elements still arriving are read here, each once.
"""
import struct

import msgpack

SCALAR, CONTAINER, BODY = "scalar", "container", "body"
# First byte -> (what it starts, bytes of its length field, bytes between that and the body, elements per count)
_SIZED = {
    0xc4: (BODY, 1, 0, 1), 0xc5: (BODY, 2, 0, 1), 0xc6: (BODY, 4, 0, 1),  # bin 8/16/32
    0xc7: (BODY, 1, 1, 1), 0xc8: (BODY, 2, 1, 1), 0xc9: (BODY, 4, 1, 1),  # ext 8/16/32 (a type byte follows)
    0xd9: (BODY, 1, 0, 1), 0xda: (BODY, 2, 0, 1), 0xdb: (BODY, 4, 0, 1),  # str 8/16/32
    0xdc: (CONTAINER, 2, 0, 1), 0xdd: (CONTAINER, 4, 0, 1),               # array 16/32
    0xde: (CONTAINER, 2, 0, 2), 0xdf: (CONTAINER, 4, 0, 2),               # map 16/32: a key and a value each
}
_LENGTH_FORMATS = {1: ">B", 2: ">H", 4: ">I"}
# First byte -> the whole scalar's size: nil, false, true, floats, ints, fixext 1/2/4/8/16
_FIXED = {0xc0: 1, 0xc2: 1, 0xc3: 1, 0xca: 5, 0xcb: 9, 0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9, 0xd0: 2, 0xd1: 3,
          0xd2: 5, 0xd3: 9, 0xd4: 3, 0xd5: 4, 0xd6: 6, 0xd7: 10, 0xd8: 18}


def unpacker_limits(max_bytes: int) -> dict:
    """msgpack.Unpacker's bounds for messages of at most max_bytes (each element takes at least one byte)."""
    return {"max_buffer_size": max_bytes, "max_str_len": max_bytes, "max_bin_len": max_bytes,
            "max_ext_len": max_bytes, "max_array_len": max_bytes, "max_map_len": max_bytes // 2}


class LengthGuard:
    """Reads a stream's headers as its bytes arrive. A stream of MessagePack is its elements' headers in pre-order
    (a container's header, then its elements), each followed by its body if it has one; so the next header is
    found without knowing which container it belongs to."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._leftover = b""  # the first bytes of a header (or scalar) whose other bytes have not arrived
        self._body_left = 0   # bytes still to come of the string, binary or extension being read

    def feed(self, data: bytes) -> None:
        """The stream's next bytes; raises ValueError at a length or count above max_bytes."""
        buffer = self._leftover + data if self._leftover else data
        pos, end = 0, len(buffer)
        while pos < end:
            if self._body_left:
                step = min(self._body_left, end - pos)
                pos += step
                self._body_left -= step
                continue
            pos = self._skip_whole_elements(buffer, pos)
            header = self._header(buffer, pos)
            if header is None:
                break
            kind, size, count = header
            pos += size
            if kind == BODY:
                self._body_left = count
        self._leftover = bytes(buffer[pos:])

    def _skip_whole_elements(self, buffer, pos: int) -> int:
        """Past the elements from pos on that have arrived whole (msgpack's own parser, with the same bounds)."""
        skipper = msgpack.Unpacker(**unpacker_limits(self.max_bytes))
        skipper.feed(memoryview(buffer)[pos:])
        taken = 0
        while True:
            try:
                skipper.skip()
            except msgpack.OutOfData:
                return pos + taken
            taken = skipper.tell()

    def _header(self, buffer, pos: int) -> tuple[str, int, int] | None:
        """(kind, header size, body bytes or element count) of the element at pos; None until its bytes are here."""
        if pos >= len(buffer):
            return None
        first = buffer[pos]
        if first <= 0x7f or first >= 0xe0:
            return SCALAR, 1, 0
        if first <= 0x8f:
            return self._checked(CONTAINER, 1, 2 * (first & 0x0f))
        if first <= 0x9f:
            return self._checked(CONTAINER, 1, first & 0x0f)
        if first <= 0xbf:
            return self._checked(BODY, 1, first & 0x1f)
        if first in _FIXED:
            return (SCALAR, _FIXED[first], 0) if pos + _FIXED[first] <= len(buffer) else None
        kind, length_bytes, gap, per_count = _SIZED[first]  # 0xc1, the one byte left, msgpack refused in skip()
        if pos + 1 + length_bytes + gap > len(buffer):
            return None
        (length,) = struct.unpack_from(_LENGTH_FORMATS[length_bytes], buffer, pos + 1)
        return self._checked(kind, 1 + length_bytes + gap, length * per_count)

    def _checked(self, kind: str, size: int, count: int) -> tuple[str, int, int]:
        if count > self.max_bytes:
            what = "bytes" if kind == BODY else "elements"
            raise ValueError(f"a MessagePack header claims {count} {what}, more than the {self.max_bytes} bytes "
                             "a message may hold")
        return kind, size, count
