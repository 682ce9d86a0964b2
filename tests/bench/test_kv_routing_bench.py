"""`inferplane bench kv-routing` runs the real router and KV managers end to end and reports every policy."""

from __future__ import annotations

import json

from inferplane.bench import kv_routing


def test_the_bench_reports_each_policy_beside_one_replica(capsys) -> None:
    kv_routing.main(["--conversations", "12", "--turns", "4", "--blocks", "96", "--user-tokens", "40",
                     "--answer-tokens", "30", "--system-tokens", "64", "--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["workload"] for line in lines] == ["no shared prefix", "a 64-token shared system prompt"]
    for line in lines:
        rows = {name: line[name] for name in ("single replica (all blocks)", *kv_routing.POLICIES)}
        assert all(0 <= row["hit_rate"] <= 1 and row["uncached_p50"] <= row["uncached_p99"] for row in rows.values())
        # Where the conversation's history is matters: routing by it beats routing by load alone.
        assert rows["kv-aware"]["hit_rate"] > rows["least-loaded"]["hit_rate"]
