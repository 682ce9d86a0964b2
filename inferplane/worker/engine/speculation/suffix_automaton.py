"""A suffix automaton over a token stream: the longest earlier occurrence of what was just written,
in time proportional to the tokens appended.

Why this structure: speculative decoding proposes the tokens that followed the longest earlier
occurrence of the text's current end (prompt lookup, suffix decoding). An n-gram table answers for
fixed n only; the automaton (Blumer et al.) answers for every length at once, is built online (one
`append` per token, amortized constant), and each state keeps the end of its first occurrence, so
the continuation is a slice of the stream.

A stream may hold several documents (`begin_document`): a separator no token equals sits between
them, so no match crosses from one document into the next.
"""

from __future__ import annotations


class SuffixAutomaton:
    """States are list indices; state 0 is the empty string. `end[s]`: where the first occurrence
    of s's strings ends in `tokens`; `length[s]`: the longest of them."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.end: list[int] = [-1]
        self.last = 0
        self._separators = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def begin_document(self) -> None:
        """Ends the current document: a fresh negative separator (never a token id) follows it."""
        if self.tokens:
            self._separators += 1
            self.append(-self._separators)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        nxt, link, length, end = self.next, self.link, self.length, self.end
        position = len(self.tokens)
        self.tokens.append(token)
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        end.append(position)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # q holds strings of two lengths' worth of end sets: split off the shorter ones
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                end.append(end[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def earlier_match(self, min_length: int) -> tuple[int, int]:
        """(match length, end of its first occurrence) of the longest suffix of the stream that also
        ends earlier in it, or (0, -1) where none of at least `min_length` tokens does."""
        state, final = self.last, len(self.tokens) - 1
        while state > 0 and self.end[state] == final:  # occurs only at the very end: a shorter suffix
            state = self.link[state]
        if state <= 0 or self.length[state] < min_length:
            return 0, -1
        return self.length[state], self.end[state]

    def continuation(self, end: int, count: int) -> list[int]:
        """Up to `count` tokens after position `end`, stopping at a document's end."""
        found = []
        for token in self.tokens[end + 1:end + 1 + count]:
            if token < 0:
                break
            found.append(token)
        return found


class Walker:
    """The longest suffix of another text (a request's) that occurs in an automaton: the matching
    state, advanced token by token as that text grows. Valid for the automaton as it was; the owner
    re-walks (`restart`) after the automaton gained documents, since splitting states moves them."""

    def __init__(self, automaton: SuffixAutomaton) -> None:
        self.automaton = automaton
        self.state = 0
        self.matched = 0

    def restart(self, tokens: list[int]) -> None:
        self.state = self.matched = 0
        for token in tokens:
            self.step(token)

    def step(self, token: int) -> None:
        auto = self.automaton
        state, matched = self.state, self.matched
        while state > 0 and token not in auto.next[state]:
            state = auto.link[state]
            matched = auto.length[state]
        found = auto.next[state].get(token)
        if found is None:
            self.state, self.matched = 0, 0
        else:
            self.state, self.matched = found, matched + 1

    def match(self, min_length: int) -> tuple[int, int]:
        """(match length, end of its first occurrence in the automaton), or (0, -1)."""
        if self.matched < min_length:
            return 0, -1
        return self.matched, self.automaton.end[self.state]
