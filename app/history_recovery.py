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


def database_problem(conn: sqlite3.Connection, path: Path, schema_version: int) -> str | None:
    """Why the file is not a usable history database (see the module doc), or None; read before anything
    is written. ``schema_version``: the newest schema this build writes.

    Raises:
        sqlite3.OperationalError: the file is locked by another program.
    """
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        problems = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
    except sqlite3.DatabaseError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            raise
        return f"{path}: not a readable SQLite database ({exc})"
    if problems != ["ok"]:
        return f"{path}: the database is damaged ({'; '.join(problems)[:300]})"
    user_tables = {t for t in tables if not t.startswith("sqlite_") and not t.startswith("messages_fts")}
    if version == 0 and user_tables:
        return (f"{path}: it holds another program's tables ({', '.join(sorted(user_tables))[:200]}), "
                "not a DeltaDesk history")
    if 0 < version <= schema_version and not _OURS <= tables:
        return f"{path}: its tables are not a DeltaDesk history (missing {', '.join(sorted(_OURS - tables))})"
    return None


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
