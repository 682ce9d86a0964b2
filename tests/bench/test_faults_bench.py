"""`inferplane bench faults` runs against real worker and gateway processes and reports what it counts."""

from __future__ import annotations

import json

import pytest

from inferplane.bench import faults

pytestmark = pytest.mark.slow


def test_the_bench_kills_workers_and_counts_what_the_clients_read(capsys) -> None:
    faults.main(["--seconds", "16", "--kill-every", "4", "--clients", "2", "--max-tokens", "80", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["kills"] >= 1 and result["answers"] > result["kills"]
    # Streams move when their worker dies: nothing lost, nothing twice, no error event.
    assert (result["errors"], result["lost"], result["duplicated"], result["mismatched"]) == (0, 0, 0, 0), result


def test_lost_and_duplicated_compare_with_the_uninterrupted_answer() -> None:
    assert faults.lost_and_duplicated("abcdef", "abcdef") == (0, 0)
    assert faults.lost_and_duplicated("abc", "abcdef") == (3, 0)
    assert faults.lost_and_duplicated("abccdef", "abcdef") == (3, 4)  # a repeat shifts the rest
