"""Large values that many messages to an engine's process carry (a grammar's tokenizer info, which every constrained
request needs there, and each grammar that many requests share), sent down each pipe once while both ends keep it.

A SentOnce pickles in full the first time a PipePickler writes it to its pipe, and as its digest while it stays among
the KEPT values most recently sent down that pipe. The receiving process keeps the same values, by the same rule:
both ends see the same values in the same order (the messages are read as they were written), so they keep and drop
the same ones, and a digest always finds its value (the same object, so what is decoded from it is decoded once).
Pickled anywhere else, a SentOnce travels in full.
"""
import hashlib
import io
import pickle
from collections import OrderedDict
from multiprocessing.reduction import ForkingPickler

KEPT = 256  # values each end of a pipe keeps: the most recently sent


class SentOnce:
    __slots__ = ("value", "digest", "_decoded")

    def __init__(self, value):
        """value: bytes, or a str (hashed as UTF-8); its digest is computed here, once."""
        self.value = value
        data = value.encode() if isinstance(value, str) else value
        self.digest = hashlib.blake2b(data, digest_size=16).hexdigest()
        self._decoded = None

    def __reduce__(self):
        return received, (self.value, self.digest)

    def decoded(self, decode):
        """decode(value), computed on the first call only (a receiving process keeps one SentOnce per value)."""
        if self._decoded is None:
            self._decoded = decode(self.value)
        return self._decoded


class KeptValues(OrderedDict):
    """The values one end of a pipe keeps, least recently sent first: `note` is what either end does for each
    SentOnce of each message, in order, so that both ends keep the same ones."""

    def note(self, digest: str, value=None) -> bool:
        """Marks a value sent (value: the receiver's object, None for the sender); whether it was kept before."""
        kept = digest in self
        if kept:
            self.move_to_end(digest)
        else:
            self[digest] = value
            if len(self) > KEPT:
                self.popitem(last=False)
        return kept


_received = KeptValues()  # in a receiving process: the values of its one pipe from its parent


def received(value, digest: str) -> SentOnce:
    """A SentOnce that came in full (unpickling): kept (the kept one, if it came before by another way)."""
    if _received.note(digest):
        return _received[digest]
    shared = SentOnce.__new__(SentOnce)
    shared.value, shared.digest, shared._decoded = value, digest, None
    _received[digest] = shared
    return shared


def recalled(digest: str) -> SentOnce:
    """A SentOnce sent by its digest (unpickling): the one kept since it came in full down the same pipe."""
    if digest not in _received:
        raise RuntimeError(f"a value sent once ({digest}) was referred to but is not kept here: messages down a pipe "
                           "must be unpickled in the order they were written")
    _received.note(digest)
    return _received[digest]


class PipePickler:
    """Pickles the messages of one pipe, each SentOnce in full only when the other end does not keep it. Its caller
    writes every message it pickles, in order (a message pickled and never written would leave the two ends keeping
    different values)."""

    def __init__(self):
        self.kept = KeptValues()

    def dumps(self, message) -> memoryview:
        buffer = io.BytesIO()
        pickler = _Pickler(buffer, self.kept)
        pickler.dump(message)
        self.kept = pickler.kept  # what the whole message noted (the same object if it noted nothing)
        return buffer.getbuffer()


class _Pickler(ForkingPickler):
    """multiprocessing's pickler (what Connection.send uses), with SentOnce values the other end keeps sent by their
    digest. It notes them in a copy of what is kept, made at the message's first SentOnce (most messages have none),
    which the PipePickler takes once the whole message has pickled."""

    def __init__(self, file, kept: KeptValues):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.kept, self.copied = kept, False

    def reducer_override(self, obj):
        if type(obj) is not SentOnce:
            return NotImplemented
        if not self.copied:
            self.kept, self.copied = KeptValues(self.kept), True
        if self.kept.note(obj.digest):
            return recalled, (obj.digest,)
        return NotImplemented
