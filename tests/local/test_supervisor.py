"""The local supervisor's restart backoff (issue 13, item 8): it doubles while a replica keeps
crashing and starts again from the base once the replica has served for a healthy period."""

from __future__ import annotations

from pathlib import Path

from inferplane.local.supervisor import Replica, Supervisor


def test_backoff_doubles_while_crashing_and_resets_after_a_healthy_period(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, restart_backoff=2.0, healthy_reset=60.0)
    replica = Replica(0, 1, 2, tmp_path / "r.log")
    # Crashes before ever serving, or soon after: 2, 4, 8, 16, 32, then capped at 60.
    delays = [supervisor.restart_delay(replica, served_for) for served_for in (None, 1.0, None, 5.0, None, None, None)]
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    # It then served for ten minutes: the next crash is forgiven its history.
    assert supervisor.restart_delay(replica, 600.0) == 2.0
    assert supervisor.restart_delay(replica, None) == 4.0
