"""What the app does with a history file it cannot use: recognise it, and move it aside for a fresh one.

A file at the history path is damaged when it is not SQLite, when SQLite's ``quick_check`` finds damaged
pages (a first page intact but later pages overwritten), or when it holds another program's tables (no
schema version of ours but tables of its own, or our version without our tables). Such a file is never
written to: :func:`set_aside` renames it (and its ``-wal`` / ``-shm`` files) to
``history.db.damaged-<time>`` beside it, and the app starts a new empty history and says where the old
file went. A file from a newer DeltaDesk is not damaged and is left alone.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

_OURS = {"conversations", "messages"}


def check_database(conn: sqlite3.Connection, path: Path) -> None:
    """Refuse a file that is not a usable history database (see the module doc), before anything is written.

    Raises:
        HistoryDamaged: naming the file and what is wrong.
        sqlite3.OperationalError: the file is locked by another program.
    """
    from .history import SCHEMA_VERSION, HistoryDamaged
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        problems = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
    except sqlite3.DatabaseError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            raise
        raise HistoryDamaged(f"{path}: not a readable SQLite database ({exc})") from exc
    if problems != ["ok"]:
        raise HistoryDamaged(f"{path}: the database is damaged ({'; '.join(problems)[:300]})")
    user_tables = {t for t in tables if not t.startswith("sqlite_") and not t.startswith("messages_fts")}
    if version == 0 and user_tables:
        raise HistoryDamaged(f"{path}: it holds another program's tables ({', '.join(sorted(user_tables))[:200]}), "
                             "not a DeltaDesk history")
    if 0 < version <= SCHEMA_VERSION and not _OURS <= tables:
        raise HistoryDamaged(f"{path}: its tables are not a DeltaDesk history (missing "
                             f"{', '.join(sorted(_OURS - tables))})")


def set_aside(path: str | Path) -> Path:
    """Rename the history file (and its ``-wal`` / ``-shm`` files) to ``<name>.damaged-<YYYYmmdd-HHMMSS>``.

    Returns:
        The new path of the database file.
    Raises:
        OSError: it could not be renamed.
    """
    path = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    os.replace(path, target)
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            os.replace(side, target.with_name(target.name + suffix))
    return target
