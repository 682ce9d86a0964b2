"""A steady client for the cluster tests: requests one after another (streamed and not) from a
thread, every answer checked, every failure kept with what it said. Bounded in count and time."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Traffic:
    """Sends chat completions to `model` until stopped; `failures` says what went wrong, if anything."""

    base_url: str
    key: str
    model: str
    max_requests: int = 20_000
    max_seconds: float = 3600.0
    succeeded: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, name=f"traffic {self.model}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=600)

    @property
    def total(self) -> int:
        return self.succeeded + len(self.failures)

    def wait_for_successes(self, count: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        start = self.succeeded
        while self.succeeded < start + count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} answers did not come in {timeout:.0f}s: {self.failures[-5:]}")
            time.sleep(0.2)

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.base_url, headers=headers, timeout=300) as client:
            n = 0
            while not self._stop.is_set() and n < self.max_requests and time.monotonic() < deadline:
                stream = n % 2 == 1
                try:
                    problem = self._one(client, stream)
                except httpx.HTTPError as error:
                    problem = f"{type(error).__name__}: {error}"
                if problem is None:
                    self.succeeded += 1
                else:
                    self.failures.append(f"request {n} ({'stream' if stream else 'plain'}): {problem}")
                n += 1
                time.sleep(0.05)

    def _one(self, client: httpx.Client, stream: bool) -> str | None:
        body = {"model": self.model, "max_tokens": 6, "temperature": 0, "stream": stream,
                "messages": [{"role": "user", "content": "Count to three."}]}
        if not stream:
            reply = client.post("/v1/chat/completions", json=body)
            if reply.status_code != 200:
                return f"HTTP {reply.status_code}: {reply.text[:300]}"
            content = reply.json()["choices"][0]["message"]["content"]
            return None if content else f"empty answer: {reply.text[:300]}"
        text, finished = "", False
        with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                return f"HTTP {reply.status_code}: {reply.read().decode(errors='replace')[:300]}"
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    finished = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return f"error in the stream: {chunk['error']}"
                for choice in chunk.get("choices", []):
                    text += (choice.get("delta") or {}).get("content") or ""
        if not finished:
            return f"the stream ended without [DONE] after {text!r}"
        return None if text else "an empty stream"
