"""The text layer: stop strings are held back until they complete or cannot, so streamed text
is always exactly the final text, and never contains a stop string."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SpeculativeDecoder, load
from specdec.stops import StopMatcher
from specdec.text import TextStream


class CharTokenizer:
    """id i is chr(i): one character per token."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def stream_text(text: str, stops, chunk_sizes):
    """Push text a character (token) at a time, releasing after every chunk; returns
    (released text, whether a stop string completed, the final text)."""
    stream = TextStream(CharTokenizer(), stops)
    released, position, stopped = "", 0, False
    sizes = iter(chunk_sizes)
    while position < len(text) and not stopped:
        size = next(sizes, 1)
        for char in text[position : position + size]:
            stopped = stream.push(ord(char))
            position += 1
            if stopped:
                break
        released += "".join(piece for piece, _ in stream.release(final=stopped or position >= len(text)))
    return released, stopped, stream.text


def test_a_stop_string_split_across_chunks_never_reaches_the_stream():
    # the reported case: stop "ead", streamed "cfaea" + "d..." must give "cfa"
    released, stopped, final = stream_text("cfaeadxyz", ["ead"], [5, 1, 3])
    assert (released, stopped, final) == ("cfa", True, "cfa")


def test_held_text_is_released_once_it_cannot_be_a_stop_string():
    stream = TextStream(CharTokenizer(), ["end"])
    for char in "the e":
        stream.push(ord(char))
    assert "".join(p for p, _ in stream.release()) == "the "  # "e" might begin "end"
    stream.push(ord("x"))
    assert "".join(p for p, _ in stream.release()) == "ex"


def held_back_reference(text: str, stops) -> int:
    """Slow and obvious: the longest suffix of text that is a proper prefix of a stop string."""
    return max([size for stop in stops for size in range(1, len(stop)) if text.endswith(stop[:size])], default=0)


def test_the_stop_matcher_holds_back_what_may_still_become_a_stop_string():
    matcher = StopMatcher(["abcd"])
    assert matcher.feed("xabcab") is None and matcher.held == 2
    matcher = StopMatcher(["abc", "zq"])
    assert matcher.feed("xyz") is None and matcher.held == 1
    assert matcher.feed("q") == 2  # "zq" from index 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("ab", min_size=1, max_size=5), min_size=1, max_size=4),
       st.lists(st.text("abc", max_size=4), max_size=12))
def test_the_stop_matcher_finds_what_searching_each_stop_string_finds(stops, pieces):
    """Fed piece by piece: the earliest start of a stop string ending in the new piece (each
    string searched from where it could end there), and the held-back length, as the obvious
    per-string search and suffix test give them; the cost per character does not grow with the
    number of strings (one automaton). Mutation, checked: matches found only at a state's own
    string (no fallback outputs) fail it."""
    matcher, text = StopMatcher(stops), ""
    for piece in pieces:
        before, text = len(text), text + piece
        hits = [hit for stop in stops if (hit := text.find(stop, max(0, before - len(stop) + 1))) >= 0]
        found = matcher.feed(piece)
        assert found == (min(hits) if hits else None)
        if found is not None:
            return
        assert matcher.held == held_back_reference(text, stops)


def first_stop_reference(text: str, stops) -> str:
    """Slow and obvious: after each character, stop at the earliest stop string seen so far."""
    for end in range(1, len(text) + 1):
        hits = [text[:end].find(s) for s in stops if s in text[:end]]
        if hits:
            return text[: min(hits)]
    return text


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abcde", min_size=0, max_size=30),
       stops=st.lists(st.text(alphabet="abcdef", min_size=1, max_size=4), min_size=1, max_size=3),
       chunk_sizes=st.lists(st.integers(1, 6), max_size=30))
def test_streamed_text_is_the_final_text_without_stop_strings(text, stops, chunk_sizes):
    released, stopped, final = stream_text(text, stops, chunk_sizes)
    assert released == final == first_stop_reference(text, stops)
    assert not any(stop in released for stop in stops)
    assert stopped == (final != text or any(stop in text for stop in stops))


@pytest.fixture(scope="module")
def char_decoder(tiny_pair):
    target = load(tiny_pair["target"], dtype="float64")
    return SpeculativeDecoder(target, load(tiny_pair["perturbed"], dtype="float64"), gamma=4)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_decoder_streams_never_show_a_stop_string(char_decoder, data):
    prompt = data.draw(st.text(alphabet="abcdefgh(): ", min_size=1, max_size=8))
    full = char_decoder.generate(prompt, max_new_tokens=40).text
    # stop strings cut from the output itself (so they are hit), and random ones
    starts = data.draw(st.lists(st.integers(0, max(0, len(full) - 1)), min_size=0, max_size=2))
    stops = [full[s : s + data.draw(st.integers(1, 4))] for s in starts if full]
    stops += data.draw(st.lists(st.text(alphabet="abcdefgh(): ", min_size=1, max_size=3), max_size=2))
    stops = [s for s in stops if s]
    chunks = list(char_decoder.stream(prompt, max_new_tokens=40, stop=stops))
    streamed = "".join(chunk.text for chunk in chunks)
    result = chunks[-1].result
    assert streamed == result.text == first_stop_reference(full, stops)
    assert not any(stop in streamed for stop in stops)
    assert (result.finish_reason == "stop") == any(stop in full for stop in stops)
