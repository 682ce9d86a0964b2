"""Issue 20: `inferplane up` as a newcomer meets it.

The banner's commands are pasted into a shell as printed (first start: the key it shows; restart:
a new key from the `keys create` it prints) and answer; `inferplane status` shows what runs; a
hang-up (SIGHUP) and a SIGKILL of `inferplane up` leave no worker running.

The guide's quickstarts are walked here too, on the same platform: the README's and
docs/getting-started/local.md's blocks marked `<!-- walked -->` run as written, with only what a
reader's machine has and this test's does not replaced (the key the banner printed, the port, the
home folder, and the served model's name: the tiny model stands in for SmolLM2, which costs a
cpu-int8 start); the page's banner example matches the real banner line by line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from inferplane.bench.tiny_model import make_tiny_model
from inferplane.local import runstate
from tests.docs.walked import LOCAL_PAGE, README, as_shell_script, fenced_block_after, walked_blocks
from tests.worker.test_worker_process import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


class Up:
    def __init__(self, manifest: Path, home: Path, *, command: tuple[str, ...] = ()):
        """`inferplane up MANIFEST`, or `command` (e.g. ("serve", MODEL)) with the same flags."""
        self.home, self.port = home, free_port()
        argv = command or ("up", str(manifest))
        self.proc = subprocess.Popen([sys.executable, "-m", "inferplane.cli", *argv, "--home", str(home),
                                      "--port", str(self.port), "--grpc-port", "0"], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
        self.lines: list[str] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError("inferplane up exited:\n" + "".join(self.lines))
            self.lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    @property
    def key(self) -> str:
        """The API key the first start's banner shows (once)."""
        shown = [line.rsplit(": ", 1)[1].strip() for line in self.lines if "API key (shown once" in line]
        assert shown, "inferplane up did not print a key:\n" + "".join(self.lines)
        return shown[0]

    def stop(self, timeout: float = 120) -> int:
        """Ctrl-C, as a user stops it; the exit status."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=timeout)

    def try_it(self) -> str:
        """The banner's commands under "try it:", as a shell script."""
        start = self.lines.index("try it:\n") + 1
        block = []
        for line in self.lines[start:]:
            if not line.strip():
                break
            block.append(line.removeprefix("  "))
        return "set -e\n" + "".join(block)

    def worker_pids(self) -> list[int]:
        state = runstate.read(self.home)
        assert state is not None, "no run.json"
        return [r["pid"] for d in state["deployments"] for r in d["replicas"]]


def gone(pids: list[int], timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(runstate.alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    model = make_tiny_model(tmp_path / "tiny")
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "tiny"},
        "spec": {"model": {"uri": model, "format": "safetensors"}, "runtime": "paged",
                 "resources": {"cpu": "1", "memory": "2Gi"}, "engine": {"kvCacheMemory": "64Mi", "maxModelLen": 256}}}))
    return path


def shell(script: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "INFERPLANE_API_KEY"}
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def walk_the_guide(up: Up) -> None:
    """The README's and the local getting-started page's walked blocks, run as written against `up`."""
    script = as_shell_script(walked_blocks(README) + walked_blocks(LOCAL_PAGE), {
        "ip_...": up.key, "127.0.0.1:8080": f"127.0.0.1:{up.port}", "~/.inferplane": str(up.home),
        '"smollm2-135m"': '"tiny"'})
    env = {k: v for k, v in os.environ.items() if k != "INFERPLANE_API_KEY"}
    env.update(INFERPLANE_HOME=str(up.home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    walked = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert walked.returncode == 0, (script, walked.stdout, walked.stderr)
    out = walked.stdout
    assert out.count('"object":"chat.completion"') == 2, out  # the README's curl and the page's
    assert '"id":"tiny"' in out, out  # GET /v1/models
    assert "serving" in out and '"id":"default"' in out, out  # inferplane status; the admin API's tenants


def _any_interpreter(line: str) -> str:
    """The line with a leading Python interpreter's path as one word: the banner names the one it
    runs under (.venv/bin/python under `make up`, an absolute path from elsewhere)."""
    return re.sub(r"^(\s*)\S*python3?(?= )", r"\1PYTHON", line)


def banner_matches_the_page(up: Up) -> None:
    """Each line of the page's banner example begins as a line of the real banner does, up to the
    first thing that differs by machine (a path, a port, the key, the interpreter's path) or that the
    page elides ("...")."""
    real = [_any_interpreter(line.rstrip("\n")) for line in up.lines]
    for line in fenced_block_after(LOCAL_PAGE, "## The banner").splitlines():
        if line.startswith("gRPC tenant API"):
            continue  # printed only with the gRPC API on, and Up runs with --grpc-port 0
        prefix = re.split(r"[/0-9]|ip_|\.\.\.", _any_interpreter(line), maxsplit=1)[0]  # "...": elided
        assert any(r.startswith(prefix) for r in real), f"the page's {line!r} is not in the banner:\n" + "\n".join(real)


def test_the_banner_works_when_pasted_and_nothing_outlives_inferplane_up(manifest: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    up = Up(manifest, home)
    try:
        pasted = shell(up.try_it())
        assert pasted.returncode == 0 and '"choices"' in pasted.stdout, (up.try_it(), pasted.stdout, pasted.stderr)
        banner_matches_the_page(up)
        walk_the_guide(up)
        status = subprocess.run([sys.executable, "-m", "inferplane.cli", "status", "--home", str(home)],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "serving" in status.stdout and "metrics" in status.stdout, status.stdout
        workers = up.worker_pids()
        up.proc.send_signal(signal.SIGHUP)  # the terminal was closed
        assert up.proc.wait(timeout=120) == 0
        assert gone(workers), f"workers {workers} outlived a hang-up"
    finally:
        up.proc.kill()

    again = Up(manifest, home)  # the key is not shown twice: the banner makes a new one
    try:
        assert "export INFERPLANE_API_KEY=$(curl" in again.try_it()
        pasted = shell(again.try_it())
        assert pasted.returncode == 0 and '"choices"' in pasted.stdout, (again.try_it(), pasted.stderr)
        workers = again.worker_pids()
        again.proc.kill()  # SIGKILL: no handler runs; the workers get SIGTERM from the kernel
        again.proc.wait()
        assert gone(workers), f"workers {workers} outlived a SIGKILL of their supervisor"
    finally:
        again.proc.kill()
