"""Where speculative proposals come from: the suffix automaton against brute force, and the suffix
method's history kept apart per tenant and adapter."""

from __future__ import annotations

import random

import pytest

from inferplane.worker.engine.speculation.proposers import HISTORY_TOKENS, NamespaceHistory, TenantHistory
from inferplane.worker.engine.speculation.speculator import (
    Acceptance,
    Cooldown,
    StepCost,
    accepted_length,
    worth_proposing,
)
from inferplane.worker.engine.speculation.suffix_automaton import SuffixAutomaton, Walker


def brute_earlier_match(tokens: list[int], min_length: int) -> tuple[int, int]:
    """The longest suffix that also ends earlier, and the end of its first occurrence."""
    n = len(tokens)
    for length in range(n - 1, min_length - 1, -1):
        suffix = tokens[n - length:]
        for end in range(length - 1, n - 1):
            if tokens[end - length + 1:end + 1] == suffix:
                return length, end
    return 0, -1


def test_the_automaton_finds_the_longest_earlier_match_and_its_first_occurrence() -> None:
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        automaton = SuffixAutomaton()
        for i, token in enumerate(tokens):
            automaton.append(token)
            assert automaton.earlier_match(1) == brute_earlier_match(tokens[:i + 1], 1), tokens[:i + 1]
        match, end = automaton.earlier_match(2)
        assert (match, end) == brute_earlier_match(tokens, 2)
        if match:
            assert automaton.continuation(end, 3) == tokens[end + 1:end + 4]


def test_documents_never_match_across_their_boundary() -> None:
    automaton = SuffixAutomaton()
    automaton.extend([1, 2, 3])
    automaton.begin_document()
    automaton.extend([4, 5])
    walker = Walker(automaton)
    walker.restart([9, 3, 4])  # "3 4" spans the boundary: only "4" matches
    assert walker.matched == 1
    assert automaton.continuation(2, 5) == []  # the first document's end: nothing follows it


def test_the_walker_matches_what_brute_force_finds() -> None:
    rng = random.Random(1)
    for _ in range(100):
        text = [rng.randrange(4) for _ in range(rng.randrange(5, 60))]
        query = [rng.randrange(4) for _ in range(rng.randrange(1, 20))]
        automaton = SuffixAutomaton()
        automaton.extend(text)
        walker = Walker(automaton)
        for i, token in enumerate(query):
            walker.step(token)
            seen = query[:i + 1]
            longest = max((n for n in range(1, len(seen) + 1)
                           if any(text[s:s + n] == seen[-n:] for s in range(len(text) - n + 1))), default=0)
            assert walker.matched == longest
            if longest:
                end = automaton.end[walker.state]
                assert text[end - longest + 1:end + 1] == seen[-longest:]


def test_history_is_kept_per_tenant_and_namespace_and_bounded() -> None:
    history = TenantHistory()
    history.add(("a", "salt"), [1, 2, 3, 4])
    assert history.get(("b", "salt")) is None and history.get(("a", "other")) is None
    space = NamespaceHistory()
    for i in range(40):
        space.add([i] * 4000)
    assert len(space.automaton) <= HISTORY_TOKENS
    assert space.documents[-1] == [39] * 4000  # the newest kept, the oldest dropped
    bounded = TenantHistory(total_tokens=10_000)
    for tenant in "abcd":
        bounded.add((tenant, ""), [1] * 4000)
    assert bounded.tokens() <= 10_000
    assert bounded.get(("a", "")) is None and bounded.get(("d", "")) is not None  # least recently used out


def test_acceptance_cooldown_and_what_a_draft_may_cost() -> None:
    assert accepted_length([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_length([5, 6], [5, 6, 8]) == 2
    assert accepted_length([5], [4, 5]) == 0
    cooldown = Cooldown()
    cooldown.verified(0, output_len=14)
    assert cooldown.resume_at == 16  # a miss: two tokens before the next look
    cooldown.verified(0, output_len=16)
    assert cooldown.resume_at == 20
    cooldown.verified(2, output_len=20)
    assert cooldown.misses == 0
    cooldown.nothing_found(30)
    cooldown.nothing_found(31)
    assert cooldown.resume_at == 33
    acceptance = Acceptance()
    for _ in range(20):
        acceptance.update(4, 4)  # everything kept: the rate tends to 4/4
    assert acceptance.rate > 0.95
    for _ in range(20):
        acceptance.update(4, 0)
    assert acceptance.rate < 0.05
    # a draft token pays where it is kept more often than a row costs
    assert worth_proposing(0.9, 0.2) == 15  # 0.9 ** 15 = 0.206 > 0.2 > 0.9 ** 16
    assert worth_proposing(0.9, 0.65) == 4
    assert worth_proposing(0.1, 0.5) == 0  # not even one token pays: only a probe now and then


def test_step_cost_is_measured_per_batch_size() -> None:
    cost = StepCost()
    assert cost.row_share(1) == pytest.approx(0.2)  # the prior, before anything was measured
    for _ in range(30):
        cost.observe(1, 0, 0.005)  # a batch of one: 5 ms a step
        cost.observe(1, 4, 0.009)  # and 1 ms for each of four draft rows
        cost.observe(8, 0, 0.016)  # a batch of eight: 16 ms
        cost.observe(8, 2, 0.020)  # 2 ms a draft row
    assert cost.row_share(1) == pytest.approx(0.001 / 0.005)
    assert cost.row_share(8) == pytest.approx(0.002 * 8 / 0.016)
    assert cost.row_share(4) == pytest.approx(0.2 * 4 / 1.6)  # not measured: the prior
