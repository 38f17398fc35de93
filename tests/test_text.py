"""The text layer: stop strings are held back until they complete or cannot, so streamed text
is always exactly the final text, and never contains a stop string."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SpeculativeDecoder, load
from specdec.text import TextStream, held_back_length


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


def test_held_back_length():
    assert held_back_length("abcab", ["abcd"]) == 2
    assert held_back_length("xyz", ["abc", "zq"]) == 1
    assert held_back_length("abc", ["abc"]) == 0  # a complete stop string is not held, it stops


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
