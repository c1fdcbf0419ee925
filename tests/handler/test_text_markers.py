"""Markers (stop strings, tool-call and think tags) found in text that arrives in pieces, in memory linear in the
markers' length."""
import random
import tracemalloc

from handler.text_markers import MarkerScanner


def longest_marker_start_at_the_end(text: str, markers) -> int:
    return max((k for m in markers for k in range(1, min(len(m), len(text) + 1)) if text.endswith(m[:k])), default=0)


def test_releases_all_but_what_may_start_a_marker_and_never_a_whole_marker():
    """Checked against a brute-force search, with random markers and text cut at random places."""
    rng = random.Random(7)
    for _ in range(3000):
        markers = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        scanner, released, seen = MarkerScanner(tuple(markers)), "", ""
        for piece in (text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])):
            seen += piece
            before, marker, _ = scanner.split(piece)
            released += before
            if marker is not None:
                assert seen.startswith(released + marker), (markers, text, cuts)
                break
            assert not any(m in seen for m in markers), "a complete marker went unnoticed"
            assert scanner.pending == seen[len(released):], "nothing lost"
            assert len(scanner.pending) == longest_marker_start_at_the_end(seen, markers), (markers, seen)
        else:
            released += scanner.flush()
            assert released == text
        assert not any(m in released for m in markers), "a client never sees a whole marker"


def test_held_back_text_is_only_what_may_start_a_marker():
    scanner = MarkerScanner(("</tool_call>", "<think>"))
    assert scanner.split("hello </tool") == ("hello ", None, "")
    assert scanner.pending == "</tool"
    assert scanner.split("bar") == ("</toolbar", None, "")
    assert scanner.split("x <thi") == ("x ", None, "")
    assert scanner.split("nk> y") == ("", "<think>", " y")


def test_memory_is_linear_in_the_markers_length():
    """The scanner once stored every prefix of every marker: a 30,000-character stop string cost hundreds of MB."""
    marker = "ab" * 15_000
    tracemalloc.start()
    scanner = MarkerScanner((marker,))
    for _ in range(200):
        scanner.split("ab" * 50)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 40 * len(marker), f"{peak} bytes for a {len(marker)}-character marker"
    assert scanner.split("ab" * 5_000) == ("", marker, "")
