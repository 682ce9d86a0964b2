"""What a fetch can fail with, in one module that the fetcher and its sources share."""

from __future__ import annotations


class FetchError(Exception):
    """The weights could not be fetched (network, server status, missing object). The message is one
    line naming the URI: the CLI writes it to the pod's termination log as is."""


class DigestMismatch(FetchError):
    """The fetched bytes are not the ones the registry recorded; the download was deleted."""

    def __init__(self, uri: str, expected: str, actual: str) -> None:
        super().__init__(f"digest mismatch for {uri}: expected sha256 {expected}, got {actual}")
        self.uri, self.expected, self.actual = uri, expected, actual
