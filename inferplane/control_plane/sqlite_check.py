"""Checks a SQLite database file before the control plane uses it, so damage stops the start with
one line naming the file and what to do, instead of a silent loss or a long traceback.

Two kinds of damage are found. In the database file, `PRAGMA quick_check` finds damaged pages and
an unreadable header ("file is not a database"). In the write-ahead log (`<db>-wal`, where the
last transactions live until a checkpoint copies them into the file, and where a `kill -9` leaves
them), SQLite itself stops reading at the first frame whose checksum or salt is wrong and forgets
the rest without a word: a damaged frame in the middle silently drops every transaction committed
after it. So the log is read here as SQLite reads it (https://sqlite.org/fileformat2.html#walformat:
a 32-byte header, frames of a 24-byte header and a page, cumulative checksums), and if a frame
SQLite would drop holds a commit of the log's current generation, the start is refused. A torn
last transaction (a crash mid-write) is no damage: it was never committed.

Both checks only read: the database is opened read-only (a read-write connection would checkpoint
and delete the log on close, erasing what the refusal is about). Another process may be using the
database meanwhile (the CLI while `inferplane up` runs): a log that changed under the reading is
read again.
"""

from __future__ import annotations

import sqlite3
import struct
from pathlib import Path

import numpy as np

_WAL_MAGIC = (0x377F0682, 0x377F0683)  # checksums of little-endian / big-endian words
_WAL_VERSION = 3007000
_WAL_HEADER = struct.Struct(">8I")  # magic, version, page size, checkpoint seq, salt-1, salt-2, checksum-1, -2
_FRAME_HEADER = struct.Struct(">6I")  # page number, commit size (0: not a commit), salt-1, salt-2, checksum-1, -2
_MASK = (1 << 32) - 1


class DatabaseUnusable(RuntimeError):
    """The database file cannot be used as it is; the message is one line naming it and what to do."""


def check_sqlite_file(path: str | Path) -> None:
    """Raises DatabaseUnusable if the SQLite database at `path` (if it exists) is damaged."""
    path = Path(path)
    if not path.exists():
        return
    wal = Path(f"{path}-wal")
    for _ in range(3):  # a log rewritten while it was read (another process checkpointed) is read again
        before = _wal_header(wal)
        problem = _wal_problem(wal, _page_size(path))
        if _wal_header(wal) == before:
            break
    if problem:
        raise DatabaseUnusable(
            f"database {path}: {problem}; starting would lose them without a word. Stop every inferplane "
            f"process using it, then restore {path} and {wal.name} from a backup, or accept the loss and keep "
            f"what precedes the damage with: sqlite3 {path} 'PRAGMA wal_checkpoint(TRUNCATE)'")
    _quick_check(path)


def _wal_header(wal: Path) -> bytes:
    try:
        with wal.open("rb") as f:
            return f.read(32)
    except OSError:
        return b""


def _quick_check(path: Path) -> None:
    salvage = f"restore it from a backup, or salvage what is readable with: sqlite3 {path} .recover | sqlite3 NEW.db"
    try:
        connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            rows = [row[0] for row in connection.execute("PRAGMA quick_check(3)")]
        finally:
            connection.close()
    except sqlite3.DatabaseError as exc:
        raise DatabaseUnusable(f"database {path} cannot be read as SQLite ({exc}): {salvage}") from None
    if rows != ["ok"]:
        raise DatabaseUnusable(f"database {path} is damaged (PRAGMA quick_check: {'; '.join(rows)}): {salvage}")


def _checksum(data: np.ndarray, big_endian: bool, s0: int, s1: int) -> tuple[int, int]:
    """SQLite's WAL checksum of `data` (uint8, a multiple of 8 bytes) continuing from (s0, s1).

    SQLite's loop, over 32-bit words x: s0 += x[i] + s1; s1 += x[i+1] + s0. One step is the
    matrix M = [[1, 1], [1, 2]] applied to (s0, s1) plus (a, a + b) for the pair (a, b), so n steps
    are M^n (s0, s1) + sum_k M^(n-k) (a_k, a_k + b_k): one vectorised sum, in uint64 arithmetic
    that wraps modulo 2^64 and so stays right modulo 2^32."""
    words = data.view(">u4" if big_endian else "<u4").astype(np.uint64).reshape(-1, 2)
    a, ab = words[:, 0], words[:, 0] + words[:, 1]
    powers = _powers(len(words))[::-1]  # M^(n-k) for k = 1..n
    c0 = int((powers[:, 0, 0] * a + powers[:, 0, 1] * ab).sum()) & _MASK
    c1 = int((powers[:, 1, 0] * a + powers[:, 1, 1] * ab).sum()) & _MASK
    m = _powers(len(words) + 1)[-1]  # M^n
    return (int(m[0, 0]) * s0 + int(m[0, 1]) * s1 + c0) & _MASK, (int(m[1, 0]) * s0 + int(m[1, 1]) * s1 + c1) & _MASK


_POWERS: dict[int, np.ndarray] = {}


def _powers(n: int) -> np.ndarray:
    """M^0 .. M^(n-1) modulo 2^32, as uint64 (n, 2, 2)."""
    if n not in _POWERS:
        out = np.empty((n, 2, 2), dtype=np.uint64)
        m = [[1, 0], [0, 1]]
        for i in range(n):
            out[i] = m
            m = [[(m[0][0] + m[1][0]) & _MASK, (m[0][1] + m[1][1]) & _MASK],
                 [(m[0][0] + 2 * m[1][0]) & _MASK, (m[0][1] + 2 * m[1][1]) & _MASK]]
        _POWERS[n] = out
    return _POWERS[n]


_PAGE_SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def _page_size(path: Path) -> int | None:
    """The page size the database file's header gives (bytes 16-17; 1 means 65536), if it is one."""
    try:
        with path.open("rb") as f:
            header = f.read(100)
    except OSError:
        return None
    if len(header) < 18:
        return None
    size = int.from_bytes(header[16:18], "big")
    size = 65536 if size == 1 else size
    return size if size in _PAGE_SIZES else None


def _wal_problem(wal: Path, db_page_size: int | None) -> str | None:
    """What committed transactions SQLite would drop from the log at `wal` (of a database whose
    pages are `db_page_size` long, when its header says), or None."""
    try:
        data = np.fromfile(wal, dtype=np.uint8)
    except (FileNotFoundError, ValueError):
        return None
    if len(data) < _WAL_HEADER.size + _FRAME_HEADER.size:
        return None  # empty, or a header alone: no transaction in it
    magic, version, page_size, _, salt1, salt2, check1, check2 = _WAL_HEADER.unpack(data[:32].tobytes())
    big_endian = magic & 1 == 1
    if not (magic in _WAL_MAGIC and version == _WAL_VERSION and page_size in _PAGE_SIZES
            and _checksum(data[:24], big_endian, 0, 0) == (check1, check2)):
        # SQLite ignores the whole log. Does it hold commits (frames agreeing on one salt)? The
        # frames are as long as the database's pages, which its own header says best.
        size = db_page_size or (page_size if page_size in _PAGE_SIZES else None)
        commits = 0 if size is None else _commits(data, 32, size + _FRAME_HEADER.size, None)
        if commits:
            return (f"the header of its write-ahead log {wal.name} is damaged, so SQLite would ignore the log: "
                    f"of the {commits} transaction(s) committed in it, those not yet copied into the database")
        return None
    frame_size = _FRAME_HEADER.size + page_size
    s0, s1 = check1, check2
    for index in range((len(data) - 32) // frame_size):
        at = 32 + index * frame_size
        page, _, f_salt1, f_salt2, f_check1, f_check2 = _FRAME_HEADER.unpack(data[at:at + 24].tobytes())
        if (f_salt1, f_salt2) == (salt1, salt2) and page != 0:
            s0, s1 = _checksum(data[at:at + 8], big_endian, s0, s1)
            s0, s1 = _checksum(data[at + 24:at + frame_size], big_endian, s0, s1)
            if (s0, s1) == (f_check1, f_check2):
                continue
        # SQLite's log ends here. Commits of this generation after this frame were acknowledged to
        # their writers and would be lost (this frame itself may be a crash's torn last write).
        commits = _commits(data, at + frame_size, frame_size, (salt1, salt2))
        if commits:
            return (f"its write-ahead log {wal.name} is damaged at frame {index + 1} (byte {at}), and the "
                    f"{commits} transaction(s) committed after it would be dropped")
        return None
    return None


def _commits(data: np.ndarray, start: int, frame_size: int, salts: tuple[int, int] | None) -> int:
    """Whole frames from byte `start` on that end a transaction (commit size > 0) and carry `salts`
    (None: the salts most such frames carry, the log's generation when its header is unreadable)."""
    found: dict[tuple[int, int], int] = {}
    for at in range(start, len(data) - frame_size + 1, frame_size):
        page, commit, salt1, salt2, _, _ = _FRAME_HEADER.unpack(data[at:at + 24].tobytes())
        if page and commit:
            found[(salt1, salt2)] = found.get((salt1, salt2), 0) + 1
    if salts is None:
        return max(found.values(), default=0)
    return found.get(salts, 0)
