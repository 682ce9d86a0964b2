"""What `inferplane up` runs, in one file of its home (`run.json`): for `inferplane status`, and so
that a supervisor killed without a chance to clean up (SIGKILL) has its workers ended by the next.

Workers are also tied to their supervisor while it lives: they get SIGTERM when it dies
(`PR_SET_PDEATHSIG` on Linux), and `inferplane up` handles SIGHUP like Ctrl-C. The file is the last
line of defence: on start, every worker it lists that still runs *and* carries this home in its
environment (`INFERPLANE_SUPERVISOR_HOME`, so a recycled PID of another program is never touched) is
stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

FILE_NAME = "run.json"
HOME_ENV = "INFERPLANE_SUPERVISOR_HOME"
_PR_SET_PDEATHSIG = 1


PARENT_ENV = "INFERPLANE_DIE_WITH_PARENT"  # set by the supervisor to its pid for the children it starts


def die_with_parent() -> None:
    """This process gets SIGTERM when the process that started it dies (Linux).

    Called by the child itself as it starts (cli.main, when PARENT_ENV names its parent), not as a
    `preexec_fn`: that runs Python between fork and exec in a copy of a threaded supervisor, where
    at-fork hooks (filelock's) crashed the child now and then. The parent may have died before
    the call; then the child ends at once rather than outlive it."""
    expected = os.environ.pop(PARENT_ENV, None)
    if expected is None or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if str(os.getppid()) != expected:
        os.kill(os.getpid(), signal.SIGTERM)


def write(home: Path, state: dict[str, Any]) -> None:
    """Atomically (a reader never sees half a file)."""
    path = home / FILE_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)


def read(home: Path) -> dict[str, Any] | None:
    try:
        return json.loads((home / FILE_NAME).read_text())
    except (OSError, ValueError):
        return None


def remove(home: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (home / FILE_NAME).unlink()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _belongs_to(pid: int, home: Path) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{HOME_ENV}={home}".encode() in environ


def end_leftovers(home: Path, grace: float = 10.0) -> list[int]:
    """Stops the workers a dead supervisor of this home left running; returns their PIDs."""
    state = read(home)
    if not state or (state.get("supervisor_pid") and alive(state["supervisor_pid"])
                     and state["supervisor_pid"] != os.getpid()):
        return []  # nothing recorded, or its supervisor still runs: not ours to stop
    pids = [r["pid"] for d in state.get("deployments", []) for r in d.get("replicas", [])
            if r.get("pid") and alive(r["pid"]) and _belongs_to(r["pid"], home)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    remove(home)
    return pids
