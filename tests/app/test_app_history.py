"""History store: message tree, branches, search, migrations with backups, crash safety."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.history import MIGRATIONS, SCHEMA_VERSION, HistoryError, HistoryStore, ImageStore


@pytest.fixture
def store(tmp_path):
    s = HistoryStore.open(tmp_path / "h.db")
    yield s
    s.close()


def test_opens_in_wal_with_foreign_keys(store):
    conn = store._conn
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_tree_branches_and_active_path(store):
    c = store.create_conversation("t")
    u1 = store.add_message(c, None, "user", "hi")
    a1 = store.add_message(c, u1, "assistant", "hello")
    u2 = store.add_message(c, a1, "user", "how are you", images=["/x/1.png"])
    a2 = store.add_message(c, u2, "assistant", "fine")
    assert [m.id for m in store.active_path(c)] == [u1, a1, u2, a2]
    assert store.active_path(c)[2].images == ("/x/1.png",)
    # regenerate: a sibling of a2 becomes the active leaf
    a2b = store.add_message(c, u2, "assistant", "great", state="streaming")
    assert [m.id for m in store.active_path(c)] == [u1, a1, u2, a2b]
    assert store.siblings(a2) == [a2, a2b]
    # edit: a sibling of u2 with its own answer
    u2b = store.add_message(c, a1, "user", "how old are you")
    store.add_message(c, u2b, "assistant", "young")
    assert store.siblings(u2) == [u2, u2b]
    assert store.siblings(u1) == [u1]
    # switching back to the first version follows its newest descendants
    store.select_branch(u2)
    assert [m.id for m in store.active_path(c)] == [u1, a1, u2, a2b]
    store.update_message(a2b, "great!", "complete", {"ttft_ms": 5.0})
    m = store.message(a2b)
    assert (m.content, m.state, m.stats) == ("great!", "complete", {"ttft_ms": 5.0})


def test_search_rename_delete_restore_purge(store):
    a = store.create_conversation("Cats")
    b = store.create_conversation("Dogs")
    store.add_message(b, None, "user", "Do 100% of dogs bark?")
    assert [c.id for c in store.conversations()] == [b, a]
    assert [c.id for c in store.conversations("cat")] == [a]
    assert [c.id for c in store.conversations("100%")] == [b]
    assert store.conversations("_") == []
    store.rename_conversation(a, "Felines")
    assert store.conversation(a).title == "Felines"
    store.delete_conversation(b)
    assert [c.id for c in store.conversations()] == [a]
    store.restore_conversation(b)
    assert len(store.conversations()) == 2
    store.delete_conversation(b)
    assert store.purge_deleted() == 1
    assert store._conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0


def _v1_database(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    for statement in MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO conversations (id, title, created, updated) VALUES (1, 'old', 1, 1)")
    for i in range(1, 51):
        conn.execute("INSERT INTO messages (id, conversation_id, parent_id, role, content, created)"
                     " VALUES (?, 1, ?, ?, ?, ?)", (i, i - 1 or None, "user" if i % 2 else "assistant", f"m{i}", i))
    conn.execute("UPDATE conversations SET leaf_id = 50")
    conn.close()


def test_migration_from_v1_keeps_every_row_and_backs_up(tmp_path):
    path = tmp_path / "h.db"
    _v1_database(path)
    store = HistoryStore.open(path)
    path_rows = store.active_path(1)
    assert [m.content for m in path_rows] == [f"m{i}" for i in range(1, 51)]
    assert all(m.images == () and m.state == "complete" for m in path_rows)
    backup = tmp_path / "h.db.v1.bak"
    assert backup.is_file()
    old = sqlite3.connect(backup)
    assert old.execute("PRAGMA user_version").fetchone()[0] == 1
    assert old.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 50
    old.close()
    store.close()


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "h.db"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(HistoryError, match="newer"):
        HistoryStore.open(path)


def test_garbage_file_is_a_history_error(tmp_path):
    path = tmp_path / "h.db"
    path.write_bytes(b"not a database at all" * 100)
    with pytest.raises(HistoryError, match="not a readable SQLite database"):
        HistoryStore.open(path)


WRITER = textwrap.dedent("""
    import sys
    from app.history import HistoryStore
    store = HistoryStore.open(sys.argv[1])
    c = store.create_conversation("crash")
    parent = None
    answer = None
    for i in range(100000):
        parent = store.add_message(c, parent, "user" if i % 2 == 0 else "assistant", "x" * 2000 + str(i))
        if i % 2:
            answer = parent
        elif answer is not None:
            store.update_message(answer, "y" * 4000 + str(i), "streaming")
        print(parent, flush=True)
""")


def test_killed_writer_loses_no_committed_message(tmp_path):
    path = tmp_path / "h.db"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    committed = []
    deadline = time.monotonic() + 120
    while len(committed) < 300 and time.monotonic() < deadline:
        committed.append(int(proc.stdout.readline()))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(committed) >= 300
    store = HistoryStore.open(path)
    assert store._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    ids = {row[0] for row in store._conn.execute("SELECT id FROM messages")}
    assert set(committed) <= ids
    path_ids = [m.id for m in store.active_path(store.conversations()[0].id)]
    assert path_ids[:len(committed)] == committed
    store.close()


def test_image_store_names_by_content(tmp_path):
    images = ImageStore(tmp_path / "img")
    a = images.add_bytes(b"\x89PNG same", ".PNG")
    b = images.add_bytes(b"\x89PNG same", ".png")
    src = tmp_path / "photo.jpg"
    src.write_bytes(b"jpeg bytes")
    c = images.add_file(src)
    assert a == b and a.suffix == ".png" and a.read_bytes() == b"\x89PNG same"
    assert c.parent == images.folder and c.suffix == ".jpg" and c != a



def test_export_import_round_trip_keeps_branches(store, tmp_path):
    c = store.create_conversation("Trip")
    u = store.add_message(c, None, "user", "plan a trip", images=[str(tmp_path / "map.png")])
    a1 = store.add_message(c, u, "assistant", "<think>hmm</think>Go north", state="complete")
    store.add_message(c, u, "assistant", "Go south", state="stopped")
    store.select_branch(a1)
    data = json.loads(json.dumps(store.export_json(c)))
    copy = store.import_json(data)
    assert copy != c and store.conversation(copy).title == "Trip"
    assert [(m.role, m.content, m.images, m.state) for m in store.active_path(copy)] == \
        [(m.role, m.content, m.images, m.state) for m in store.active_path(c)]
    assert len(store.all_messages(copy)) == 3
    md = store.export_markdown(c)
    assert md.startswith("# Trip\n") and "## You" in md and "Go north" in md and "hmm" not in md
    assert "map.png" in md and "Go south" not in md


@pytest.mark.parametrize("bad, message", [
    ({"format": "other"}, "not a DeltaDesk"),
    ({"format": "deltadesk-conversation", "messages": "x"}, "must be a list"),
    ({"format": "deltadesk-conversation", "messages": [{"role": "robot"}]}, "message 0"),
    ({"format": "deltadesk-conversation", "messages": [{"id": 1, "parent": 7, "role": "user"}]}, "parent 7"),
])
def test_import_rejects_bad_files_and_writes_nothing(store, bad, message):
    with pytest.raises(HistoryError, match=message):
        store.import_json(bad)
    assert store.conversations() == []


def test_a_new_database_needs_no_backup(tmp_path):
    HistoryStore.open(tmp_path / "h.db").close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.db"]
