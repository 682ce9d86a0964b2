"""Stop strings in the answer's text: where one ends the answer, and how much text is held back
because it could begin one. Apart from outputs.py so that a resumed stream (intake.py) holds back
exactly what the replica it left held back.
"""

from __future__ import annotations

from inferplane.worker.engine.sequence import Sequence


def cut_at_stop(seq: Sequence, delta: str) -> tuple[str, bool]:
    """Appends `delta` to the output text, and says what of it may be sent and whether a stop
    string completed. A stop string and what follows are not part of the answer (vLLM's default),
    and no part of one is ever sent: text that could begin a stop string is held back until the
    next token shows whether it does (`held_back`), so a stop spanning tokens never leaks its start."""
    sent = seq.text_sent
    text = seq.output_text + delta
    # A stop cannot begin in text already sent: that text was no stop's beginning when it went out.
    cut = None
    for stop in seq.params.stop:
        idx = text.find(stop, sent)
        if idx != -1 and (cut is None or idx < cut):
            cut, seq.stop_string = idx, stop
    if cut is not None:
        seq.output_text = text[:cut]
        seq.text_sent = cut
        return text[sent:cut], True
    seq.output_text = text
    seq.text_sent = max(sent, len(text) - held_back(text, seq.params.stop))
    return text[sent:seq.text_sent], False


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could begin a stop string: the longest suffix that
    is a stop's proper prefix."""
    for k in range(min(len(text), max(len(s) for s in stops) - 1), 0, -1):
        tail = text[-k:]
        if any(stop.startswith(tail) for stop in stops):
            return k
    return 0
