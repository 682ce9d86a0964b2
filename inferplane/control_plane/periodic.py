"""A daemon thread that repeats one piece of background work (cache refreshes, usage flushes).

The key cache, the quota tracker and the usage recorder all keep the request path off the
database by doing their I/O here; one failure is logged and the work is simply tried again on
the next tick, so a database outage degrades to stale data instead of failed requests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class PeriodicThread:
    def __init__(self, name: str, interval: Callable[[], float], work: Callable[[], object], on_error: str):
        self._name = name
        self._interval = interval  # read every tick, so a changed setting takes effect at once
        self._work = work
        self._on_error = on_error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # What the gateway's metrics report (database up, usage flush lag): unix time of the last
        # run that did not raise, and whether the latest run raised.
        self.last_success: float | None = None
        self.failing = False

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self._interval()):
            self.run_once()

    def run_once(self) -> None:
        try:
            self._work()
        except Exception:
            self.failing = True
            log.exception(self._on_error)
        else:
            self.failing = False
            self.last_success = time.time()
