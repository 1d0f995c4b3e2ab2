"""The chat app when its chat database fails or changes under it (app/chats.py, app/tui/guard.py): Regenerate keeps the
old reply until the new one has text, a full disk or a lock is a notice with the reply kept on screen (and printed at
quit), a message that cannot be stored comes back to the input, a damaged database opens with a notice, a chat
deleted in another window while a dialog is open is said, and a junk or damaged database at start is offered to be moved
aside. Textual's Pilot, no model."""
from __future__ import annotations

import asyncio
import re
import sqlite3
from pathlib import Path

import pytest
import test_tui_chat
from test_tui_chat import errors, pilot_test, send, titles, until, without_model

from moechat.app.chats import ChatStore, store_path
from moechat.app.tui.messages import ReplyDelta, ReplyFinished
from moechat.app.tui.widgets.message_view import ChatInput, MessageView
from moechat.engine.errors import MoechatError

stored = test_tui_chat.stored  # the fixture: two stored conversations, 'older' and 'newer'


def contents(chat) -> list[str]:
    return [view.content for view in chat.query(MessageView)]


def stored_contents(app) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in app.store.messages(app.chat.conv_id)]


def asked(app) -> list[int]:
    """The request ids the app asks the engine for, recorded instead of sent."""
    requests: list[int] = []
    app.bridge.generate = lambda request_id, *args: requests.append(request_id)
    return requests


@pilot_test
@pytest.mark.notorch
@pytest.mark.parametrize("empty_end", ["failed", "stop"])  # stop: an end of sequence at once
async def test_regenerate_keeps_the_old_reply_until_the_new_one_has_text(tmp_path, stored, empty_end):
    """It deleted the old reply first: a failed engine, a remote server down, Esc before the first token, or a
    regeneration that came back empty lost it."""
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        old = [("user", "hello there"), ("assistant", "Hello! How are you today?")]
        await pilot.press("ctrl+r")
        await until(pilot, lambda: requests == [1], "the regeneration's request")
        assert stored_contents(app)[:2] == old and contents(chat) == ["hello there", ""]  # stored; off the screen
        app.post_message(ReplyFinished(1, "", empty_end, None))
        await until(pilot, lambda: chat.reply is None, "the empty reply's end")
        assert stored_contents(app) == old and contents(chat) == [c for _, c in old]  # given back, no empty reply

        await pilot.press("ctrl+r")
        await until(pilot, lambda: requests == [1, 2], "the second regeneration")
        app.post_message(ReplyDelta(2, "A fresh answer."))
        app.post_message(ReplyFinished(2, "A fresh answer.", "stop", None))
        await until(pilot, lambda: chat.reply is None, "the reply's end")
        assert stored_contents(app) == [("user", "hello there"), ("assistant", "A fresh answer.")]
        assert contents(chat) == ["hello there", "A fresh answer."]


@pilot_test
@pytest.mark.notorch
async def test_a_full_disk_mid_reply_is_said_once_and_the_reply_is_kept_for_the_terminal(tmp_path, stored):
    """It crashed the app (SQLite rolls back a full transaction itself, and the store's ROLLBACK raised over the cause)
    and lost every token since the last save."""
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "write a lot")
        await until(pilot, lambda: requests == [1], "the request")
        pages = app.store._db.execute("PRAGMA page_count").fetchone()[0]
        app.store._db.execute(f"PRAGMA max_page_count = {pages}")  # the disk full: no page more
        long = "a long answer that does not fit. " * 2000
        for at in range(0, len(long), 6000):
            chat.reply.saved_at = 0.0  # a save due at each delta
            app.post_message(ReplyDelta(1, long[at:at + 6000]))
            await pilot.pause()
        await until(pilot, lambda: chat.reply.text == long, "the deltas")
        full = [e for e in errors(app) if "the disk is full" in e]
        assert len(full) == 1 and "not saved yet" in full[0] and "rollback" not in full[0]  # said once, the cause named
        assert app.is_running and app.return_code is None
        await app.action_quit()
    ((why, text),) = app.unsaved_replies
    assert "the disk is full" in why and text == long


@pytest.mark.notorch
def test_a_reply_that_could_not_be_saved_at_quit_is_printed(monkeypatch, capsys):
    from moechat.app import cli
    from moechat.app.tui import app as app_module

    def quits_unsaved(self):
        self.unsaved_replies = [("chat database x: the disk is full (database or disk is full); free some space", "the reply")]

    monkeypatch.setattr(app_module.MoechatApp, "run", quits_unsaved)
    assert app_module.run_tui(cli.build_parser().parse_args(["chat", "--model", "unused"])) == 0
    out, err = capsys.readouterr()
    assert out == "the reply\n" and err.startswith("moechat: chat database x: the disk is full") and "follows" in err


@pilot_test
@pytest.mark.notorch
async def test_a_message_that_cannot_be_stored_comes_back_to_the_input(tmp_path, stored):
    """A lock held by another program (a database browser, a backup) crashed the app at Enter and lost the message."""
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        app.store._db.execute("PRAGMA busy_timeout = 50")  # not the default 5 s of waiting in a test
        other = sqlite3.connect(tmp_path / "chats.sqlite3", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # holds the write lock
        try:
            await send(pilot, "my precious message")
            await until(pilot, lambda: any("locked" in e for e in errors(app)), "the lock's notice")
            assert chat.query_one(ChatInput).text == "my precious message" and requests == []
            assert app.is_running and app.return_code is None
        finally:
            other.execute("ROLLBACK")
            other.close()
        await pilot.press("enter")  # the lock gone: it sends
        await until(pilot, lambda: requests == [1], "the request")
        assert stored_contents(app)[-2] == ("user", "my precious message")


@pilot_test
@pytest.mark.notorch
@pytest.mark.parametrize("key, typed, ends", [("f2", "x", "enter"), ("ctrl+s", "be terse", "ctrl+s")])
async def test_rename_and_system_prompt_on_a_chat_deleted_meanwhile_are_said(tmp_path, stored, key, typed, ends):
    from moechat.app.tui.screens.dialogs import TextPrompt

    async with without_model(tmp_path) as (app, pilot):
        chat = app.chat
        app._notifications.clear()
        await pilot.press(key)
        await until(pilot, lambda: isinstance(app.screen, TextPrompt), "the dialog")
        other = ChatStore(tmp_path / "chats.sqlite3")  # the other window deletes the chat under the dialog
        other.delete(chat.conv_id)
        other.close()
        await pilot.press(*typed, ends)
        await until(pilot, lambda: chat.conv_id is None, "the screen on no chat")
        assert app.is_running and app.return_code is None
        assert any("deleted in another moechat window" in n.message for n in app._notifications)
        assert titles(chat) == ["older"]


@pilot_test
@pytest.mark.notorch
async def test_a_chat_deleted_while_its_reply_streams_stops_the_reply_and_keeps_the_screen(tmp_path, stored):
    """Export (or rename) found the chat gone and cleared the log under the streaming reply: the next delta crashed."""
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        stops = []
        app.bridge.stop = lambda: stops.append(1)
        await send(pilot, "go on")
        await until(pilot, lambda: requests == [1], "the request")
        app.post_message(ReplyDelta(1, "first words"))
        other = ChatStore(tmp_path / "chats.sqlite3")
        other.delete(chat.conv_id)
        other.close()
        app.action_export_chat()
        await pilot.pause()
        app.post_message(ReplyDelta(1, " and more"))
        app.post_message(ReplyFinished(1, "first words and more", "cancelled", None))
        await until(pilot, lambda: chat.reply is None, "the reply's end")
        assert app.is_running and app.return_code is None and stops == [1]
        assert contents(chat)[-1] == "first words and more"


@pilot_test
@pytest.mark.notorch
async def test_a_message_held_while_the_reply_stops_is_kept_when_moechat_quits_first(tmp_path, stored):
    """Esc, Enter (the message held until the stop lands), then Ctrl+Q before it lands: the message is kept in its chat
    (stored as it was sent, Ctrl+R asks for its reply at the next start), not lost with the screen."""
    from moechat.app.tui.widgets.message_view import ChatInput

    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "one")
        await until(pilot, lambda: requests == [1], "the request")
        app.bridge.stop = lambda: None  # the engine's step in progress goes on
        app.post_message(ReplyDelta(1, "half"))
        await until(pilot, lambda: chat.reply.text == "half", "the reply's text")
        await pilot.press("escape")
        chat.query_one(ChatInput).focus()
        await pilot.press(*"two", "enter")
        assert chat.held.text == "two" and contents(chat)[-2:] == ["half", "two"]
        conv = chat.conv_id
        await app.action_quit()
    assert app.unsaved_replies == []
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        assert [(m.role, m.content, m.finished) for m in store.messages(conv)][-3:] == [
            ("user", "one", True), ("assistant", "half", False), ("user", "two", True)]


@pilot_test
@pytest.mark.notorch
async def test_a_reply_whose_last_save_failed_is_saved_later_or_printed_at_quit(tmp_path, stored):
    """Its row kept the partial text, the next turn's history was read from it, and at quit nothing was printed."""
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "one")
        await until(pilot, lambda: requests == [1], "the request")
        app.store._db.execute("PRAGMA query_only = ON")  # writes refused from here
        app.post_message(ReplyDelta(1, "the whole answer"))
        app.post_message(ReplyFinished(1, "the whole answer", "stop", None))
        await until(pilot, lambda: chat.reply is None, "the reply's end")
        assert any("not saved yet" in e for e in errors(app)) and chat.saver.pending_saves
        app.store._db.execute("PRAGMA query_only = OFF")  # the database writable again: the next send saves it first
        await send(pilot, "two")
        await until(pilot, lambda: requests == [1, 2], "the second request")
        assert ("assistant", "the whole answer") in stored_contents(app) and not chat.saver.pending_saves
        app.store._db.execute("PRAGMA query_only = ON")
        app.post_message(ReplyFinished(2, "the second answer", "stop", None))
        await until(pilot, lambda: chat.reply is None, "the second reply's end")
        await app.action_quit()
    ((why, text),) = app.unsaved_replies
    assert "read-only" in why and text == "the second answer"


@pilot_test
@pytest.mark.notorch
async def test_a_page_damaged_while_the_app_runs_is_a_notice_that_says_how_to_get_the_rescue(tmp_path):
    """A damaged page behind a sound header crashed the app as it read the chat on it; then its notice said the app offers
    the rescue at start, which the start did not, reading the header and schema only (`check_pages` now reads every page)."""
    from moechat.app.chat_file import DamagedFile

    path = tmp_path / "chats.sqlite3"
    store = ChatStore(path)
    for c in range(3):
        conv = store.create(f"chat {c}")
        for m in range(3):
            store.add(conv, "user", f"<c{c}m{m}> " + "words " * 500)
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    async with without_model(tmp_path) as (app, pilot):  # it opens chat 2
        listed = app.chat.query_one("#conversations")
        data, size = path.read_bytes(), 4096
        with path.open("r+b") as file:  # chat 0's first message's page, which nothing read since the app started
            file.seek(data.index(b"<c0m0> ") // size * size)
            file.write(b"\xa5" * size)
        listed.highlighted = listed.get_option_index(str(conv - 2))
        listed.action_select()
        await until(pilot, lambda: any("damaged" in e for e in errors(app)), "the damage's notice")
        (said,) = [e for e in errors(app) if "damaged" in e]
        assert "quit every moechat window and start the chat app again" in said and "\n" not in said
        assert app.is_running and app.return_code is None
    with pytest.raises(DamagedFile):  # the next start finds it, and the dialog offers the rescue
        ChatStore(path)


@pilot_test
@pytest.mark.notorch
async def test_a_listed_chat_deleted_in_another_window_is_said_when_picked(tmp_path, stored):
    """It opened as an empty chat, as if its messages were lost, and stayed in the list."""
    from textual.widgets import OptionList

    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat = app.chat
        other = ChatStore(tmp_path / "chats.sqlite3")
        other.delete(older)
        other.close()
        assert titles(chat) == ["newer", "older"]
        listed = chat.query_one("#conversations", OptionList)
        listed.highlighted = 1
        listed.action_select()
        await until(pilot, lambda: titles(chat) == ["newer"], "the list without the deleted chat")
        assert chat.conv_id == newer and contents(chat) == ["hello there", "Hello! How are you today?"]
        assert any("deleted in another moechat window" in n.message for n in app._notifications)


@pilot_test
@pytest.mark.notorch
async def test_an_export_that_fills_the_disk_leaves_the_earlier_export_whole(tmp_path, stored, monkeypatch):
    """Ctrl+O wrote over the chat's earlier export in place: a disk that filled midway cut it short, and with it the
    only copy of a reply regenerated since."""
    from pathlib import Path

    async with without_model(tmp_path) as (app, pilot):
        earlier = app.action_export_chat()
        before = earlier.read_bytes()
        app.store.add(app.chat.conv_id, "user", "more " * 5000)
        write_text = Path.write_text

        def fills_the_disk(path, text, *args, **kwargs):
            write_text(path, text[:len(text) // 2], *args, **kwargs)
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(Path, "write_text", fills_the_disk)
        assert app.action_export_chat() is None
        await pilot.pause()
        assert "could not write" in errors(app)[-1] and "No space left" in errors(app)[-1]
        assert earlier.read_bytes() == before and sorted(p.name for p in earlier.parent.iterdir()) == [earlier.name]
        monkeypatch.undo()
        assert app.action_export_chat() == earlier and "more more" in earlier.read_text()


@pilot_test
@pytest.mark.notorch
async def test_an_export_beside_another_containers_export_of_the_same_pid(tmp_path, stored, monkeypatch):
    """Containers sharing a folder number their processes alike (each one's moechat pid 1, say): two exports of a chat
    wrote one `.<name>.1.part`, so one renamed the other's half-written copy into place and the other failed."""
    import os

    async with without_model(tmp_path) as (app, pilot):
        path = app.action_export_chat()
        monkeypatch.setattr(os, "getpid", lambda: 1)
        theirs = path.with_name(f".{path.name}.1.part")
        theirs.write_text("the other window's export, being written")
        assert app.action_export_chat() == path and "Hello! How are you today?" in path.read_text()
        assert theirs.read_text() == "the other window's export, being written"


@pilot_test
@pytest.mark.notorch
async def test_the_app_says_what_the_command_line_changes_about_the_engine(tmp_path):
    """A --model on the command line runs the embedded engine over a backend saved in the settings: said at each load."""
    from test_tui_chat import failing, make_app

    app = make_app(tmp_path, failing("no model here"))
    app.engine_notice = lambda: "--model X on the command line runs the embedded engine"
    async with app.run_test() as pilot:
        await until(pilot, lambda: errors(app), "the load failure")
        app.action_reload()
        await pilot.pause()
        assert sum("--model X" in n.message for n in app._notifications) == 2  # the start and the reload


@pilot_test
@pytest.mark.notorch
async def test_the_chat_list_follows_another_window_and_the_reply_streams_on(tmp_path, stored):
    """Chats another moechat on the same database added, renamed or deleted stayed as the list was drawn at start."""
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "a question")
        await until(pilot, lambda: requests == [1], "the request")
        app.post_message(ReplyDelta(1, "Half of "))
        other = ChatStore(tmp_path / "chats.sqlite3")
        added = other.create("from the other window")
        other.rename(older, "renamed there")
        await until(pilot, lambda: sorted(titles(chat)) == ["from the other window", "renamed there", "✎ newer"], "the list")
        other.delete(added)
        other.close()
        await until(pilot, lambda: sorted(titles(chat)) == ["renamed there", "✎ newer"], "the list without the deleted one")
        app.post_message(ReplyFinished(1, "Half of the answer.", "stop", None))
        await until(pilot, lambda: chat.reply is None, "the reply's end")
        assert chat.conv_id == newer and stored_contents(app)[-2:] == [("user", "a question"),
                                                                       ("assistant", "Half of the answer.")]
        assert contents(chat)[-1] == "Half of the answer." and errors(app) == ["no model here"]


@pilot_test
@pytest.mark.notorch
@pytest.mark.parametrize("deleted", ["file", "folder"])
async def test_a_chat_database_deleted_while_the_app_runs_is_made_again(tmp_path, deleted):
    """Its saves went on into the deleted file, unseen, and the conversation was gone at exit."""
    import shutil
    from pathlib import Path

    folder = tmp_path / "data"
    path = folder / "chats.sqlite3"
    async with without_model(folder) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "keep this")
        await until(pilot, lambda: requests == [1], "the request")
        if deleted == "folder":
            shutil.rmtree(folder)
        else:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
        app.post_message(ReplyDelta(1, "Kept."))
        app.post_message(ReplyFinished(1, "Kept.", "stop", None))
        await until(pilot, lambda: chat.reply is None, "the reply's end")
        await until(pilot, lambda: any("was deleted while moechat ran" in n.message for n in app._notifications), "notice")
        await app.action_quit()
    assert app.unsaved_replies == []
    with ChatStore(path) as store:
        (conv,) = store.conversations()
        assert [(m.role, m.content) for m in store.messages(conv.id)] == [("user", "keep this"), ("assistant", "Kept.")]


@pilot_test
@pytest.mark.notorch
async def test_the_open_chat_is_looked_up_alone_not_in_the_whole_list(tmp_path, stored):
    """current_conversation (at each send, regenerate and look for another window's changes) read every stored chat to
    find the open one: 4.4 ms a call at 2,000 chats, on the UI thread."""
    async with without_model(tmp_path) as (app, pilot):
        chat, reads, listed = app.chat, [], app.store.conversations
        app.store.conversations = lambda: reads.append(1) or listed()
        assert chat.current_conversation().title == "newer"
        with ChatStore(app.store.path) as other:  # another window deletes it
            other.delete(chat.conv_id)
        assert chat.current_conversation() is None and reads == []
        chat.conv_id = None
        assert chat.current_conversation() is None


def backup_rows(path) -> list[list[tuple]]:
    with sqlite3.connect(path) as raw:
        return [raw.execute(f"SELECT * FROM {table} ORDER BY id").fetchall() for table in ("conversations", "messages")]


@pilot_test
@pytest.mark.notorch
@pytest.mark.parametrize("noticed_by", ["the reply's save", "the chat list's look"])
async def test_a_backup_restored_while_a_reply_streams_keeps_its_rows_and_the_reply_is_printed(tmp_path, stored, noticed_by,
                                                                                              monkeypatch):
    """A backup restored over the chat database (os.replace) while a reply streamed: the store opened it at the next write,
    and the reply's next save overwrote the backup's message of the same id; the next message went into the backup's
    chat of the open chat's id. The list's look is called by hand: its timer, firing first on a loaded machine, made "the
    reply's save" case the other one."""
    import os
    import shutil

    from moechat.app.tui.screens import chat as chat_screen

    monkeypatch.setattr(chat_screen, "CHECK_S", 3600.0)

    with ChatStore(tmp_path / "backup.sqlite3") as backup:  # chats 1 and 2, messages 1 to 6: the ids the app holds
        for title in ("backup one", "backup two"):
            conv = backup.create(title)
            for role, content in (("user", "q"), ("assistant", "a"), ("user", "q2")):
                backup.add(conv, role, content)
    before = backup_rows(tmp_path / "backup.sqlite3")
    async with without_model(tmp_path) as (app, pilot):
        chat, requests, stops = app.chat, asked(app), []
        app.bridge.stop = lambda: stops.append(1)
        await send(pilot, "a question")
        await until(pilot, lambda: requests == [1], "the request")
        app.post_message(ReplyDelta(1, "Half of "))
        await until(pilot, lambda: chat.reply.text == "Half of ", "the first words")
        shutil.copy(tmp_path / "backup.sqlite3", tmp_path / "restoring")
        os.replace(tmp_path / "restoring", tmp_path / "chats.sqlite3")
        if noticed_by == "the chat list's look":
            await chat.check_elsewhere()  # the CHECK_S timer's call
        chat.reply.saved_at = 0.0  # a save due at the next delta
        app.post_message(ReplyDelta(1, "the answer."))
        await until(pilot, lambda: stops == [1], "the reply stopped")
        app.post_message(ReplyFinished(1, "Half of the answer.", "cancelled", None))
        await until(pilot, lambda: chat.reply is None, "the reply's end")
        assert backup_rows(tmp_path / "chats.sqlite3") == before and contents(chat)[-1] == "Half of the answer."
        await chat.check_elsewhere()  # the list: the backup's chats (a look after the reply's end: the screen on no chat)
        assert sorted(titles(chat)) == ["backup one", "backup two"] and backup_rows(tmp_path / "chats.sqlite3") == before
        await send(pilot, "the next message")
        if noticed_by == "the chat list's look":  # the log still on the reply's chat: refused there, back in the input
            await until(pilot, lambda: chat.conv_id is None and chat.query_one(ChatInput).text == "the next message", "back")
            assert backup_rows(tmp_path / "chats.sqlite3") == before
            await pilot.press("enter")
        await until(pilot, lambda: requests == [1, 2], "the second request")
        said = [n.message for n in app._notifications if "not in the file put in place" in n.message]
        assert said == ["this chat is not in the file put in place of the chat database: the reply is printed when you quit",
                        "this chat is not in the file put in place of the chat database: Enter sends your message to a new chat"]
        assert stored_contents(app) == [("user", "the next message"), ("assistant", "")]
        await app.action_quit()
    assert app.unsaved_replies == [("this chat is not in the file put in place of the chat database", "Half of the answer.")]
    rows = backup_rows(tmp_path / "chats.sqlite3")
    assert rows[0][:2] == before[0] and rows[1][:6] == before[1]  # the backup's chats as they were, the new one after them


@pilot_test
@pytest.mark.notorch
async def test_quitting_as_a_reply_streams_after_a_backup_is_restored_prints_the_reply(tmp_path, stored):
    """Quitting looks for the file replaced first, then saves the reply as far as it got: into the backup's row of its id."""
    import os
    import shutil

    with ChatStore(tmp_path / "backup.sqlite3") as backup:
        conv = backup.create("from the backup")
        for content in ("one", "two", "three", "four", "five", "six"):
            backup.add(conv, "user", content)
    before = backup_rows(tmp_path / "backup.sqlite3")
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "a question")
        await until(pilot, lambda: requests == [1], "the request")
        app.post_message(ReplyDelta(1, "So far"))
        await until(pilot, lambda: chat.reply.text == "So far", "the first words")
        shutil.copy(tmp_path / "backup.sqlite3", tmp_path / "restoring")
        os.replace(tmp_path / "restoring", tmp_path / "chats.sqlite3")
        await app.action_quit()
    assert app.unsaved_replies == [("this chat is not in the file put in place of the chat database", "So far")]
    assert backup_rows(tmp_path / "chats.sqlite3") == before


@pilot_test
@pytest.mark.notorch
@pytest.mark.parametrize("key, then", [("f2", ("x", "enter")), ("ctrl+s", ("x", "ctrl+s")), ("f8", ("y",)), ("ctrl+r", ())],
                         ids=["rename", "system prompt", "delete", "regenerate"])
async def test_a_write_to_the_open_chat_after_a_backup_is_restored_leaves_the_backups_rows(tmp_path, stored, key, then):
    """Rename, system prompt and delete (their dialog open as the backup was restored) and Regenerate wrote into the
    backup's chat of the open chat's id."""
    import os
    import shutil

    with ChatStore(tmp_path / "backup.sqlite3") as backup:  # chats 1 and 2, as the app's
        for title in ("backup one", "backup two"):
            backup.add(backup.create(title), "user", "q")
    before = backup_rows(tmp_path / "backup.sqlite3")
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        if then:  # the dialog open as the backup is restored
            await pilot.press(key)
            await until(pilot, lambda: app.screen is not chat, "the dialog")
        shutil.copy(tmp_path / "backup.sqlite3", tmp_path / "restoring")
        os.replace(tmp_path / "restoring", tmp_path / "chats.sqlite3")
        await pilot.press(*(then or (key,)))
        await until(pilot, lambda: any("was replaced while moechat ran" in n.message for n in app._notifications), "notice")
        await pilot.pause()
        assert backup_rows(tmp_path / "chats.sqlite3") == before and requests == [] and app.is_running
        assert sorted(titles(chat)) == ["backup one", "backup two"]
        if key != "f8":  # delete: nothing of the chat is in the backup to delete, and the screen shows its chats
            assert chat.conv_id is None and any(n.message.startswith("this chat is not in the file put in place")
                                                for n in app._notifications)


@pytest.fixture
def own_dirs(tmp_path, monkeypatch):
    """The chat database and settings where no other test's are (platformdirs reads these at each call)."""
    for var in ("XDG_DATA_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))


def damaged_store(kind: str) -> tuple[Path, bytes]:
    """The chat database at its own path made junk or damaged (a truncated SQLite file): (its path, its bytes)."""
    path = store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "junk":
        path.write_bytes(b"my shopping list\n" * 100)
    else:
        with ChatStore(path) as store:
            for i in range(60):
                store.add(store.create(f"chat {i}"), "user", "words " * 300)
            store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        with path.open("r+b") as file:
            file.truncate(path.stat().st_size // 2)
    return path, path.read_bytes()


def answering(monkeypatch, *keys: str) -> list[str]:
    """The damaged database's dialog run headless, answered with `keys` (a button's #id is clicked): what it said."""
    from moechat.app.tui.screens import damaged_chats

    def run(self):
        async def answer(pilot):
            await until(pilot, lambda: isinstance(pilot.app.screen, damaged_chats.MoveAside), "the dialog")
            said.append(str(pilot.app.screen.query_one(".dialog-title").render()))
            for key in keys:
                await (pilot.click(key) if key.startswith("#") else pilot.press(key))

        return asyncio.run(self.run_async(headless=True, size=(100, 30), auto_pilot=answer))

    said: list[str] = []
    monkeypatch.setattr(damaged_chats.Asking, "run", run)
    return said


def run_tui(monkeypatch) -> list[str | None]:
    """The chat command on a terminal up to the chat app's run: the notices it was given."""
    from moechat.app import cli
    from moechat.app.tui import app as app_module

    notices: list[str | None] = []
    monkeypatch.setattr(app_module.MoechatApp, "run", lambda self: notices.append(self.store_notice))
    assert app_module.run_tui(cli.build_parser().parse_args(["chat", "--model", "unused"])) == 0
    return notices


@pytest.mark.notorch
@pytest.mark.parametrize("kind", ["junk", "damaged"])
@pytest.mark.parametrize("answer", ["#move", "m"])
def test_a_junk_or_damaged_database_is_moved_aside_when_the_dialog_says_so(own_dirs, monkeypatch, kind, answer):
    """moechat exited with a line telling the user to move the file by hand before they could chat."""
    path, before = damaged_store(kind)
    said = answering(monkeypatch, answer)
    (notice,) = run_tui(monkeypatch)
    (aside,) = path.parent.glob(f"{path.name}.damaged-*")
    assert aside.read_bytes() == before
    assert "\n" in said[0] and ("is damaged (database disk image is malformed)" if kind == "damaged" else
                                "is not an SQLite file") in said[0]
    assert str(aside) in notice and "\n" not in notice and ".recover" not in notice
    rescued = re.search(rf"(\d+) of (\d+) chats and (\d+) messages rescued from {re.escape(str(aside))}; the file is kept$",
                        notice)
    assert (rescued is not None) == (kind == "damaged")  # junk: nothing to rescue
    with ChatStore(path) as store:  # a new one, where the app reads it: with the chats the first half of the file holds
        chats = [c.title for c in store.conversations()]
        messages = sum(len(store.messages(c.id)) for c in store.conversations())
        assert (len(chats), messages) == ((int(rescued[1]), int(rescued[3])) if rescued else (0, 0))
    if rescued:
        assert int(rescued[1]) == int(rescued[2]) == 60 and 0 < int(rescued[3]) < 60  # the messages of the half cut lost
        assert set(chats) == {f"chat {i}" for i in range(60)}
        asyncio.run(listed(path, chats))


async def listed(path: Path, chats: list[str]) -> None:
    """The app on the rescued chat database lists its chats."""
    async with without_model(path.parent) as (app, pilot):
        await until(pilot, lambda: titles(app.chat) == chats, f"the rescued chats listed ({titles(app.chat)})")


@pytest.mark.notorch
@pytest.mark.parametrize("kind, key", [("junk", "escape"), ("damaged", "escape"), ("junk", "ctrl+c")])
def test_quit_in_the_dialog_leaves_the_file_and_says_the_line(own_dirs, monkeypatch, kind, key):
    """Esc, q, Quit, and Ctrl+C (which did nothing there) quit."""
    from moechat.app.chat_file import DamagedFile

    path, before = damaged_store(kind)
    answering(monkeypatch, key)
    with pytest.raises(DamagedFile) as err:
        run_tui(monkeypatch)
    line = str(err.value)  # today's, as `moechat` says it and exits
    assert "\n" not in line and "move it aside" in line and ".recover" not in line
    assert ("offers at start to move it aside and copy the chats it can still read" in line) == (kind == "damaged")
    assert path.read_bytes() == before and not list(path.parent.glob("*.damaged-*"))


@pytest.mark.notorch
def test_a_newer_moechats_database_asks_nothing_and_says_its_line(own_dirs, monkeypatch):
    """Moving aside a newer moechat's chats (or another program's, a locked or read-only file) would be wrong: no dialog."""
    from moechat.app.chat_migrations import APPLICATION_ID, MIGRATIONS

    path = store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as raw:
        raw.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
        raw.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    said = answering(monkeypatch, "#move")
    with pytest.raises(MoechatError) as err:
        run_tui(monkeypatch)
    assert "newer moechat" in str(err.value) and said == [] and not list(path.parent.glob("*.damaged-*"))


@pilot_test
@pytest.mark.notorch
async def test_where_the_database_went_is_said_in_the_app(tmp_path):
    app = test_tui_chat.make_app(tmp_path, test_tui_chat.failing("no model here"))
    app.store_notice = "the chat database was damaged: moved aside to /x/chats.sqlite3.damaged-1"
    async with app.run_test(size=test_tui_chat.SIZE) as pilot:
        await until(pilot, lambda: errors(app), "the load failure")
        assert [n.message for n in app._notifications if n.severity == "warning"] == [app.store_notice]
