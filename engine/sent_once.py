"""Large values that many messages to an engine's process carry (a grammar's tokenizer info, which every constrained
request needs there), sent down each pipe once.

A SentOnce pickles in full the first time a PipePickler writes it to its pipe, and as its digest every later time;
the receiving process keeps each one it received in full (the same object, so what is cached against it there is
found again) and finds it by its digest. Pickled anywhere else, it travels in full.
"""
import hashlib
import io
import pickle
from multiprocessing.reduction import ForkingPickler


class SentOnce:
    __slots__ = ("value", "digest")

    def __init__(self, value):
        """value: bytes, or a str (hashed as UTF-8); its digest is computed here, once."""
        self.value = value
        data = value.encode() if isinstance(value, str) else value
        self.digest = hashlib.blake2b(data, digest_size=16).hexdigest()

    def __reduce__(self):
        return received, (self.value, self.digest)


_received: dict[str, SentOnce] = {}  # in a receiving process: each value that came in full, by digest


def received(value, digest: str) -> SentOnce:
    """A SentOnce that came in full (unpickling): kept, and the kept one returned if it came before."""
    if digest not in _received:
        shared = SentOnce.__new__(SentOnce)
        shared.value, shared.digest = value, digest
        _received[digest] = shared
    return _received[digest]


def recalled(digest: str) -> SentOnce:
    """A SentOnce sent by its digest (unpickling): the one that came in full before down the same pipe."""
    try:
        return _received[digest]
    except KeyError:
        raise RuntimeError(f"a value sent once ({digest}) was referred to before it came in full: messages down "
                           "a pipe must be unpickled in the order they were written") from None


class PipePickler:
    """Pickles the messages of one pipe, each SentOnce in full only the first time it goes down that pipe. Its
    caller writes every message it pickles, in order (a message pickled and never written would leave the other
    end without a value that later messages refer to)."""

    def __init__(self):
        self.sent: set[str] = set()

    def dumps(self, message) -> memoryview:
        buffer = io.BytesIO()
        pickler = _Pickler(buffer, self.sent)
        pickler.dump(message)
        self.sent |= pickler.new
        return buffer.getbuffer()


class _Pickler(ForkingPickler):
    """multiprocessing's pickler (what Connection.send uses), with SentOnce values already sent by their digest."""

    def __init__(self, file, sent: set[str]):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.sent, self.new = sent, set()

    def reducer_override(self, obj):
        if type(obj) is not SentOnce:
            return NotImplemented
        if obj.digest in self.sent or obj.digest in self.new:
            return recalled, (obj.digest,)
        self.new.add(obj.digest)
        return NotImplemented
