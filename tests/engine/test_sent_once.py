"""engine/sent_once.py: both ends of a pipe keep the same values, so a value the other end keeps goes by its digest
and one it dropped goes in full again; a message that fails to pickle changes nothing."""
import pickle

import pytest

from engine import sent_once
from engine.sent_once import PipePickler, SentOnce

SIZE = 1000


@pytest.fixture
def receiving_end(monkeypatch):
    monkeypatch.setattr(sent_once, "KEPT", 2)
    monkeypatch.setattr(sent_once, "_received", sent_once.KeptValues())


def test_both_ends_keep_the_most_recently_sent_values(receiving_end):
    a, b, c = (SentOnce(letter * SIZE) for letter in "abc")
    pipe, full = PipePickler(), []
    for value in (a, b, a, c, b, a):  # kept after each, oldest first: a | a b | b a | a c | c b | b a
        message = bytes(pipe.dumps(("message", value)))
        full.append(len(message) > SIZE)
        _, got = pickle.loads(message)
        assert got.value == value.value
        assert list(sent_once._received) == list(pipe.kept)
    assert full == [True, True, False, True, True, True]


def test_a_message_that_does_not_pickle_changes_what_is_kept(receiving_end):
    a, b = SentOnce("a" * SIZE), SentOnce("b" * SIZE)
    pipe = PipePickler()
    pickle.loads(bytes(pipe.dumps(("message", a))))
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pipe.dumps(("message", b, lambda: None))
    assert list(pipe.kept) == [a.digest]
    _, got = pickle.loads(bytes(pipe.dumps(("message", b))))  # in full: the failed message never went
    assert got.value == b.value


def test_a_kept_value_is_one_object_decoded_once(receiving_end):
    value, decodes = SentOnce("v" * SIZE), []
    pipe = PipePickler()
    first = pickle.loads(bytes(pipe.dumps(value)))
    again = pickle.loads(bytes(pipe.dumps(value)))
    assert again is first
    assert [received.decoded(lambda text: decodes.append(text) or len(text)) for received in (first, again)] == \
        [SIZE, SIZE]
    assert len(decodes) == 1
