"""The ledger's errors: each message names the file and says what to do."""

from __future__ import annotations

import sqlite3

__all__ = ["LedgerBusy", "LedgerConflict", "LedgerError", "is_busy"]


class LedgerError(RuntimeError):
    """The ledger cannot be used; the message names the file and says what to do."""


class LedgerBusy(LedgerError):
    """Another process held the ledger's write lock for longer than the busy timeout."""


class LedgerWouldBlock(LedgerError):
    """A transaction asked not to wait found the write lock taken (by a thread or a process)."""


class LedgerConflict(LedgerError):
    """A lease was written from a stale read: someone else changed it in between."""



def is_busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED
    return "locked" in str(exc) or "busy" in str(exc)
