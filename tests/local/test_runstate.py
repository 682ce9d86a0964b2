"""A supervisor killed outright leaves run.json behind; the next start ends the workers it lists,
but only processes that carry this home in their environment (a recycled PID is left alone)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from inferplane.local import runstate


def sleeper(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env={**os.environ, **env})


def dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_a_restart_ends_the_workers_a_killed_supervisor_left(tmp_path: Path) -> None:
    ours = sleeper({runstate.HOME_ENV: str(tmp_path)})
    stranger = sleeper({})  # same kind of process, not of this home: a PID the OS gave to someone else
    other_home = sleeper({runstate.HOME_ENV: str(tmp_path / "elsewhere")})
    try:
        runstate.write(tmp_path, {"supervisor_pid": dead_pid(), "deployments": [{"replicas": [
            {"pid": ours.pid}, {"pid": stranger.pid}, {"pid": other_home.pid}]}]})
        assert runstate.end_leftovers(tmp_path) == [ours.pid]
        assert ours.wait(timeout=30) is not None
        assert stranger.poll() is None and other_home.poll() is None
        assert runstate.read(tmp_path) is None
    finally:
        for proc in (ours, stranger, other_home):
            proc.kill()
            proc.wait()


def test_a_live_supervisors_workers_are_not_touched(tmp_path: Path) -> None:
    supervisor = sleeper({})
    worker = sleeper({runstate.HOME_ENV: str(tmp_path)})
    try:
        runstate.write(tmp_path, {"supervisor_pid": supervisor.pid,
                                  "deployments": [{"replicas": [{"pid": worker.pid}]}]})
        assert runstate.end_leftovers(tmp_path) == []
        assert worker.poll() is None
    finally:
        for proc in (supervisor, worker):
            proc.kill()
            proc.wait()


def test_a_child_dies_with_its_parent(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: the grandchild, started as the supervisor starts workers (its parent's pid in
    PARENT_ENV, the child asking for the signal itself), gets SIGTERM when its parent is SIGKILLed."""
    pid_file = tmp_path / "child.pid"
    grandchild = ("import time; from inferplane.local.runstate import die_with_parent; "
                  "die_with_parent(); time.sleep(300)")
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time\n"
        "from inferplane.local.runstate import PARENT_ENV\n"
        f"child = subprocess.Popen([sys.executable, '-c', {grandchild!r}], "
        "env={**os.environ, PARENT_ENV: str(os.getpid())})\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)\n")])
    try:
        for _ in range(300):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.1)
        child = int(pid_file.read_text())
        parent.kill()
        parent.wait()
        for _ in range(300):
            if not runstate.alive(child):
                break
            time.sleep(0.1)
        assert not runstate.alive(child)
    finally:
        parent.kill()
