"""Two moechat windows on one chat database (app/tui/screens/chat.py's follow_elsewhere, app/reply_locks.py): the reply one
window writes is shown in the other as being written, follows its saves and its end, and reads as interrupted once its
writer is gone (quit, or killed); the chat list marks the chats another window writes into, and a second reply into such a
chat is refused. Two apps in one process, as two windows (or a second ChatStore); a killed writer in a process of its own."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import test_tui_chat
from test_tui_chat import pilot_test, send, titles, until, without_model
from test_tui_chat_store import asked, contents
from test_tui_chat_switch import notices, open_chat, role_line

import moechat
from moechat.app.chat_export import export_markdown
from moechat.app.chat_text import WRITING_HERE, WRITING_HERE_ELSEWHERE, WRITTEN_ELSEWHERE
from moechat.app.chats import ChatStore
from moechat.app.tui.messages import ReplyDelta, ReplyFinished
from moechat.app.tui.widgets.message_view import ChatInput, MessageView

stored = test_tui_chat.stored  # the fixture: two stored conversations, 'older' and 'newer' (the one the app opens)


@pytest.fixture(autouse=True)
def checks_often(monkeypatch):
    """The windows look for each other's writes every 0.1 s, not CHECK_S: the tests wait for what the look shows."""
    from moechat.app.tui.screens import chat

    monkeypatch.setattr(chat, "CHECK_S", 0.1)


def last_view(app) -> MessageView:
    return app.chat.query(MessageView).last()


def last_line(app) -> tuple[str, str]:
    """The chat's last message as shown: its text and its role line."""
    view = last_view(app)
    return view.content, role_line(view)


@pilot_test
@pytest.mark.notorch
async def test_a_reply_another_window_writes_is_shown_being_written_follows_its_saves_and_ends(tmp_path, stored):
    """It showed as "interrupted" and stayed as first read (the second window watched the chat list only), and a message
    sent there did not appear at all."""
    older, newer = stored
    async with without_model(tmp_path) as (first, pilot), without_model(tmp_path) as (second, other):
        requests, reading = asked(first), second.chat
        assert first.chat.conv_id == reading.conv_id == newer
        await send(pilot, "a question")
        await until(pilot, lambda: requests == [1], "the request")
        first.post_message(ReplyDelta(1, "The first"))
        await until(pilot, lambda: first.chat.reply.text == "The first", "the first words")
        # its text comes at its first save, which a loaded machine may have made before this window looked
        await until(other, lambda: contents(reading)[-2:] in (["a question", ""], ["a question", "The first"]),
                    "the other window's message and reply")
        assert role_line(last_view(second)) == f"moechat · {WRITTEN_ELSEWHERE}"

        first.chat.reply.saved_at = 0.0  # a save due at the next text
        first.post_message(ReplyDelta(1, " words, and"))
        await until(other, lambda: last_line(second) == ("The first words, and", f"moechat · {WRITTEN_ELSEWHERE}"), "its save")
        assert last_view(second).markdown.source == "The first words, and"
        assert export_markdown(second.store, newer).endswith(f"The first words, and\n\n*({WRITTEN_ELSEWHERE})*\n")  # alike

        await open_chat(other, reading, older)  # opened again: as being written, not interrupted
        await open_chat(other, reading, newer)
        assert contents(reading)[-1] == "The first words, and"
        assert role_line(last_view(second)) == f"moechat · {WRITTEN_ELSEWHERE}"

        first.post_message(ReplyFinished(1, "The first words, and the rest.", "length", None))
        await until(other, lambda: last_line(second) == ("The first words, and the rest.", "moechat · cut at the length limit"),
                    "its end")


@pilot_test
@pytest.mark.notorch
async def test_a_reply_whose_window_quit_mid_reply_reads_as_interrupted_in_the_other(tmp_path, stored):
    older, newer = stored
    async with without_model(tmp_path) as (second, other):
        async with without_model(tmp_path) as (first, pilot):
            requests = asked(first)
            await send(pilot, "a question")
            await until(pilot, lambda: requests == [1], "the request")
            first.post_message(ReplyDelta(1, "Half"))
            await until(pilot, lambda: first.chat.reply.text == "Half", "the first words")
            # the other window may read the store before or after the first saves its words: "" or "Half" then
            await until(other, lambda: last_line(second) in {(text, f"moechat · {WRITTEN_ELSEWHERE}") for text in ("", "Half")},
                        "the reply being written")
            await first.action_quit()
        await until(other, lambda: last_line(second) == ("Half", "moechat · interrupted"), "the reply interrupted")


@pilot_test
@pytest.mark.notorch
async def test_a_message_or_regenerate_into_a_chat_another_window_writes_is_refused_the_text_kept(tmp_path, stored):
    """Window 2 started a second reply into the chat window 1 was writing: the two replies interleaved the conversation."""
    older, newer = stored
    async with without_model(tmp_path) as (first, pilot), without_model(tmp_path) as (second, other):
        requests, theirs, box = asked(first), asked(second), second.chat.query_one(ChatInput)
        await send(pilot, "a question")
        await until(pilot, lambda: requests == [1], "the request")
        await until(other, lambda: contents(second.chat)[-2:] == ["a question", ""], "the other window's reply")
        before = len(notices(second))
        await send(other, "me too")
        await until(other, lambda: len(notices(second)) > before, "the refusal")
        assert notices(second)[before:] == [WRITING_HERE_ELSEWHERE] and box.text == "me too" and theirs == []
        await other.press("ctrl+r")
        await until(other, lambda: len(notices(second)) > before + 1, "the regeneration refused")
        assert notices(second)[before + 1:] == [WRITING_HERE_ELSEWHERE] and theirs == []
        assert [m.content for m in second.store.messages(newer)][-3:] == ["Hello! How are you today?", "a question", ""]

        first.post_message(ReplyFinished(1, "An answer.", "stop", None))
        await until(other, lambda: last_line(second) == ("An answer.", "moechat"), "its end")
        await other.press("enter")  # once it ended: sent
        await until(other, lambda: theirs == [1], "the message's request")
        assert contents(second.chat)[-2:] == ["me too", ""] and box.text == ""


@pilot_test
@pytest.mark.notorch
async def test_the_chat_list_marks_the_chats_another_window_writes_into_until_it_ends_or_its_writer_is_gone(tmp_path, stored):
    """Only the chat on screen said so; the list marked this window's own reply alone."""
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        await open_chat(pilot, app.chat, older)
        with ChatStore(tmp_path / "chats.sqlite3") as writer:  # another window, or plain chat
            reply = writer.add(newer, "assistant", "", finished=False)
            await until(pilot, lambda: titles(app.chat) == ["✎ newer", "older"], "the chat marked")
            writer.update(reply, "done", finished=True, finish="stop")
            await until(pilot, lambda: titles(app.chat) == ["newer", "older"], "the mark gone at its end")
            writer.add(older, "user", "and?")
            writer.add(older, "assistant", "", finished=False)
            await until(pilot, lambda: titles(app.chat) == ["✎ older", "newer"], "the other chat marked")
        # closed mid-reply (quit, or killed): nothing in the file changes, its lock goes
        await until(pilot, lambda: titles(app.chat) == ["older", "newer"], "the mark gone with its writer")
        assert last_line(app) == ("", "moechat · interrupted")


@pilot_test
@pytest.mark.notorch
async def test_a_held_message_whose_chat_another_window_began_writing_into_meanwhile_is_not_answered(tmp_path, stored):
    """Held while this window wrote in another chat, it was answered at that reply's end beside the other window's reply."""
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        requests, chat = asked(app), app.chat
        await send(pilot, "a question")
        await until(pilot, lambda: requests == [1], "the request")
        await open_chat(pilot, chat, older)
        await send(pilot, "held one")
        await until(pilot, lambda: chat.held is not None, "the message held")
        with ChatStore(tmp_path / "chats.sqlite3") as writer:  # another window begins a reply in that chat
            writer.add(older, "assistant", "", finished=False)
            await until(pilot, lambda: contents(chat)[-2:] == ["held one", ""] and last_view(app).elsewhere,
                        "the other window's reply")  # (not its role line: the log may be mounting)
            app.post_message(ReplyFinished(1, "An answer.", "stop", None))
            await until(pilot, lambda: chat.reply is None and chat.held is None, "this window's reply's end")
            assert requests == [1] and "your waiting message is not answered" in notices(app)[-1]
            (held,) = [view for view in chat.query(MessageView) if view.content == "held one"]
            assert role_line(held) == "you"  # no longer "sent when the reply in «newer» ends"


_WRITER = """
import sys, time
from moechat.app.chats import ChatStore
store = ChatStore(sys.argv[1])
reply = store.add(int(sys.argv[2]), "assistant", "", finished=False)
store.update(reply, "a reply whose writer is killed", finished=False)
print(reply, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
@pilot_test
@pytest.mark.notorch
async def test_a_reply_whose_writer_was_killed_reads_as_interrupted_not_written_forever(tmp_path, stored):
    """A writer that crashes saves nothing more and says nothing: its lock, which the OS drops with the process, does."""
    older, newer = stored
    env = dict(os.environ, PYTHONPATH=str(Path(moechat.__file__).resolve().parents[1]))
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / "chats.sqlite3"), str(newer)],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert int(writer.stdout.readline())  # its reply stored, and locked
        async with without_model(tmp_path) as (app, pilot):
            assert last_line(app) == ("a reply whose writer is killed", f"moechat · {WRITTEN_ELSEWHERE}")
            writer.send_signal(signal.SIGKILL)
            writer.wait(timeout=30)
            await until(pilot, lambda: last_line(app) == ("a reply whose writer is killed", "moechat · interrupted"),
                        "the reply interrupted")
    finally:
        writer.kill()
        writer.wait()
        writer.stdout.close()
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        assert not store.messages(newer)[-1].finished


@pilot_test
@pytest.mark.notorch
async def test_regenerate_between_a_sends_claim_and_its_reply_is_refused(tmp_path, stored):
    """Ctrl+R is the app's key, so it runs while the chat screen awaits a send's drawing: after the send claimed its
    reply, before the screen recorded it, Regenerate saw no reply and claimed a second one into the chat."""
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        mount_reply, met = chat.mount_reply, []

        async def regenerate_meanwhile(*args):
            if not met:
                met.append(await chat.regenerate())  # as Ctrl+R arriving here
            return await mount_reply(*args)

        chat.mount_reply = regenerate_meanwhile
        await send(pilot, "a question")
        await until(pilot, lambda: requests == [1], "the request")
        await pilot.pause()
        assert met and requests == [1]
        assert [m.content for m in app.store.messages(newer) if not m.finished] == [""]  # one reply, the send's
        assert WRITING_HERE in notices(app)
