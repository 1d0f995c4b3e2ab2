"""Other chats read and started while a reply streams (app/tui/screens/chat.py, app/tui/live_reply.py): the reply goes on
in the background, stored as it streams and drawn nowhere, its view rebuilt from its text when its chat is opened again;
the chat list marks it; a message sent in another chat waits for it; Esc there stops it; a message refused while its
chat is not shown goes to the input when that chat is opened. Textual's Pilot; one test on a tiny model, the rest with
the engine's messages posted by hand."""
from __future__ import annotations

import threading

import pytest
import test_tui_chat
from test_tui_chat import SIZE, make_app, pilot_test, reply_view, send, still_loading_app, titles, until, without_model
from test_tui_chat_store import asked, contents
from textual import events
from textual.widgets.markdown import MarkdownBlock

from moechat.app.chats import ChatStore
from moechat.app.tui.messages import EngineFailed, ReplyDelta, ReplyFinished, Stats
from moechat.app.tui.widgets.message_view import ChatInput, ChatLog, MessageView

stored = test_tui_chat.stored  # the fixture: two stored conversations, 'older' and 'newer' (the one the app opens)


async def open_chat(pilot, chat, conv_id: int) -> None:
    """The chat picked in the chat list, as a click or Enter there picks it; back once its log is drawn."""
    listed = chat.query_one("#conversations")
    listed.highlighted = listed.get_option_index(str(conv_id))
    listed.action_select()

    def opened() -> bool:
        reply = chat.reply
        live = reply is not None and reply.conv_id == conv_id
        return chat.conv_id == conv_id and bool(chat.query_one(ChatLog).views()) and (not live or reply.view is not None)

    await until(pilot, opened, f"chat {conv_id} opened")
    await pilot.pause()


def role_line(view: MessageView) -> str:
    return view.query_one(".role").render().plain


def notices(app) -> list[str]:
    return [n.message for n in app._notifications]


@pilot_test
async def test_a_reply_streams_on_in_the_background_and_its_chat_opened_again_draws_it_live_then_whole(
        tmp_path, stored, checkpoint, monkeypatch):
    """The engine's tokens let through a few at a time: the reply's chat left mid-reply, more text comes (stored, not
    drawn), the chat opened again shows the text so far and goes on live; its end shows and stores the engine's text."""
    from moechat.app.bridge_meter import ReplyMeter
    from moechat.engine.config import EngineConfig

    older, newer = stored
    gate = threading.Semaphore(0)  # one release per token the engine may write
    meter_tokens = ReplyMeter.tokens
    monkeypatch.setattr(ReplyMeter, "tokens", lambda meter, count: (gate.acquire(timeout=60), meter_tokens(meter, count)))
    path = checkpoint("qwen3_moe", max_position_embeddings=4096)
    app = make_app(tmp_path, lambda: EngineConfig(str(path)), max_new_tokens=48)
    async with app.run_test(size=SIZE) as pilot:
        chat, ends = app.chat, []
        finished = chat.reply_finished
        chat.reply_finished = lambda request_id, text, *rest: (ends.append(text), finished(request_id, text, *rest))[1]
        await until(pilot, lambda: chat.model == path.name, "the engine to load")
        await send(pilot, "What is a mixture of experts model?")
        gate.release(6)
        await until(pilot, lambda: chat.reply is not None and chat.reply.text, "the first words")
        reply = chat.reply
        await open_chat(pilot, chat, older)
        assert reply.view is None and titles(chat) == ["✎ newer", "older"]
        assert contents(chat) == [m.content for m in app.store.messages(older)]  # the other chat alone on screen
        so_far = reply.text
        reply.saved_at = 0.0  # a save due at the next text
        gate.release(10)
        await until(pilot, lambda: len(app.store.messages(newer)[-1].content) > len(so_far), "more text, saved meanwhile")
        saved = app.store.messages(newer)[-1].content
        assert saved.startswith(so_far) and reply.text.startswith(saved)
        assert reply.view is None and contents(chat) == [m.content for m in app.store.messages(older)]

        await open_chat(pilot, chat, newer)
        view = reply.view
        assert chat.reply is reply and view.content == reply.text and role_line(view) == "moechat · writing…"
        assert contents(chat)[-2] == "What is a mixture of experts model?"
        gate.release(1000)
        await until(pilot, lambda: chat.reply is None, "the reply's end")
        (text,) = ends
        last = app.store.messages(newer)[-1]
        assert last.finished and last.content == text == view.content and text.startswith(so_far)
        assert view.answer_source == view.split()[1]  # drawn whole, exactly as the engine ended it
        assert titles(chat) == ["newer", "older"]  # no longer marked


@pilot_test
@pytest.mark.notorch
async def test_a_reply_that_ends_while_its_chat_is_not_shown_is_stored_whole_and_shown_when_opened(tmp_path, stored):
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "a question")
        await until(pilot, lambda: requests == [1], "the request")
        app.post_message(ReplyDelta(1, "<think>\nHmm.\n</think>\n\nThe first"))
        await until(pilot, lambda: chat.reply.text.endswith("first"), "the first words")
        await open_chat(pilot, chat, older)
        whole = "<think>\nHmm.\n</think>\n\nThe first half, then the rest."
        app.post_message(ReplyDelta(1, " half, then the rest."))
        app.post_message(ReplyFinished(1, whole, "length", Stats()))
        await until(pilot, lambda: chat.reply is None, "the reply's end")
        assert chat.conv_id == older and contents(chat) == [m.content for m in app.store.messages(older)]
        assert "✎" not in "".join(titles(chat))
        last = app.store.messages(newer)[-1]
        assert (last.content, last.finished, last.finish) == (whole, True, "length")

        await open_chat(pilot, chat, newer)
        view = chat.query(MessageView).last()
        assert view.content == whole and view.markdown.source == "The first half, then the rest."
        assert role_line(view) == "moechat · cut at the length limit"


@pilot_test
@pytest.mark.notorch
async def test_ctrl_n_mid_reply_opens_a_chat_whose_message_waits_for_the_reply_and_then_streams(tmp_path, stored):
    """The engine serves one request at a time: the new chat's message is stored and shown at once, said to wait, and
    asked for as the other reply ends; a second one meanwhile stays in the input."""
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "first")
        await until(pilot, lambda: requests == [1], "the request")
        app.post_message(ReplyDelta(1, "Part"))
        await pilot.press("ctrl+n")
        await until(pilot, lambda: chat.conv_id not in (older, newer, None), "the new chat")
        new = chat.conv_id
        await send(pilot, "second question")
        await until(pilot, lambda: chat.held is not None, "the message held")
        user = chat.query(MessageView).last()
        assert requests == [1] and chat.held.text == "second question" and chat.query_one(ChatInput).text == ""
        assert role_line(user) == "you · sent when the reply in «newer» ends"
        assert [(m.role, m.content) for m in app.store.messages(new)] == [("user", "second question")]
        assert titles(chat) == ["second question", "✎ newer", "older"]
        await pilot.press(*"third", "enter")
        assert chat.query_one(ChatInput).text == "third"
        assert notices(app)[-1] == "a message already waits for the reply in «newer» to end: send this one after it"

        app.post_message(ReplyDelta(1, " two."))
        app.post_message(ReplyFinished(1, "Part two.", "stop", None))
        await until(pilot, lambda: requests == [1, 2], "the held message's request")
        await until(pilot, lambda: chat.reply is not None and chat.reply.view is not None, "its reply on screen")
        assert chat.reply.conv_id == new and chat.held is None and role_line(user) == "you"
        assert app.store.messages(newer)[-1].content == "Part two." and app.store.messages(newer)[-1].finished
        assert titles(chat) == ["✎ second question", "newer", "older"]
        app.post_message(ReplyFinished(2, "An answer.", "stop", None))
        await until(pilot, lambda: chat.reply is None, "the second reply's end")
        assert contents(chat) == ["second question", "An answer."]


def typed_ahead(app, keys: list[str], text: str) -> None:
    """Keys as a terminal delivers those typed ahead of a slow screen: all at once (Pilot's press waits after each), then
    `text` and Enter."""
    for key, char in [*((key, None) for key in keys), *((c if c != " " else "space", c) for c in text), ("enter", "\r")]:
        app._driver.send_message(events.Key(key, char))


@pilot_test
@pytest.mark.notorch
async def test_a_message_typed_ahead_of_ctrl_n_is_stored_held_and_answered_in_one_chat(tmp_path, stored):
    """Ctrl+N is the app's key, run beside the input's: a message sent while the new chat was being opened was stored in
    the chat left, drawn in the new one's log and held for the new one, whose empty history was asked for at the reply's
    end (the message never answered). Now it goes whole to one chat (the one shown when it reached the screen)."""
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, histories = app.chat, []
        app.bridge.generate = lambda request_id, history, *rest: histories.append([m["content"] for m in history])
        await send(pilot, "first")
        await until(pilot, lambda: len(histories) == 1, "the request")
        app.post_message(ReplyDelta(1, "Part"))
        await open_chat(pilot, chat, older)
        chat.query_one(ChatInput).focus()
        typed_ahead(app, ["ctrl+n"], "typed fast")
        await until(pilot, lambda: chat.held is not None and chat.conv_id not in (older, newer), "the message held")
        held = chat.held
        assert [c for c in app.store.conversations() if "typed fast" in [m.content for m in app.store.messages(c.id)]] == [
            app.store.conversation(held.conv_id)]
        assert contents(chat).count("typed fast") == (1 if held.conv_id == chat.conv_id else 0)
        app.post_message(ReplyFinished(1, "Part two.", "stop", None))
        await until(pilot, lambda: len(histories) == 2, "the held message's request")
        assert chat.reply.conv_id == held.conv_id and histories[1][-1] == "typed fast"


@pilot_test
@pytest.mark.notorch
async def test_enter_typed_right_after_ctrl_n_in_the_chat_being_written_sends_to_the_new_chat(tmp_path, stored):
    """Ctrl+N reached the app only once it had passed up from the input, after the Enter typed behind it: the input
    asked the screen, which still showed the chat being written, and refused the message ("a reply is being written"),
    its text left in the input. Now Ctrl+N runs first: the message goes to the new chat, answered when the reply ends."""
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, histories = app.chat, []
        app.bridge.generate = lambda request_id, history, *rest: histories.append([m["content"] for m in history])
        await send(pilot, "first")
        await until(pilot, lambda: len(histories) == 1, "the request")
        app.post_message(ReplyDelta(1, "Part"))
        await until(pilot, lambda: chat.reply.text == "Part", "the reply's text")
        typed_ahead(app, ["ctrl+n"], "quick one")
        await until(pilot, lambda: chat.held is not None or len(notices(app)) > 1, "the message held or refused")
        assert notices(app) == ["no model here"] and chat.query_one(ChatInput).text == ""
        assert chat.conv_id not in (older, newer) and chat.held.conv_id == chat.conv_id and contents(chat) == ["quick one"]
        app.post_message(ReplyFinished(1, "Part two.", "stop", None))
        await until(pilot, lambda: len(histories) == 2, "the held message's request")
        assert histories[1] == ["quick one"] and chat.reply.conv_id == chat.conv_id


@pilot_test
@pytest.mark.notorch
async def test_enter_typed_right_after_esc_is_held_for_the_stop(tmp_path, stored):
    """The same for Esc: the message typed behind it was refused with "Esc stops it" (Esc had not reached the app yet)."""
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests, stops = app.chat, asked(app), []
        app.bridge.stop = lambda: stops.append(1)
        await send(pilot, "first")
        await until(pilot, lambda: requests == [1], "the request")
        app.post_message(ReplyDelta(1, "Part"))
        await until(pilot, lambda: chat.reply.text == "Part", "the reply's text")
        typed_ahead(app, ["escape"], "next")
        await until(pilot, lambda: chat.held is not None or len(notices(app)) > 1, "the message held or refused")
        assert notices(app) == ["no model here"] and chat.query_one(ChatInput).text == "" and stops == [1]
        assert chat.held.text == "next" and role_line(chat.reply.view) == "moechat · stopping… your message is sent next"


@pilot_test
@pytest.mark.notorch
@pytest.mark.parametrize("so_far", ["Alpha beta\ngamma delta", "- Alpha beta\n- gamma delta", "Alpha beta\u2028gamma delta"])
async def test_a_reply_opened_again_mid_stream_keeps_the_first_lines_of_its_last_block(tmp_path, stored, so_far):
    """Textual's Markdown.update counts the text's lines as if its last block were its last line, and an append after it
    parses only from there: the rebuilt view of a reply that went on lost the first lines of its last block (a
    paragraph's, a list's first items) until the reply ended."""
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "first")
        await until(pilot, lambda: requests == [1], "the request")
        app.post_message(ReplyDelta(1, so_far))  # a line break, a list, a character Python's splitlines breaks at
        await until(pilot, lambda: chat.reply.text.endswith("delta"), "the first words")
        await open_chat(pilot, chat, older)
        await open_chat(pilot, chat, newer)
        app.post_message(ReplyDelta(1, " epsilon"))
        await until(pilot, lambda: chat.reply.text.endswith("epsilon"), "more words")
        await pilot.pause(0.3)  # the stream's append, drawn
        blocks = chat.reply.view.markdown.query(MarkdownBlock)
        drawn = " ".join(str(block.render()) for block in blocks if not block.query_children(MarkdownBlock))
        assert [word for word in drawn.split() if word.isalpha()] == ["Alpha", "beta", "gamma", "delta", "epsilon"]


@pilot_test
@pytest.mark.notorch
async def test_esc_in_another_chat_stops_the_reply_being_written_and_says_which(tmp_path, stored):
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests, stops = app.chat, asked(app), []
        app.bridge.stop = lambda: stops.append(1)
        await send(pilot, "first")
        await until(pilot, lambda: requests == [1], "the request")
        app.post_message(ReplyDelta(1, "Half"))
        await open_chat(pilot, chat, older)
        await pilot.press("escape")
        assert stops == [1] and notices(app)[-1] == "stopping the reply in «newer»"
        app.post_message(ReplyFinished(1, "Half", "cancelled", None))
        await until(pilot, lambda: chat.reply is None, "the stop to land")
        await open_chat(pilot, chat, newer)
        assert contents(chat)[-1] == "Half" and role_line(chat.query(MessageView).last()) == "moechat · stopped"


@pilot_test
@pytest.mark.notorch
async def test_quitting_mid_reply_with_another_chat_shown_keeps_the_reply_as_far_as_it_got(tmp_path, stored):
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "first")
        await until(pilot, lambda: requests == [1], "the request")
        app.post_message(ReplyDelta(1, "So far"))
        await open_chat(pilot, chat, older)
        app.post_message(ReplyDelta(1, " and on"))
        await until(pilot, lambda: chat.reply.text == "So far and on", "the text written in the background")
        await app.action_quit()
    assert app.unsaved_replies == []
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        assert [(m.role, m.content, m.finished) for m in store.messages(newer)][-2:] == [
            ("user", "first", True), ("assistant", "So far and on", False)]


@pilot_test
@pytest.mark.notorch
async def test_a_message_refused_while_its_chat_is_not_shown_goes_to_the_input_when_it_is_opened(tmp_path, stored):
    """One input for every chat: the text typed in the chat shown stays as it is; the refused message comes back with
    its own chat, after what is typed then, and one whose chat is never opened again is printed at quit."""
    older, newer = stored
    refusal = "the prompt has 300 tokens but the context holds 128"
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "far too long")
        await until(pilot, lambda: requests == [1], "the request")
        await open_chat(pilot, chat, older)
        box = chat.query_one(ChatInput)
        box.text = "a draft here"
        app.post_message(EngineFailed(refusal, 1, request_fault=True))
        await until(pilot, lambda: chat.reply is None, "the refusal")
        assert notices(app)[-1] == f"{refusal}; your message goes back to the input when you open «newer»"
        assert box.text == "a draft here" and "far too long" not in [m.content for m in app.store.messages(newer)]
        assert len(app.store.messages(newer)) == 2  # nor its empty reply

        await open_chat(pilot, chat, newer)
        assert box.text == "a draft here\n\nfar too long" and "far too long" not in contents(chat)
        box.text = ""
        box.focus()  # not a click: the notice's toast lies over the input
        await pilot.press(*"also too long", "enter")
        await until(pilot, lambda: requests == [1, 2], "the second request")
        await open_chat(pilot, chat, older)
        app.post_message(EngineFailed(refusal, 2, request_fault=True))
        await until(pilot, lambda: chat.reply is None, "the second refusal")
        await app.action_quit()
    assert app.unsaved_replies == [("your message was refused (too long for the context) and its chat not opened since",
                                    "also too long")]


@pilot_test
@pytest.mark.notorch
async def test_regenerate_and_delete_while_a_reply_is_written_elsewhere(tmp_path, stored):
    """Regenerate in another chat is held (one request at a time), and goes with its chat; deleting another chat is not
    refused, deleting the chat being written is (Esc stops it first). Deleting the chat shown opens the reply's, rebuilt
    live."""
    from moechat.app.tui.screens.dialogs import Confirm

    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "first")
        await until(pilot, lambda: requests == [1], "the request")
        app.post_message(ReplyDelta(1, "Some words"))
        await open_chat(pilot, chat, older)
        await pilot.press("ctrl+r")
        assert requests == [1] and chat.held is not None and chat.held.conv_id == older
        await pilot.press("f8")
        await until(pilot, lambda: isinstance(app.screen, Confirm), "the delete dialog")
        await pilot.press("y")
        await until(pilot, lambda: chat.conv_id == newer and chat.reply.view is not None, "the reply's chat opened")
        assert [c.id for c in app.store.conversations()] == [newer] and contents(chat)[-1] == "Some words"
        assert chat.held is None  # the regeneration went with its chat
        await pilot.press("f8")
        assert app.screen is chat and notices(app)[-1] == "a reply is being written: Esc stops it"
        app.post_message(ReplyDelta(1, " and more"))
        app.post_message(ReplyFinished(1, "Some words and more", "stop", None))
        await until(pilot, lambda: chat.reply is None, "the reply's end")
        assert contents(chat)[-1] == "Some words and more" == app.store.messages(newer)[-1].content
        await pilot.pause()
        assert requests == [1]  # nothing held was asked for


@pilot_test
@pytest.mark.notorch
async def test_regenerate_in_another_chat_waits_for_the_reply_and_then_replaces_the_old_reply(tmp_path, stored):
    """It was refused ("a reply is being written in «newer»"). Held as a message sent there is: said on the message whose
    reply is written again, one held thing at a time (a message then, or a second Regenerate, says what waits), asked for
    at the reply's end; Regenerate in the chat being written stays refused."""
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "first")
        await until(pilot, lambda: requests == [1], "the request")
        app.post_message(ReplyDelta(1, "Some words"))
        await until(pilot, lambda: chat.reply.text == "Some words", "the reply's text")
        await pilot.press("ctrl+r")
        assert requests == [1] and chat.held is None and notices(app)[-1] == "a reply is being written: Esc stops it"
        await open_chat(pilot, chat, older)
        await pilot.press("ctrl+r")
        asking, old = chat.query(MessageView)[-2:]
        assert requests == [1] and (chat.held.conv_id, chat.held.message_id, chat.held.text) == (older, asking.message_id, None)
        assert role_line(asking) == "you · its reply is written again when the reply in «newer» ends"
        assert role_line(old) == "moechat" and contents(chat) == [m.content for m in app.store.messages(older)]
        await pilot.press("ctrl+r")
        assert notices(app)[-1] == "a regeneration already waits for the reply in «newer» to end: regenerate after it"
        chat.query_one(ChatInput).focus()
        await pilot.press(*"a question", "enter")
        assert chat.query_one(ChatInput).text == "a question" and len(app.store.messages(older)) == 2
        assert notices(app)[-1] == "a regeneration already waits for the reply in «newer» to end: send this one after it"
        await open_chat(pilot, chat, newer)  # said on its message wherever its chat is opened again
        await open_chat(pilot, chat, older)
        assert role_line(chat.query(MessageView)[-2]) == "you · its reply is written again when the reply in «newer» ends"

        app.post_message(ReplyFinished(1, "Some words.", "stop", None))
        await until(pilot, lambda: requests == [1, 2], "the regeneration's request")
        await until(pilot, lambda: chat.reply is not None and chat.reply.view is not None, "its reply on screen")
        assert chat.held is None and chat.reply.conv_id == older and chat.reply.replaces.id == old.message_id
        assert contents(chat) == ["show me code", ""] and role_line(chat.query(MessageView)[0]) == "you"
        app.post_message(ReplyDelta(2, "Fresh."))
        app.post_message(ReplyFinished(2, "Fresh.", "stop", None))
        await until(pilot, lambda: chat.reply is None, "the regeneration's end")
        assert [(m.role, m.content) for m in app.store.messages(older)] == [("user", "show me code"), ("assistant", "Fresh.")]
        assert app.store.messages(newer)[-1].content == "Some words."


@pilot_test
@pytest.mark.notorch
async def test_a_message_held_then_regenerate_says_what_waits(tmp_path, stored):
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "first")
        await until(pilot, lambda: requests == [1], "the request")
        await open_chat(pilot, chat, older)
        await send(pilot, "second")
        await until(pilot, lambda: chat.held is not None, "the message held")
        await pilot.press("ctrl+r")
        assert chat.held.text == "second"
        assert notices(app)[-1] == "a message already waits for the reply in «newer» to end: regenerate after it"


@pilot_test
@pytest.mark.notorch
async def test_a_regeneration_whose_chat_another_window_deleted_is_said_and_not_asked_for(tmp_path, stored, monkeypatch):
    from moechat.app.tui.screens import chat as chat_screen

    monkeypatch.setattr(chat_screen, "CHECK_S", 3600.0)  # the screen does not look meanwhile: the held turn finds it gone
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "first")
        await until(pilot, lambda: requests == [1], "the request")
        await open_chat(pilot, chat, older)
        await pilot.press("ctrl+r")
        assert chat.held is not None
        with ChatStore(tmp_path / "chats.sqlite3") as other:
            other.delete(older)
        app.post_message(ReplyFinished(1, "Done.", "stop", None))
        await until(pilot, lambda: chat.held is None and chat.reply is None, "the held turn")
        await until(pilot, lambda: "the chat of your waiting regeneration was deleted" in notices(app), "the notice")
        assert requests == [1]


@pilot_test
@pytest.mark.notorch
async def test_quitting_with_a_regeneration_held_leaves_its_chat_as_it_was(tmp_path, stored):
    """The regeneration never started: the old reply stays, finished, and the chat has no note of a missing reply."""
    older, newer = stored
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        before = [(m.id, m.role, m.content, m.finished) for m in store.messages(older)]
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        await send(pilot, "first")
        await until(pilot, lambda: requests == [1], "the request")
        app.post_message(ReplyDelta(1, "So far"))
        await open_chat(pilot, chat, older)
        await pilot.press("ctrl+r")
        assert chat.held is not None and chat.held.text is None
        await app.action_quit()
    assert app.unsaved_replies == [] and requests == [1]
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        assert [(m.id, m.role, m.content, m.finished) for m in store.messages(older)] == before
    async with without_model(tmp_path) as (app, pilot):
        await open_chat(pilot, app.chat, older)
        assert [role_line(view) for view in app.chat.query(MessageView)] == ["you", "moechat"]


@pilot_test
@pytest.mark.notorch
async def test_a_regeneration_left_and_opened_again_then_stopped_gives_the_old_reply_back_in_its_place(tmp_path, stored):
    """The old reply stays stored until the new one has text: not shown beside it when its chat is opened again, and
    back before the message sent while the regeneration stopped."""
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        app.bridge.stop = lambda: None  # the engine's step in progress goes on
        await pilot.press("ctrl+r")
        await until(pilot, lambda: requests == [1], "the regeneration")
        await open_chat(pilot, chat, older)
        await open_chat(pilot, chat, newer)
        assert contents(chat) == ["hello there", ""]  # the new reply, empty so far; not the one it replaces
        await pilot.press("escape")
        chat.query_one(ChatInput).focus()
        await pilot.press(*"next", "enter")
        assert contents(chat) == ["hello there", "", "next"] and "your message is sent next" in role_line(chat.reply.view)
        app.post_message(ReplyFinished(1, "", "cancelled", None))
        await until(pilot, lambda: requests == [1, 2], "the held message's request")
        await until(pilot, lambda: len(contents(chat)) == 4, "its reply's view")
        assert contents(chat) == ["hello there", "Hello! How are you today?", "next", ""]
        assert [m.content for m in app.store.messages(newer)] == contents(chat)


@pilot_test
@pytest.mark.notorch
async def test_the_chat_being_written_deleted_in_another_window_stops_the_reply_with_a_notice(tmp_path, stored):
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests, stops = app.chat, asked(app), []
        app.bridge.stop = lambda: stops.append(1)
        await send(pilot, "first")
        await until(pilot, lambda: requests == [1], "the request")
        await open_chat(pilot, chat, older)
        with ChatStore(tmp_path / "chats.sqlite3") as other:
            other.delete(newer)
        await chat.check_elsewhere()  # the CHECK_S timer's call
        assert stops == [1] and titles(chat) == ["older"] and chat.conv_id == older
        said = "the chat being written was deleted in another moechat window: the reply is not kept"
        await until(pilot, lambda: said in notices(app), "the notice")
        app.post_message(ReplyFinished(1, "Gone", "cancelled", None))
        await until(pilot, lambda: chat.reply is None, "the reply's end")
        assert app.is_running and contents(chat) == [m.content for m in app.store.messages(older)]


@pytest.mark.notorch
def test_snapshot_a_reply_written_in_another_chat(tmp_path, stored, snap_compare):
    """The chat list marks the chat a reply is being written into while another is read."""
    older, _ = stored
    app = still_loading_app(tmp_path)

    async def ready(pilot):
        await until(pilot, lambda: app.chat.state.startswith("loading"), "the loading state")
        await reply_view(app.chat, 1)
        app.post_message(ReplyDelta(1, "Being written"))
        await open_chat(pilot, app.chat, older)

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


@pilot_test
@pytest.mark.notorch
async def test_a_chat_left_without_a_reply_says_so_and_ctrl_r_answers_it(tmp_path, stored):
    """moechat quit (or was killed) before a message's reply came, or before a held message's turn: opened again, the
    message says it has no reply yet and which key asks for one; the reply's start takes the note away."""
    from moechat.app.tui.screens.held import UNANSWERED

    older, newer = stored
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        store.add(older, "user", "and one more?")
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        assert chat.conv_id == older  # the chat written last opens at start
        await open_chat(pilot, chat, newer)
        assert role_line(chat.query(MessageView).last()) == "moechat"  # answered: no note
        await open_chat(pilot, chat, older)
        asking = chat.query(MessageView).last()
        assert asking.content == "and one more?" and role_line(asking) == f"you · {UNANSWERED}"
        await pilot.press("ctrl+r")
        await until(pilot, lambda: requests == [1], "the request")
        assert role_line(asking) == "you" and chat.reply is not None


@pilot_test
@pytest.mark.notorch
async def test_ctrl_n_on_a_chat_still_new_makes_no_second_empty_one(tmp_path, stored):
    """Each Ctrl+N stored a "New chat": pressed again (and again) on one with no message, it stays there."""
    async with without_model(tmp_path) as (app, pilot):
        chat = app.chat
        await pilot.press("ctrl+n")
        await until(pilot, lambda: len(titles(chat)) == 3, "the new chat listed")
        new = chat.conv_id
        await pilot.press("ctrl+n", "ctrl+n")
        await pilot.pause()
        assert chat.conv_id == new and len(app.store.conversations()) == 3
        await send(pilot, "hello")  # a message: the next Ctrl+N makes another
        await pilot.press("ctrl+n")
        await until(pilot, lambda: len(app.store.conversations()) == 4, "a second new chat")


@pilot_test
@pytest.mark.notorch
async def test_a_message_sent_in_an_older_chat_moves_it_to_the_top_of_the_list(tmp_path, stored):
    """The list is most recently written first, as it reads after a restart; a send left it where it was until then."""
    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat, requests = app.chat, asked(app)
        assert [id for id, _ in chat.listed] == [str(newer), str(older)]
        await open_chat(pilot, chat, older)
        await send(pilot, "one more question")
        await until(pilot, lambda: requests == [1], "the request")
        assert [id for id, _ in chat.listed] == [str(older), str(newer)]
        assert chat.query_one("#conversations").highlighted == 0  # the highlight went with it
