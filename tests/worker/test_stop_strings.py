"""Stop strings that span tokens: no part of one is ever sent, and text held back because it could
begin one goes out as soon as the next token shows it does not, or when the answer ends otherwise.
The concatenated deltas are always the answer's text (what a streamed and a whole answer show)."""

from __future__ import annotations

import random

from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.engine.sequence import Sequence
from inferplane.worker.engine.stop_strings import cut_at_stop, held_back


def sequence(*stops: str) -> Sequence:
    return Sequence("r", [1], SamplingParams(max_tokens=64, stop=list(stops)), max_tokens=64, rng_key=0)


def feed(seq: Sequence, deltas: list[str]) -> tuple[list[str], bool]:
    sent = []
    for delta in deltas:
        out, hit = cut_at_stop(seq, delta)
        sent.append(out)
        if hit:
            return sent, True
    return sent, False


def test_a_stop_spanning_tokens_never_leaks_its_start() -> None:
    seq = sequence("!!")
    sent, hit = feed(seq, ["a", "!", "!", "b"])
    assert (sent, hit, seq.output_text, seq.stop_string) == (["a", "", ""], True, "a", "!!")


def test_held_text_goes_out_once_it_cannot_begin_a_stop() -> None:
    seq = sequence("!!", "END")
    sent, hit = feed(seq, ["a", "!", "b", "E", "N", "x"])
    assert not hit and sent == ["a", "", "!b", "", "", "ENx"] and "".join(sent) == seq.output_text


def test_the_deltas_are_the_answer_whatever_the_tokens() -> None:
    """Random texts cut into random tokens: the sent text is the text before the first stop, and
    no sent prefix ever holds a stop or ends inside one that then completes."""
    rng = random.Random(7)
    for _ in range(500):
        text = "".join(rng.choice("ab!E") for _ in range(rng.randint(1, 30)))
        stops = ["!!", "aE", "b!a"]
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(0, 3)
            pieces.append(text[i:i + n])
            i += n
        seq = sequence(*stops)
        sent, hit = feed(seq, pieces)
        first = min((text.find(s) for s in stops if s in text), default=-1)
        expected = text[:first] if first != -1 else text
        flushed = "" if hit else seq.output_text[seq.text_sent:]  # what an end without a stop sends
        assert "".join(sent) + flushed == expected, (text, pieces)
        assert hit == (first != -1)


def test_held_back_is_the_longest_suffix_that_begins_a_stop() -> None:
    assert held_back("xx!", ["!!"]) == 1
    assert held_back("xxEN", ["END", "!!"]) == 2
    assert held_back("xxEND", ["END"]) == 0  # a whole stop is found, not held
    assert held_back("abc", ["zz"]) == 0
