"""SQLite's part of the store: the private database file, its pragmas, and one writer at a time.

* **Private file.** The database holds replica API keys. Its directory is made 0700 when new and
  the file 0600 before SQLite opens it; SQLite creates ``-wal`` and ``-shm`` with the database
  file's permissions, so all three are kept from other local users, and files left looser by an
  older version are narrowed (they were 0644 under the default umask).
* **Pragmas.** WAL (readers never wait for the writer), a 5 s busy timeout (a second process, such
  as ``server init`` reading, waits instead of failing), ``synchronous=NORMAL`` (safe in WAL).
* **One writer at a time, in process.** SQLite lets one transaction write; a second one waits in
  SQLite's busy handler, which *sleeps* 1, 2, 5, 10 … 100 ms between tries, so writers on several
  threads (heartbeats, a leader pass) made heartbeats wait hundreds of milliseconds behind a pass
  that wrote 50 explanations (p99 518 ms). Write transactions therefore take a
  ``threading.Lock`` first (:meth:`SqliteHooks.writer`), which hands over at once. Reads take no
  lock (WAL).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from llmgw.control.store.dialect import DialectHooks


class SqliteHooks(DialectHooks):
    """SQLite's hooks: a private file, WAL pragmas, and an in-process writer lock (one per store)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def prepare(self, url: sa.URL) -> None:
        """Make the file private before SQLite opens it (not for ``:memory:``)."""
        if url.database not in (None, "", ":memory:"):
            private_file(Path(url.database))

    def configure(self, engine: Engine) -> None:
        """Set the pragmas on every new connection."""
        sa.event.listen(engine, "connect", _pragmas)

    def writer(self) -> contextlib.AbstractContextManager[object]:
        """The store's writer lock (see the module docstring)."""
        return self._lock


def private_file(db: Path) -> None:
    """Make ``db``'s directory (0700 when new) and the file itself 0600 before SQLite opens it,
    and narrow a looser ``-wal``/``-shm`` left by an older version. Raises OSError."""
    db.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(os.open(db, os.O_RDWR | os.O_CREAT, 0o600))
    for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_mode & 0o077:
                path.chmod(0o600)


def _pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=5000")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()
