"""Chat history: conversations and their message trees in one SQLite file, images beside it.

WAL mode, foreign keys on; messages form a tree per conversation (``parent_id``) and ``leaf_id`` marks
the active branch. :data:`MIGRATIONS` moves SQLite's ``user_version`` one step at a time after a
``<name>.v<N>.bak`` copy. Search uses FTS5 when present, else LIKE. A :class:`HistoryStore` is used
from one thread (:class:`app.history_thread.HistoryThread`). Design: docs/design/chat-history.md.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from .history_recovery import database_problem

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: conversations and the message tree.
    (
        """CREATE TABLE conversations (
               id INTEGER PRIMARY KEY,
               title TEXT NOT NULL,
               created REAL NOT NULL,
               updated REAL NOT NULL,
               leaf_id INTEGER REFERENCES messages(id) ON DELETE SET NULL)""",
        """CREATE TABLE messages (
               id INTEGER PRIMARY KEY,
               conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
               parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
               role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
               content TEXT NOT NULL DEFAULT '',
               created REAL NOT NULL)""",
        "CREATE INDEX messages_by_parent ON messages(conversation_id, parent_id)",
    ),
    # 2: image paths, per-message stats, streaming state, and soft delete (for undo).
    (
        "ALTER TABLE messages ADD COLUMN images TEXT NOT NULL DEFAULT '[]'",
        "ALTER TABLE messages ADD COLUMN stats TEXT NOT NULL DEFAULT '{}'",
        "ALTER TABLE messages ADD COLUMN state TEXT NOT NULL DEFAULT 'complete'",
        "ALTER TABLE conversations ADD COLUMN deleted REAL",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)
EXPORT_FORMAT = "deltadesk-conversation"

FTS_TABLE = ("CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts"
             " USING fts5(content, content='messages', content_rowid='id')")
FTS_TRIGGERS = {
    "messages_fts_insert": """CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
        INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END""",
    "messages_fts_delete": """CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content); END""",
    "messages_fts_update": """CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
        INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END""",
}


class HistoryError(Exception):
    """The history database cannot be opened or is newer than this program."""


class HistoryDamaged(HistoryError):
    """The file at the history path is not a usable history database: not SQLite, damaged pages (its
    integrity check fails), or another program's tables. :func:`app.history_recovery.set_aside` moves it."""


class HistoryLocked(HistoryError):
    """Another process held the database's write lock for longer than the store waits (``lock_wait_s``)."""


@dataclass(frozen=True)
class Conversation:
    """One row of the conversation list."""

    id: int
    title: str
    created: float
    updated: float


@dataclass(frozen=True)
class Message:
    """One stored message.

    Attributes:
        content: the raw text; an assistant's may start with its thinking, closed by ``</think>``.
        images: paths of the attached images (files in the :class:`ImageStore`).
        stats: numbers of the turn that produced an assistant message (ttft_ms, decode_tok_s, ...).
        state: "complete", "streaming" (being written, or interrupted by a crash), "stopped", "error".
    """

    id: int
    conversation_id: int
    parent_id: int | None
    role: str
    content: str
    created: float
    images: tuple[str, ...] = ()
    stats: dict[str, Any] = field(default_factory=dict)
    state: str = "complete"


@dataclass(frozen=True)
class Branch:
    """A conversation's active branch as the chat view shows it.

    Attributes:
        conversation_id: the conversation.
        path: the messages from the root to the active leaf.
        siblings: for each message on the path, the ids of the versions sharing its parent, oldest first.
    """

    conversation_id: int
    path: list[Message]
    siblings: dict[int, list[int]]


@dataclass(frozen=True)
class TurnStart:
    """A new, empty, streaming answer and the branch that ends with it."""

    answer_id: int
    branch: Branch


def _backup(conn: sqlite3.Connection, path: Path, version: int) -> Path:
    target = path.with_name(f"{path.name}.v{version}.bak")
    dest = sqlite3.connect(target)
    try:
        conn.backup(dest)
    finally:
        dest.close()
    return target


def migrate(conn: sqlite3.Connection, path: Path) -> list[Path]:
    """Bring the schema of ``conn`` (the file ``path``) up to :data:`SCHEMA_VERSION`.

    Returns:
        The backup files written (none for a new, empty database).

    Raises:
        HistoryError: the file was written by a newer DeltaDesk.
    """
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise HistoryError(f"{path}: history schema version {version} is newer than this DeltaDesk "
                           f"understands ({SCHEMA_VERSION}); update DeltaDesk")
    backups = []
    for number in range(version + 1, SCHEMA_VERSION + 1):
        if version > 0:
            backups.append(_backup(conn, path, number - 1))
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in MIGRATIONS[number - 1]:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {number}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return backups


def ensure_search_index(conn: sqlite3.Connection) -> bool:
    """Create and fill the FTS5 message index if it is missing; returns whether FTS5 can be used.

    Without FTS5 the index's triggers are dropped, so writes keep working and a later FTS5-capable
    open rebuilds the index from the messages.
    """
    try:
        conn.execute("CREATE VIRTUAL TABLE temp.fts5_probe USING fts5(x)")
        conn.execute("DROP TABLE temp.fts5_probe")
    except sqlite3.OperationalError:
        for name in FTS_TRIGGERS:
            conn.execute(f"DROP TRIGGER IF EXISTS {name}")
        return False
    present = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'trigger')")}
    if {"messages_fts", *FTS_TRIGGERS} <= present:
        return True
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(FTS_TABLE)
        for name, sql in FTS_TRIGGERS.items():
            if name not in present:
                conn.execute(sql)
        conn.execute("INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return True


def _is_locked(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` is SQLite's "database is locked" / "busy" (another connection holds a lock)."""
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


def fts_query(text: str) -> str:
    """A user's search text as an FTS5 query: every word, as a prefix (``"pear"* "tart"*``)."""
    return " ".join('"' + word.replace('"', '""') + '"*' for word in re.findall(r"\w+", text))


_MESSAGE_COLUMNS = "id, conversation_id, parent_id, role, content, created, images, stats, state"


def _message(row: tuple) -> Message:
    return Message(id=row[0], conversation_id=row[1], parent_id=row[2], role=row[3], content=row[4],
                   created=row[5], images=tuple(json.loads(row[6])), stats=json.loads(row[7]),
                   state=row[8])


class HistoryStore:
    """Owns the history database; every method is one short transaction.

    Build it with :meth:`open`, on the thread that will use it (SQLite connections stay on the
    thread that made them): :class:`app.history_thread.HistoryThread` does.

    Attributes:
        full_text: searches use the FTS5 index (else a LIKE scan).
    """

    lock_wait_s = 30.0
    """How long a write waits for a lock another process holds, with backoff, before :class:`HistoryLocked`."""

    def __init__(self, conn: sqlite3.Connection, path: Path, full_text: bool = False) -> None:
        self._conn = conn
        self.path = path
        self.full_text = full_text

    @classmethod
    def open(cls, path: str | Path, full_text: bool = True) -> "HistoryStore":
        """Open (creating or migrating) the database at ``path`` and drop conversations left deleted.

        ``full_text=False`` searches with LIKE even where SQLite has FTS5.

        Raises:
            HistoryDamaged: the file is not SQLite, its integrity check fails (damaged pages), or it holds
                another program's tables (:func:`app.history_recovery.database_problem`).
            HistoryError: the file is from a newer DeltaDesk, or cannot be read or written.
        """
        path = Path(path)
        conn = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(path, isolation_level=None)
            conn.execute("PRAGMA busy_timeout = 1000")
            problem = database_problem(conn, path, SCHEMA_VERSION)
            if problem is not None:
                raise HistoryDamaged(problem)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            migrate(conn, path)
            has_fts = ensure_search_index(conn)
            store = cls(conn, path, full_text and has_fts)
            store.purge_deleted()
        except (sqlite3.DatabaseError, OSError, HistoryError) as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, HistoryError):
                raise
            damaged = isinstance(exc, sqlite3.DatabaseError) and ("not a database" in str(exc)
                                                                  or "malformed" in str(exc))
            kind = HistoryDamaged if damaged else HistoryError
            raise kind(f"{path}: cannot open the history database: {exc}") from exc
        return store

    def close(self) -> None:
        """Checkpoint the write-ahead log and close the file."""
        self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._conn.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._begin()
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def _begin(self) -> None:
        """``BEGIN IMMEDIATE`` (take the write lock), retried with backoff (50 ms doubling to 1 s) while
        another process holds it, for up to :attr:`lock_wait_s`.

        Raises:
            HistoryLocked: still locked after that.
        """
        deadline = time.monotonic() + self.lock_wait_s
        pause = 0.05
        while True:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if not _is_locked(exc):
                    raise
                if time.monotonic() + pause > deadline:
                    raise HistoryLocked(f"{self.path}: the chat history is locked by another program (waited "
                                        f"{self.lock_wait_s:g} s)") from exc
            time.sleep(pause)
            pause = min(2 * pause, 1.0)

    def _write(self, sql: str, params: Iterable[Any] = ()) -> sqlite3.Cursor:
        with self._transaction() as conn:
            return conn.execute(sql, tuple(params))

    # conversations

    def create_conversation(self, title: str = "New chat") -> int:
        """Add an empty conversation; returns its id."""
        now = time.time()
        return self._write("INSERT INTO conversations (title, created, updated) VALUES (?, ?, ?)",
                           (title, now, now)).lastrowid

    def conversations(self, query: str = "") -> list[Conversation]:
        """Live conversations, most recently updated first.

        ``query`` (case-insensitive) keeps those whose title contains it or, with FTS5, that have a
        message holding each of its words (as word prefixes); without FTS5, a message containing it.
        """
        sql = "SELECT id, title, created, updated FROM conversations c WHERE deleted IS NULL"
        params: tuple = ()
        if query:
            pattern = "%" + query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            match = fts_query(query) if self.full_text else ""
            if match:
                sql += (" AND (title LIKE ? ESCAPE '\\' OR id IN (SELECT m.conversation_id FROM messages_fts f"
                        " JOIN messages m ON m.id = f.rowid WHERE messages_fts MATCH ?))")
                params = (pattern, match)
            else:
                sql += (" AND (title LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m"
                        " WHERE m.conversation_id = c.id AND m.content LIKE ? ESCAPE '\\'))")
                params = (pattern, pattern)
        rows = self._conn.execute(sql + " ORDER BY updated DESC, id DESC", params).fetchall()
        return [Conversation(*row) for row in rows]

    def conversation(self, conversation_id: int) -> Conversation | None:
        """One live conversation, or None when it does not exist or is deleted."""
        row = self._conn.execute("SELECT id, title, created, updated FROM conversations"
                                 " WHERE id = ? AND deleted IS NULL", (conversation_id,)).fetchone()
        return Conversation(*row) if row else None

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        """Set a conversation's title."""
        self._write("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def delete_conversation(self, conversation_id: int) -> None:
        """Hide a conversation; :meth:`restore_conversation` undoes it until :meth:`purge_deleted`."""
        self._write("UPDATE conversations SET deleted = ? WHERE id = ?", (time.time(), conversation_id))

    def restore_conversation(self, conversation_id: int) -> None:
        """Undo :meth:`delete_conversation`."""
        self._write("UPDATE conversations SET deleted = NULL WHERE id = ?", (conversation_id,))

    def purge_deleted(self) -> int:
        """Remove hidden conversations and their messages for good; returns how many."""
        with self._transaction() as conn:
            conn.execute("UPDATE conversations SET leaf_id = NULL WHERE deleted IS NOT NULL")
            return conn.execute("DELETE FROM conversations WHERE deleted IS NOT NULL").rowcount

    # messages

    def add_message(self, conversation_id: int, parent_id: int | None, role: str, content: str = "",
                    images: Iterable[str] = (), state: str = "complete") -> int:
        """Append a message under ``parent_id`` and make it the conversation's active leaf."""
        with self._transaction() as conn:
            return self._insert(conn, conversation_id, parent_id, role, content, images, state)

    @staticmethod
    def _insert(conn: sqlite3.Connection, conversation_id: int, parent_id: int | None, role: str,
                content: str = "", images: Iterable[str] = (), state: str = "complete") -> int:
        now = time.time()
        msg_id = conn.execute(
            "INSERT INTO messages (conversation_id, parent_id, role, content, created, images, state)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (conversation_id, parent_id, role, content, now, json.dumps(list(images)), state)).lastrowid
        conn.execute("UPDATE conversations SET leaf_id = ?, updated = ? WHERE id = ?", (msg_id, now, conversation_id))
        return msg_id

    # turns: one transaction each, so a crash never leaves a question without its answer row

    def reply(self, conversation_id: int, text: str, images: Iterable[str], title: str) -> TurnStart:
        """Add a user message at the end of the active branch and an empty streaming answer to it.

        ``title`` becomes the conversation's title when this is its first message.
        """
        with self._transaction() as conn:
            leaf = conn.execute("SELECT leaf_id FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
            if leaf is None:
                raise HistoryError(f"conversation {conversation_id} does not exist")
            if leaf[0] is None:
                conn.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))
            question = self._insert(conn, conversation_id, leaf[0], "user", text, images)
            answer = self._insert(conn, conversation_id, question, "assistant", state="streaming")
        return TurnStart(answer, self.branch(conversation_id))

    def resend(self, message_id: int, text: str, images: Iterable[str]) -> TurnStart:
        """Add an edited version of user message ``message_id`` (its sibling) and an empty answer to it."""
        original = self._existing(message_id, "user")
        with self._transaction() as conn:
            question = self._insert(conn, original.conversation_id, original.parent_id, "user", text, images)
            answer = self._insert(conn, original.conversation_id, question, "assistant", state="streaming")
        return TurnStart(answer, self.branch(original.conversation_id))

    def regenerate(self, answer_id: int) -> TurnStart:
        """Add an empty streaming answer beside assistant message ``answer_id`` (same question)."""
        original = self._existing(answer_id, "assistant")
        with self._transaction() as conn:
            answer = self._insert(conn, original.conversation_id, original.parent_id, "assistant", state="streaming")
        return TurnStart(answer, self.branch(original.conversation_id))

    def discard_turn(self, answer_id: int) -> Branch:
        """Undo a turn the engine refused before reading it (its prompt does not fit the context).

        The empty answer is deleted, and its question too when no other answer hangs under it (a
        new message or edit; a regenerate's question stays). The conversation's active branch
        goes back to a remaining version beside the deleted message (the newest), else to its
        parent. Returns the new active branch.

        Raises:
            HistoryError: ``answer_id`` is not a stored assistant message.
        """
        answer = self._existing(answer_id, "assistant")
        with self._transaction() as conn:
            conn.execute("DELETE FROM messages WHERE id = ?", (answer_id,))
            gone, parent = answer.id, answer.parent_id
            question = self.message(parent) if parent is not None else None
            if question is not None and question.role == "user" and not conn.execute(
                    "SELECT 1 FROM messages WHERE parent_id = ?", (question.id,)).fetchone():
                conn.execute("DELETE FROM messages WHERE id = ?", (question.id,))
                gone, parent = question.id, question.parent_id
            sibling = conn.execute("SELECT MAX(id) FROM messages WHERE conversation_id = ? AND parent_id IS ?"
                                   " AND id != ?", (answer.conversation_id, parent, gone)).fetchone()[0]
            leaf = sibling if sibling is not None else parent
            while leaf is not None and (child := conn.execute(
                    "SELECT MAX(id) FROM messages WHERE parent_id = ?", (leaf,)).fetchone()[0]) is not None:
                leaf = child
            conn.execute("UPDATE conversations SET leaf_id = ? WHERE id = ?", (leaf, answer.conversation_id))
        return self.branch(answer.conversation_id)

    def _existing(self, message_id: int, role: str) -> Message:
        message = self.message(message_id)
        if message is None or message.role != role or (role == "assistant" and message.parent_id is None):
            raise HistoryError(f"message {message_id} is not a stored {role} message")
        return message

    def update_message(self, message_id: int, content: str, state: str | None = None,
                       stats: dict[str, Any] | None = None) -> None:
        """Replace a message's text (and optionally its state and stats)."""
        sets, params = ["content = ?"], [content]
        if state is not None:
            sets.append("state = ?")
            params.append(state)
        if stats is not None:
            sets.append("stats = ?")
            params.append(json.dumps(stats))
        self._write(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*params, message_id))

    def message(self, message_id: int) -> Message | None:
        """One message by id."""
        row = self._conn.execute(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE id = ?",
                                 (message_id,)).fetchone()
        return _message(row) if row else None

    def active_path(self, conversation_id: int) -> list[Message]:
        """The messages from the root to the active leaf, in order."""
        rows = self._conn.execute(
            f"""WITH RECURSIVE path(id, depth) AS (
                    SELECT leaf_id, 0 FROM conversations WHERE id = ? AND leaf_id IS NOT NULL
                    UNION ALL
                    SELECT m.parent_id, depth + 1 FROM messages m JOIN path ON m.id = path.id
                    WHERE m.parent_id IS NOT NULL)
                SELECT {', '.join('m.' + c for c in _MESSAGE_COLUMNS.split(', '))}
                FROM path JOIN messages m ON m.id = path.id ORDER BY depth DESC""",
            (conversation_id,)).fetchall()
        return [_message(row) for row in rows]

    def branch(self, conversation_id: int) -> Branch:
        """The active path of a conversation with the versions (siblings) of each of its messages."""
        path = self.active_path(conversation_id)
        return Branch(conversation_id, path, {m.id: self.siblings(m.id) for m in path})

    def siblings(self, message_id: int) -> list[int]:
        """Ids of the messages sharing ``message_id``'s parent (itself included), oldest first."""
        return [row[0] for row in self._conn.execute(
            "SELECT s.id FROM messages s JOIN messages m ON s.conversation_id = m.conversation_id"
            " AND s.parent_id IS m.parent_id WHERE m.id = ? ORDER BY s.id", (message_id,))]

    def select_branch(self, message_id: int) -> None:
        """Make the branch through ``message_id`` active, down its newest descendants."""
        leaf = message_id
        while (child := self._conn.execute("SELECT MAX(id) FROM messages WHERE parent_id = ?",
                                           (leaf,)).fetchone()[0]) is not None:
            leaf = child
        self._write("UPDATE conversations SET leaf_id = ? WHERE id ="
                    " (SELECT conversation_id FROM messages WHERE id = ?)", (leaf, message_id))

    def all_messages(self, conversation_id: int) -> list[Message]:
        """Every message of a conversation, every branch, oldest first (parents before children)."""
        return [_message(row) for row in self._conn.execute(
            f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,))]

    # export and import

    def export_json(self, conversation_id: int) -> dict[str, Any]:
        """The whole conversation (all branches) as a JSON-ready dict; images are referred to by path."""
        conversation = self.conversation(conversation_id)
        if conversation is None:
            raise HistoryError(f"conversation {conversation_id} does not exist")
        path = self.active_path(conversation_id)
        return {"format": EXPORT_FORMAT, "version": 1, "title": conversation.title, "created": conversation.created,
                "leaf": path[-1].id if path else None,
                "messages": [{"id": m.id, "parent": m.parent_id, "role": m.role, "content": m.content,
                              "images": list(m.images), "stats": m.stats, "state": m.state, "created": m.created}
                             for m in self.all_messages(conversation_id)]}

    def import_json(self, data: dict[str, Any]) -> int:
        """Add a conversation written by :meth:`export_json`; returns the new conversation's id.

        Raises:
            HistoryError: ``data`` is not such an export (names the first bad field).
        """
        if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
            raise HistoryError(f"not a DeltaDesk conversation export (\"format\" must be \"{EXPORT_FORMAT}\")")
        messages = data.get("messages")
        if not isinstance(messages, list):
            raise HistoryError("conversation export: \"messages\" must be a list")
        now = time.time()
        new_ids: dict[Any, int] = {}
        with self._transaction() as conn:
            conversation_id = conn.execute(
                "INSERT INTO conversations (title, created, updated) VALUES (?, ?, ?)",
                (str(data.get("title") or "Imported chat"), float(data.get("created") or now), now)).lastrowid
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                    raise HistoryError(f"conversation export: message {i} has no valid \"role\"")
                if m.get("parent") is not None and m["parent"] not in new_ids:
                    raise HistoryError(f"conversation export: message {i} names parent {m['parent']!r}"
                                       " that does not come before it")
                new_ids[m.get("id", i)] = conn.execute(
                    "INSERT INTO messages (conversation_id, parent_id, role, content, created, images, stats, state)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (conversation_id, new_ids.get(m.get("parent")), m["role"], str(m.get("content", "")),
                     float(m.get("created") or now), json.dumps([str(p) for p in m.get("images", [])]),
                     json.dumps(m.get("stats") or {}), str(m.get("state") or "complete"))).lastrowid
            leaf = new_ids.get(data.get("leaf"), list(new_ids.values())[-1] if new_ids else None)
            conn.execute("UPDATE conversations SET leaf_id = ? WHERE id = ?", (leaf, conversation_id))
        return conversation_id

    def export_markdown(self, conversation_id: int) -> str:
        """The active branch as a Markdown document (answers without their thinking)."""
        conversation = self.conversation(conversation_id)
        title = conversation.title if conversation else "Conversation"
        parts = [f"# {title}\n"]
        for m in self.active_path(conversation_id):
            text = m.content.partition("</think>")[2].lstrip() if "</think>" in m.content else m.content
            parts.append(f"## {'You' if m.role == 'user' else m.role.capitalize()}\n")
            parts.extend(f"![image]({Path(p).as_uri()})\n" for p in m.images)
            parts.append(text.strip() + "\n")
        return "\n".join(parts)


class ImageStore:
    """Image files kept once each, named by the SHA-256 of their bytes, in one folder."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def add_bytes(self, data: bytes, suffix: str) -> Path:
        """Store ``data`` (an encoded image; ``suffix`` like ".png") and return its path."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / (hashlib.sha256(data).hexdigest()[:32] + suffix.lower())
        if not path.exists():
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        return path

    def add_file(self, source: str | Path) -> Path:
        """Copy an image file into the store (once per content) and return the stored path."""
        source = Path(source)
        return self.add_bytes(source.read_bytes(), source.suffix or ".img")
