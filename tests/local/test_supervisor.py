"""The local supervisor's restart backoff (issue 13, item 8): it doubles while a replica keeps
crashing and starts again from the base once the replica has served for a healthy period."""

from __future__ import annotations

from pathlib import Path

from inferplane.api.deployment import InferenceDeploymentSpec
from inferplane.api.resolve import resolve
from inferplane.local.supervisor import LocalDeployment, Replica, Supervisor


def test_backoff_doubles_while_crashing_and_resets_after_a_healthy_period(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, restart_backoff=2.0, healthy_reset=60.0)
    replica = Replica(0, 1, 2, tmp_path / "r.log")
    # Crashes before ever serving, or soon after: 2, 4, 8, 16, 32, then capped at 60.
    delays = [supervisor.restart_delay(replica, served_for) for served_for in (None, 1.0, None, 5.0, None, None, None)]
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    # It then served for ten minutes: the next crash is forgiven its history.
    assert supervisor.restart_delay(replica, 600.0) == 2.0
    assert supervisor.restart_delay(replica, None) == 4.0


def test_inferplane_up_keeps_a_deployments_kv_disk_tier_in_its_home(tmp_path: Path) -> None:
    spec = InferenceDeploymentSpec.from_dict({"model": {"name": "smollm2-135m"}, "runtime": "cpu-int8",
                                              "engine": {"kvOffloadDisk": "1GiB"}})
    deployment = LocalDeployment("chat", spec, resolve(spec), "smollm2-135m")
    command, _ = Supervisor(tmp_path).command(deployment, Replica(0, 1234, 1235, tmp_path / "r.log"))
    # One folder per deployment: a replica started later finds what earlier ones left.
    assert command[command.index("--kv-offload-dir") + 1] == str(tmp_path / "kv" / "chat")
    assert command[command.index("--kv-offload-disk") + 1] == "1GiB"
