"""Where proposed tokens come from: the request's own text (`ngram`, prompt lookup) and, for
`suffix`, the recent requests of the same tenant under the same cache namespace too.

Both propose what followed the longest earlier occurrence of the request's last tokens
(suffix_automaton.py), at least MIN_MATCH tokens long: an exact copy is what repeats in code edits,
RAG answers quoting their context and agents echoing tool output. Proposals are deterministic, so
verification needs no draft distribution (verify.py says why the output is unchanged).

Isolation: `TenantHistory` keeps one automaton per (tenant, cache namespace), the namespace being
the radix cache's (api/kv_blocks.kv_namespace: the gateway's per-tenant salt, and the LoRA adapter's
key), so one tenant's text, or text written under another adapter, is never proposed to another.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from inferplane.api.kv_blocks import kv_namespace
from inferplane.worker.engine.sequence import Sequence
from inferplane.worker.engine.speculation.suffix_automaton import SuffixAutomaton, Walker

MIN_MATCH = 3  # shorter matches propose mostly noise (two-token phrases recur everywhere)
HISTORY_TOKENS = 32_768  # per namespace: recent requests' tokens kept (the older half dropped beyond)
# All namespaces together, least recently used out: an automaton holds about two states a token, each
# a small dict, some 500 bytes a token in all: this bounds the worker's history near 64 MiB.
HISTORY_TOTAL_TOKENS = 131_072


@dataclass
class Proposal:
    tokens: list[int]
    match: int  # the length of the matched suffix (longer: likelier to be copied on)


def history_key(seq: Sequence) -> tuple[str, str]:
    """The namespace a request's text is kept and matched in: its tenant and its cache namespace."""
    return seq.tenant, kv_namespace(seq.cache_salt, seq.adapter_key)


class NamespaceHistory:
    """One namespace's recent finished requests, as one automaton of documents."""

    def __init__(self) -> None:
        self.automaton = SuffixAutomaton()
        self.documents: deque[list[int]] = deque()
        self.version = 0  # bumped at each change: walkers made before it re-walk

    def add(self, tokens: list[int]) -> None:
        if len(tokens) > HISTORY_TOKENS // 2:
            tokens = tokens[-(HISTORY_TOKENS // 2):]
        self.documents.append(tokens)
        if len(self.automaton) + len(tokens) + 1 > HISTORY_TOKENS:  # keep the newest half, rebuilt
            kept, total = deque(), 0
            for document in reversed(self.documents):
                if total + len(document) > HISTORY_TOKENS // 2:
                    break
                kept.appendleft(document)
                total += len(document) + 1
            self.documents, self.automaton = kept, SuffixAutomaton()
            for document in kept:
                self.automaton.begin_document()
                self.automaton.extend(document)
        else:
            self.automaton.begin_document()
            self.automaton.extend(tokens)
        self.version += 1


class TenantHistory:
    """The `suffix` method's memory: recent requests per namespace, bounded in tokens per namespace
    and in all (the least recently used namespaces go first)."""

    def __init__(self, total_tokens: int = HISTORY_TOTAL_TOKENS) -> None:
        self._spaces: OrderedDict[tuple[str, str], NamespaceHistory] = OrderedDict()
        self.total_tokens = total_tokens

    def get(self, key: tuple[str, str]) -> NamespaceHistory | None:
        found = self._spaces.get(key)
        if found is not None:
            self._spaces.move_to_end(key)
        return found

    def add(self, key: tuple[str, str], tokens: list[int]) -> None:
        space = self._spaces.get(key)
        if space is None:
            space = self._spaces[key] = NamespaceHistory()
        self._spaces.move_to_end(key)
        space.add(tokens)
        while len(self._spaces) > 1 and self.tokens() > self.total_tokens:
            self._spaces.popitem(last=False)

    def tokens(self) -> int:
        return sum(len(space.automaton) for space in self._spaces.values())

    def __len__(self) -> int:
        return len(self._spaces)


@dataclass
class RequestText:
    """A sequence's own text as an automaton (kept on the sequence while it runs), and for `suffix`
    its walk through its namespace's history."""

    own: SuffixAutomaton = field(default_factory=SuffixAutomaton)
    walker: Walker | None = None
    walked_version: int = -1
    walked_tokens: int = 0

    def sync(self, seq: Sequence) -> None:
        """Appends what the sequence wrote since the last call."""
        have = len(self.own)
        if have < seq.num_prompt_tokens:
            self.own.extend(seq.prompt_token_ids[have:])
            have = seq.num_prompt_tokens
        self.own.extend(seq.output_token_ids[have - seq.num_prompt_tokens:])

    def propose_own(self, count: int) -> Proposal | None:
        match, end = self.own.earlier_match(MIN_MATCH)
        if not match:
            return None
        return Proposal(self.own.continuation(end, count), match)

    def propose_history(self, seq: Sequence, space: NamespaceHistory, count: int) -> Proposal | None:
        if self.walker is None or self.walker.automaton is not space.automaton or self.walked_version != space.version:
            self.walker = Walker(space.automaton)  # re-walked: the automaton changed under it
            tail = seq.all_token_ids[-256:]
            self.walker.restart(tail)
            self.walked_version, self.walked_tokens = space.version, seq.num_tokens
        else:
            for token in seq.token_slice(self.walked_tokens, seq.num_tokens):
                self.walker.step(token)
            self.walked_tokens = seq.num_tokens
        match, end = self.walker.match(MIN_MATCH)
        if not match:
            return None
        return Proposal(space.automaton.continuation(end, count), match)
