"""The chat app (`app/tui/app.py`, `screens/chat.py`) driven with Textual's Pilot against the real
engine thread and a tiny model: streaming, storing, stopping, chatting again, switching, exporting,
help, failures as notifications, the command line's TTY switch, and a snapshot of the chat screen."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import threading
import time
from pathlib import Path

import pytest

from moechat.app.chats import ChatStore
from moechat.app.tui.app import MoechatApp
from moechat.app.tui.screens.help import HelpScreen
from moechat.app.tui.widgets.message_view import LOG_CHARS, ChatLog, MessageView, last_code_block, window_start
from moechat.engine.config import EngineConfig, SamplingParams
from moechat.engine.errors import MoechatError

SIZE = (120, 40)


def make_app(tmp_path: Path, factory, max_new_tokens: int = 8) -> MoechatApp:
    return MoechatApp(factory, SamplingParams(max_new_tokens=max_new_tokens), store_path=tmp_path / "chats.sqlite3",
                      export_dir=tmp_path / "export", settings_file=tmp_path / "settings.toml")


def debug(app) -> str:
    chat = app.chat
    stored = app.store.messages(chat.conv_id) if chat.conv_id else []
    return (f"reply={chat.reply and (chat.reply.request_id, chat.reply.text[:40])} state={chat.state!r} "
            f"stored={[(m.role, m.content[:30], m.finished) for m in stored]} notices={[n.message for n in app._notifications]}")


async def until(pilot, cond, what: str, timeout: float = 120.0) -> None:
    """Wait for cond; the timeout bounds a hang, it times nothing (a loaded 2-core machine took over 30 s to load)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {debug(pilot.app)}"
        await pilot.pause(0.02)


async def send(pilot, text: str) -> None:
    await pilot.click("#input")
    await pilot.press(*text, "enter")


def pilot_test(fn):
    """Run an async test body on its own event loop (the project runs no asyncio pytest plugin)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        asyncio.run(fn(*args, **kwargs))

    return run


def failing(message: str):
    """A config factory that fails to load with `message` (an app with no model)."""
    def factory():
        raise MoechatError(message)

    return factory


@contextlib.asynccontextmanager
async def without_model(tmp_path: Path, size: tuple[int, int] = SIZE):
    """The app on tmp_path's chats with an engine that failed to load (no replies): (app, pilot) once it has said so."""
    app = make_app(tmp_path, failing("no model here"))
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: errors(app), "the load failure")
        yield app, pilot


def errors(app) -> list[str]:
    return [n.message for n in app._notifications if n.severity == "error"]


def titles(chat) -> list[str]:
    """The chat list's titles, top first."""
    return [str(option.prompt) for option in chat.query_one("#conversations").options]


def store_chat(tmp_path: Path, title: str, *messages: tuple[str, str]) -> None:
    """A stored conversation of (role, content) messages, the one the app opens."""
    store = ChatStore(tmp_path / "chats.sqlite3")
    conv = store.create(title)
    for role, content in messages:
        store.add(conv, role, content)
    store.close()


async def reply_view(chat, request_id: int) -> MessageView:
    """A reply begun as start_reply begins one, with no engine: stored unfinished, its view mounted, chat.reply set."""
    from textual.widgets import Markdown

    from moechat.app.tui.live_reply import Reply

    message_id = chat.app.store.add(chat.conv_id, "assistant", "", finished=False)
    view = MessageView("assistant", "", message_id, finished=False)
    await chat.query_one("#log").mount(view)
    chat.reply = Reply(request_id, message_id, chat.conv_id, view, Markdown.get_stream(view.markdown),
                       generation=chat.generation)
    chat.draw_list(chat.listed)  # its chat marked, as start_reply marks it
    return view


@pytest.fixture
def stored(tmp_path):
    """Two stored conversations: 'older' (with a code block) and then 'newer'."""
    store = ChatStore(tmp_path / "chats.sqlite3")
    older = store.create("older")
    store.add(older, "user", "show me code")
    store.add(older, "assistant", "Here:\n\n```python\nprint('moe')\n```\n\nDone.")
    time.sleep(0.01)
    newer = store.create("newer")
    store.add(newer, "user", "hello there")
    store.add(newer, "assistant", "Hello! How are you today?")
    store.close()
    return older, newer


@pilot_test
async def test_chat_streams_stores_stops_and_chats_again(tmp_path, checkpoint, monkeypatch):
    from moechat.app.bridge_meter import ReplyMeter  # torch: not at the top of a module that holds notorch tests

    # The random model may end a reply at EOS a few dozen tokens in, within milliseconds: a reply that must still be
    # streaming when the test acts has each token held on the bridge's thread
    hold = {"s": 0.05}
    meter_tokens = ReplyMeter.tokens
    monkeypatch.setattr(ReplyMeter, "tokens", lambda meter, count: (time.sleep(hold["s"]), meter_tokens(meter, count)))
    path = checkpoint("qwen3_moe", max_position_embeddings=4096)  # room for a reply long enough to stop
    app = make_app(tmp_path, lambda: EngineConfig(str(path)), max_new_tokens=3000)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.chat
        await until(pilot, lambda: chat.model == path.name, "the engine to load")
        assert "policy" in chat.query_one("#status").render().plain  # the ready summary in the status line

        await send(pilot, "What is a mixture of experts model?")
        await until(pilot, lambda: chat.reply is not None and chat.reply.text, "streamed text")
        reply = chat.reply
        (conv,) = app.store.conversations()
        assert conv.title == "What is a mixture of experts model?"
        stored = app.store.messages(conv.id)
        assert [m.role for m in stored] == ["user", "assistant"] and stored[1].finished is False  # stored at its start
        assert reply.view.content == reply.text  # the streaming widget shows the text so far
        await until(pilot, lambda: app.store.messages(conv.id)[1].content, "the reply saved as it streams")
        assert app.store.messages(conv.id)[1].finished is False and chat.reply is reply

        await pilot.press("escape")  # stop mid-reply
        await until(pilot, lambda: chat.reply is None, "the reply to stop")
        stopped = app.store.messages(conv.id)[1]
        assert stopped.finished and stopped.content and stopped.content == reply.view.content
        assert "stopped" in reply.view.query_one(".role").render().plain
        assert chat.stats is not None and chat.stats.new_tokens < 3000

        app.sampling, hold["s"] = SamplingParams(max_new_tokens=6), 0.0
        await send(pilot, "Hello!")
        await until(pilot, lambda: chat.reply is None and len(app.store.messages(conv.id)) == 4, "the second reply")
        messages = app.store.messages(conv.id)
        assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
        assert messages[3].finished and 1 <= messages[3].stats["new_tokens"] <= 6  # random weights: may end early
        views = list(chat.query(MessageView))
        assert [v.content for v in views] == [m.content for m in messages]

        old = views[-1]
        await pilot.press("ctrl+r")  # regenerate: the last reply is replaced, not added to
        await until(pilot, lambda: chat.reply is None and chat.query(MessageView).last() is not old, "the regenerated reply")
        again = app.store.messages(conv.id)
        assert [m.id for m in again[:3]] == [m.id for m in messages[:3]] and len(again) == 4 and again[3].finished
        assert [v.message_id for v in chat.query(MessageView)] == [m.id for m in again]

        status = chat.query_one("#status").render().plain
        assert f"{chat.stats.tokens_per_s:.1f} tok/s" in status and f"{chat.stats.new_tokens} tok" in status  # 120 columns: short
        heatmap, panel = chat.query_one("#heatmap"), chat.query_one("#stats")
        assert heatmap.frame is None and heatmap.draws == 0  # the side panel is hidden: nothing drawn there
        assert panel.stats is chat.stats and "n/a" in panel.query_one("#tps").render().plain
        await pilot.press("f3")  # shown: the newest figures and frame drawn
        await until(pilot, lambda: heatmap.frame is not None, "a heatmap frame")
        assert len(heatmap.frame.utility) == 2  # qwen3_moe's two MoE layers
        assert f"{chat.stats.tokens_per_s:.1f}" in panel.query_one("#tps").render().plain
        await pilot.press("f3")
        assert not errors(app)

        # a new chat: this prompt must not hold the stopped first reply, whose length the stop's timing sets. Its
        # tokens held 0.2 s each, the reply is still being written when the app quits, however fast the engine
        app.sampling, hold["s"] = SamplingParams(max_new_tokens=3000), 0.2
        await pilot.press("ctrl+n")
        await send(pilot, "Go on.")  # ("One more?" had this random model write 118 byte tokens, no text, before its first word)
        await until(pilot, lambda: chat.reply is not None and chat.reply.text, "the last reply to start")
        partial = chat.reply  # quitting now (leaving run_test) keeps what it wrote, unfinished
        assert partial is not None
        last_conv = next(c for c in app.store.conversations() if c.id != conv.id)
    store = ChatStore(tmp_path / "chats.sqlite3")
    last = store.messages(last_conv.id)[-1]
    store.close()
    assert last.id == partial.message_id and not last.finished and last.content.startswith(partial.text)


@pilot_test
@pytest.mark.notorch
async def test_switch_export_help_and_engine_failure(tmp_path, stored):
    older, newer = stored
    app = make_app(tmp_path, failing("no checkpoint at /nowhere: pick a model in the settings"))
    async with app.run_test(size=SIZE) as pilot:
        chat = app.chat
        await until(pilot, lambda: errors(app), "the load failure notification")
        assert "no checkpoint at /nowhere" in errors(app)[0] and app.is_running  # a notice, not a crash
        assert chat.conv_id == newer  # the most recent conversation opens
        assert [v.content for v in chat.query(MessageView)] == ["hello there", "Hello! How are you today?"]

        chat.query_one("#conversations").focus()
        await pilot.press("down", "enter")  # the second in the list: the older one
        await until(pilot, lambda: chat.conv_id == older, "the switch")
        assert [v.role for v in chat.query(MessageView)] == ["user", "assistant"]
        assert chat.query(MessageView).last().content.startswith("Here:")

        app.copy_to_clipboard("")
        await pilot.press("f9")  # the last reply's last code block
        assert app.clipboard == "print('moe')"

        await pilot.press("ctrl+o")
        (exported,) = (tmp_path / "export").glob("*.md")
        assert "older" in exported.name and "print('moe')" in exported.read_text() and "show me code" in exported.read_text()

        await send(pilot, "are you there?")  # the engine has no model: the request fails with a notice
        await until(pilot, lambda: len(errors(app)) == 2 and chat.reply is None, "the request failure")
        assert "no model is loaded" in errors(app)[1] and "no checkpoint at /nowhere" in errors(app)[1]  # why: its notice went by
        assert [m.content for m in app.store.messages(older)][-1] == "are you there?"  # the empty reply is dropped

        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        assert "ctrl+n" in app.screen.query_one("Markdown").source.lower()
        assert "| Ctrl+Q | quit" in app.screen.query_one("Markdown").source  # how to leave: in no footer
        await pilot.press("escape")
        assert app.screen is chat

        await pilot.press("ctrl+p", *"expert view", "enter")  # the command palette's own entry
        await until(pilot, lambda: chat.query_one("#side-panel").display, "the expert view")
        assert chat.query_one("#heatmap") and chat.query_one("#stats")

        await pilot.press("ctrl+n")
        await until(pilot, lambda: len(app.store.conversations()) == 3, "the new chat")
        assert chat.conv_id not in (older, newer) and not list(chat.query(MessageView))


@pilot_test
@pytest.mark.notorch
async def test_titles_that_look_like_markup_show_as_typed(tmp_path):
    """A title is the user's text: `[/INST]` once crashed the sidebar at every start, and the delete dialog too."""
    from moechat.app.tui.screens.dialogs import Confirm

    store_chat(tmp_path, "What does [/INST] mean?", ("user", "What does [/INST] mean?"), ("assistant", "A tag."))
    async with without_model(tmp_path) as (app, pilot):
        assert titles(app.chat) == ["What does [/INST] mean?"]
        app.store.rename(app.chat.conv_id, "[/x] notes [b]")
        await app.chat.refresh_conversations()
        assert titles(app.chat) == ["[/x] notes [b]"]
        app.action_delete_chat()
        await pilot.pause()
        assert isinstance(app.screen, Confirm) and "[/x] notes [b]" in str(app.screen.query_one(".dialog-title").content)
        await pilot.press("escape")
        assert app.is_running and app.return_code is None


@pilot_test
@pytest.mark.notorch
async def test_the_delete_dialog_asks_about_a_long_title_whole(tmp_path):
    """Its question ran off the dialog's right edge: a renamed chat's long title lost its end, and the question mark."""
    long = "a chat renamed to a title that says a great deal more than forty characters"
    store_chat(tmp_path, long, ("user", "hi"))
    async with without_model(tmp_path, (60, 20)) as (app, pilot):
        app.action_delete_chat()
        await pilot.pause()
        question = app.screen.query_one(".dialog-title")
        shown = " ".join(question.render_line(y).text.strip() for y in range(question.size.height))
        assert shown == f"Delete “{long}”?" and question.region.right <= app.screen.query_one(".dialog").region.right


@pilot_test
@pytest.mark.notorch
async def test_text_typed_while_a_reply_streams_stays_in_the_input(tmp_path, stored):
    from moechat.app.tui.widgets.message_view import ChatInput

    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        chat = app.chat
        await reply_view(chat, 1)  # a reply being written
        before = len(app.store.messages(chat.conv_id))
        await send(pilot, "next question")
        assert chat.query_one(ChatInput).text == "next question"  # refused, not thrown away
        assert any("a reply is being written" in n.message for n in app._notifications)
        assert len(app.store.messages(chat.conv_id)) == before
        stops = []
        app.bridge.stop = lambda: stops.append(1)
        await pilot.press("ctrl+c")  # in the input, nothing selected: stops the reply
        chat.query_one("#log").focus()
        await pilot.press("ctrl+c")  # elsewhere: the app's Ctrl+C stops it too
        assert stops == [1, 1]
        conversations = chat.query_one("#conversations")
        conversations.focus()
        await pilot.press("down", "enter")  # another chat: opened, the reply goes on in the background
        await until(pilot, lambda: chat.conv_id == older, "the other chat")
        assert chat.reply.view is None and titles(chat) == ["✎ newer", "older"]  # the chat being written marked


@pilot_test
@pytest.mark.notorch
async def test_quitting_before_a_reply_has_text_keeps_no_empty_reply_and_invisible_text_is_not_sent(tmp_path, stored):
    from moechat.app.tui.widgets.message_view import visible

    assert not visible(" \u200b\n\u2060") and visible("a\u200b")
    async with without_model(tmp_path) as (app, pilot):
        chat = app.chat
        conv, before = chat.conv_id, [m.id for m in app.store.messages(chat.conv_id)]
        await send(pilot, "\u200b")  # a zero-width space alone: nothing to send
        assert [m.id for m in app.store.messages(conv)] == before
        await reply_view(chat, 1)  # its prompt still being read when the app quits
    store = ChatStore(tmp_path / "chats.sqlite3")
    assert [m.id for m in store.messages(conv)] == before  # no empty "interrupted" bubble on the next start
    store.close()


@pilot_test
@pytest.mark.notorch
async def test_a_stopped_reply_still_says_so_after_a_restart(tmp_path, stored):
    """A reply stopped with Esc showed as stopped while the app ran, and as a plain, complete reply at the next start."""
    from moechat.app.tui.messages import ReplyDelta, ReplyFinished, Stats

    def notes(app) -> list[str]:
        return [view.query_one(".role").render().plain for view in app.chat.query(MessageView)]

    ends = [("cancelled", "moechat · stopped"), ("length", "moechat · cut at the length limit"), ("stop", "moechat")]
    async with without_model(tmp_path) as (app, pilot):
        for request_id, (reason, _) in enumerate(ends, 1):
            await reply_view(app.chat, request_id)
            app.post_message(ReplyDelta(request_id, f"reply {request_id}"))
            app.post_message(ReplyFinished(request_id, f"reply {request_id}", reason, Stats()))
            await until(pilot, lambda: app.chat.reply is None, "the reply's end")
        live = notes(app)[-3:]
    async with without_model(tmp_path) as (app, pilot):
        await until(pilot, lambda: len(app.chat.query(MessageView)) == 5, "the chat")
        assert notes(app)[-3:] == live == [said for _, said in ends]


@pilot_test
@pytest.mark.notorch
async def test_an_empty_reply_shows_a_placeholder_live_after_a_restart_and_in_the_export(tmp_path, stored):
    """A reply the model ended at once (or cut at the length limit before any text) said "empty reply" while the app ran
    and was an invisible blank at the next start, its end unsaid."""
    from moechat.app.chat_export import export_markdown
    from moechat.app.tui.messages import ReplyFinished, Stats

    def shown(app) -> list[tuple[str, bool]]:  # the last two replies: (role line, placeholder shown)
        return [(view.query_one(".role").render().plain, view.query_one(".empty-reply").display)
                for view in list(app.chat.query(".assistant").results(MessageView))[-2:]]

    async with without_model(tmp_path) as (app, pilot):
        for request_id, reason in enumerate(("stop", "length"), 1):
            view = await reply_view(app.chat, request_id)
            await pilot.pause()
            assert not view.query_one(".empty-reply").display  # not while it streams
            app.post_message(ReplyFinished(request_id, "", reason, Stats()))
            await until(pilot, lambda: app.chat.reply is None, "the reply's end")
        live, conv = shown(app), app.chat.conv_id
        assert live == [("moechat", True), ("moechat · cut at the length limit", True)]
        assert all(view.query_one(".empty-reply").region.height == 1 for view in app.chat.query(".assistant").results(MessageView)
                   if view.empty_reply)
        exported = export_markdown(app.store, conv)
    async with without_model(tmp_path) as (app, pilot):
        await until(pilot, lambda: len(app.chat.query(MessageView)) == 4, "the chat")
        assert shown(app) == live
        assert not app.chat.query(MessageView).first(MessageView).query(".empty-reply")  # the user's message has none
    assert exported.endswith("### moechat\n\n*(empty reply)*\n\n### moechat\n\n*(empty reply)*\n\n*(cut at the length limit)*\n")


@pilot_test
@pytest.mark.notorch
async def test_a_chat_opened_empty_takes_its_first_message_as_title(tmp_path, stored):
    async with without_model(tmp_path) as (app, pilot):
        chat = app.chat
        await pilot.press("ctrl+n")
        await until(pilot, lambda: len(app.store.conversations()) == 3, "the new chat")
        await send(pilot, "Second chat about dogs")
        await until(pilot, lambda: app.store.conversation(chat.conv_id).title == "Second chat about dogs", "the title")
        assert titles(chat)[0] == "Second chat about dogs"


@pilot_test
@pytest.mark.notorch
async def test_a_chat_deleted_in_another_window_mid_reply_stops_it_with_a_notice(tmp_path, stored, monkeypatch):
    from moechat.app.tui.messages import ReplyDelta
    from moechat.app.tui.screens import chat as chat_screen
    from moechat.app.tui.widgets.message_view import ChatInput

    # no periodic look (a loaded machine's look could open no chat first, so the send makes one): the send finds it gone
    monkeypatch.setattr(chat_screen, "CHECK_S", 3600.0)

    async with without_model(tmp_path) as (app, pilot):
        chat = app.chat
        await reply_view(chat, 1)
        stops = []
        app.bridge.stop = lambda: stops.append(1)
        other = ChatStore(tmp_path / "chats.sqlite3")  # the other window
        other.delete(chat.conv_id)
        other.close()
        app.post_message(ReplyDelta(1, "some text"))
        await until(pilot, lambda: any("deleted in another" in n.message for n in app._notifications), "the notice")
        app.post_message(ReplyDelta(1, " more"))
        await pilot.pause(0.1)
        assert app.is_running and app.return_code is None and stops == [1]  # the reply is stopped, once
        assert sum("deleted in another" in n.message for n in app._notifications) == 1  # said once
        chat.reply = None  # as the stopped reply's end leaves it
        await send(pilot, "still there?")  # the chat is gone: the text comes back, for a new chat
        await until(pilot, lambda: chat.query_one(ChatInput).text == "still there?", "the text back in the input")
        assert chat.conv_id is None and app.return_code is None
        await pilot.press("enter")
        await until(pilot, lambda: any(c.title == "still there?" for c in app.store.conversations()), "the new chat")


@pilot_test
@pytest.mark.notorch
async def test_esc_says_the_reply_is_stopping_until_its_step_ends_and_delete_asks_nothing_meanwhile(tmp_path, stored):
    """A large model's step takes seconds: Esc left "reading the prompt…" on screen and Enter said "Esc stops it"; F8
    asked "Delete …?" and refused only after the answer. Enter then ("try again in a moment", the text left in the input,
    even on the demo, whose stop lands in milliseconds) holds the message and sends it once the stop lands; a second
    one meanwhile is refused and stays in the input."""
    from moechat.app.tui.messages import ReplyFinished, ReplyProgress
    from moechat.app.tui.screens.dialogs import Confirm
    from moechat.app.tui.widgets.message_view import ChatInput

    async with without_model(tmp_path) as (app, pilot):
        chat = app.chat
        view = await reply_view(chat, 1)
        app.bridge.stop = lambda: None  # the engine's step in progress goes on
        await pilot.press("f8")
        assert not isinstance(app.screen, Confirm) and "a reply is being written" in list(app._notifications)[-1].message
        await pilot.press("escape")
        note = lambda: view.query_one(".role").render().plain  # noqa: E731
        assert "stopping…" in note()
        app.post_message(ReplyProgress(1, 512, 1664))  # the pass that was under way reports
        await pilot.pause(0.1)
        assert "stopping…" in note() and "reading" not in note()
        chat.query_one(ChatInput).focus()
        await pilot.press(*"next", "enter")
        assert chat.query_one(ChatInput).text == "" and chat.held.text == "next" and "your message is sent next" in note()
        await pilot.press(*"more", "enter")
        assert "the reply is stopping" in list(app._notifications)[-1].message and chat.query_one(ChatInput).text == "more"
        conv = chat.conv_id
        await pilot.press("ctrl+n")  # a new chat, while the reply stops: the held message still goes to its own
        await until(pilot, lambda: chat.conv_id != conv, "the new chat")
        sent = []
        app.bridge.generate = lambda *a: sent.append(a)
        app.post_message(ReplyFinished(1, "", "cancelled", None))  # the stop lands
        await until(pilot, lambda: sent, "the held message sent")
        assert [m.content for m in app.store.messages(conv) if m.role == "user"][-1] == "next" and chat.held is None
        assert sent[0][1][-1] == {"role": "user", "content": "next"}  # its chat's history, not the chat shown
        assert chat.reply.conv_id == conv and chat.reply.view is None and chat.query_one(ChatInput).text == "more"


@pilot_test
@pytest.mark.notorch
async def test_settings_open_once_and_a_reload_setting_reloads_on_save(tmp_path, stored):
    from moechat.app.tui.screens.settings import SettingsScreen

    async with without_model(tmp_path) as (app, pilot):
        reloads = []
        app.bridge.reload = lambda *a: reloads.append(a)
        await pilot.press("f12")
        await until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings")
        await pilot.press("f12")
        await pilot.pause()
        assert sum(isinstance(s, SettingsScreen) for s in app.screen_stack) == 1  # not a second one under the first
        app.screen.query_one("#utility_bound").value = "3"
        await pilot.pause()
        app.screen.action_save()
        await until(pilot, lambda: app.screen is app.chat and reloads, "the settings to close and the model to reload")
        assert len(reloads) == 1 and app.settings.utility_bound == 3  # "Save and reload model" reloads


@pilot_test
@pytest.mark.notorch
async def test_a_thinking_flag_typed_stays_through_a_settings_save_that_leaves_thinking(tmp_path, stored):
    """`moechat chat --thinking off`, then a save of the settings that changed only top-p: the model thought again (the
    save put the settings' thinking over the flag, where sampling flags stay until their own field changes)."""
    from moechat.app.tui.screens.settings import SettingsScreen

    async with without_model(tmp_path) as (app, pilot):
        app.thinking = "off"  # as run_tui sets it from --thinking
        await pilot.press("f12")
        await until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings")
        app.screen.query_one("#top_p").value = "0.5"
        await pilot.pause()
        app.screen.action_save()
        await until(pilot, lambda: app.screen is app.chat and app.settings.top_p == 0.5, "the settings to be saved")
        assert app.sampling.top_p == 0.5 and app.thinking == "off"
        await pilot.press("f12")
        await until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings")
        app.screen.query_one("#thinking").value = "on"
        await pilot.pause()
        app.screen.action_save()
        await until(pilot, lambda: app.screen is app.chat and app.settings.thinking == "on", "the settings to be saved")
        assert app.thinking == "on"  # the field changed on the screen: it wins over the flag


@pilot_test
@pytest.mark.notorch
async def test_a_long_prompt_shows_how_far_it_is_read(tmp_path, stored):
    """ReplyProgress sets the pending reply's note until its first text comes."""
    from moechat.app.tui.messages import ReplyDelta, ReplyFinished, ReplyProgress, Stats

    app = make_app(tmp_path, failing("no model in this test"))
    async with app.run_test(size=SIZE) as pilot:
        chat = app.chat
        await until(pilot, lambda: errors(app), "the load failure")
        app.bridge.generate = lambda *args: None  # the reply is answered below, as the engine thread would
        await send(pilot, "Summarize this long document.")
        await until(pilot, lambda: chat.reply is not None, "the pending reply")
        reply, note = chat.reply, lambda: chat.reply.view.query_one(".role").render().plain
        app.post_message(ReplyProgress(reply.request_id, 1024, 4000))
        await until(pilot, lambda: "reading the prompt: 1,024 of 4,000 tokens" in note(), "the progress note")
        app.post_message(ReplyProgress(reply.request_id + 1, 2048, 4000))  # another request's: ignored
        app.post_message(ReplyDelta(reply.request_id, "It says"))
        await until(pilot, lambda: reply.text == "It says", "the first text")
        assert "writing" in note() and "reading" not in note()
        app.post_message(ReplyFinished(reply.request_id, "It says", "stop", Stats()))
        await until(pilot, lambda: chat.reply is None, "the end of the reply")


@pilot_test
@pytest.mark.notorch
async def test_rename_system_prompt_delete_theme_and_remapped_keys(tmp_path, stored):
    older, newer = stored
    (tmp_path / "settings.toml").write_text('# mine\n[keys]\nnew_chat = "ctrl+b"\nnope = "f6"\nstop = "notakey"\n')
    app = make_app(tmp_path, failing("no model here"))
    async with app.run_test(size=SIZE) as pilot:
        chat = app.chat
        await pilot.pause()
        (notice,) = [n.message for n in app._notifications if "nope" in n.message]  # the unknown binding id is named
        assert notice.startswith("[keys] nope ignored") and "'notakey' is not a key name" in notice  # plain text
        assert app.active_bindings.get("escape") and app.active_bindings["escape"].binding.action == "stop"  # kept

        await pilot.press("f2", "ctrl+u", *"renamed", "enter")
        assert app.store.conversation(newer).title == "renamed"
        assert titles(chat)[0] == "renamed"

        await pilot.press("ctrl+s", *"Be brief.", "ctrl+s")
        assert app.store.conversation(newer).system_prompt == "Be brief."

        await pilot.press("ctrl+b")  # new_chat, remapped from the settings' [keys]
        await until(pilot, lambda: len(app.store.conversations()) == 3, "the remapped new chat")

        await pilot.press("f8", "y")
        await until(pilot, lambda: len(app.store.conversations()) == 2, "the delete")
        assert chat.conv_id in (older, newer)

        await pilot.press("f12")
        from moechat.app.tui.screens.settings import SettingsScreen

        assert isinstance(app.screen, SettingsScreen)
        await pilot.press("escape")
        assert app.screen is chat

        path = tmp_path / "settings.toml"  # edited while the app runs: kept
        path.write_text("vram_budget_gib = 12  # added later\n" + path.read_text(), encoding="utf-8")
        await pilot.press("ctrl+t")
        assert app.theme == "textual-light"
        text = (tmp_path / "settings.toml").read_text()
        assert 'theme = "light"' in text and "# mine" in text and 'new_chat = "ctrl+b"' in text
        assert "vram_budget_gib = 12  # added later" in text and app.settings.vram_budget_gib is None  # the engine's


@pilot_test
@pytest.mark.notorch
async def test_the_dialogs_show_their_own_keys_and_rename_replaces_the_title_selected(tmp_path, stored):
    """The rename, system prompt and delete dialogs' footer showed only "f1 Help" (the chat screen's, under them), not
    their Esc and Ctrl+S; Ctrl+A in the rename box went to the line's start, so a title typed after it went first."""
    from textual.widgets import Footer
    from textual.widgets._footer import FooterKey

    older, newer = stored
    async with without_model(tmp_path) as (app, pilot):
        def footer() -> dict[str, str]:
            return {key.action: key.description for key in app.screen.query_one(Footer).query(FooterKey)}

        await pilot.press("f2")
        await until(pilot, lambda: footer() == {"cancel": "Cancel", "save": "Save"}, "the rename dialog's keys")
        await pilot.press(*"Dogs", "enter")  # it opens with the title selected: typing replaces it
        assert app.store.conversation(newer).title == "Dogs"
        await pilot.press("f2", "end", *" and cats", "ctrl+a", *"Cats", "enter")  # Ctrl+A selects it all, as in most apps
        assert app.store.conversation(newer).title == "Cats"
        await pilot.press("ctrl+s")
        await until(pilot, lambda: footer() == {"cancel": "Cancel", "save": "Save"}, "the system prompt dialog's keys")
        await pilot.press(*"Be brief.", "ctrl+a", *"Rhyme.", "ctrl+s")
        assert app.store.conversation(newer).system_prompt == "Rhyme."
        await pilot.press("f8")
        await until(pilot, lambda: footer() == {"no": "No", "yes": "Yes"}, "the delete dialog's keys")
        await pilot.press("escape")
        assert len(app.store.conversations()) == 2


@pilot_test
@pytest.mark.notorch
async def test_f1_and_the_palette_do_what_each_screen_offers(tmp_path, stored):
    """Over a dialog Ctrl+P opened a palette whose entries did nothing there (F1, which Textual keeps from a modal screen,
    and Ctrl+P are not in its footer); over the settings and the wizard the palette offered the chat's actions, which
    did nothing, and F1 showed the chat's keys. A dialog now keeps to its own keys, the palette lists what runs where
    it opened, and F1 on the settings explains their fields."""
    from textual.command import CommandPalette
    from textual.widgets import Footer
    from textual.widgets._footer import FooterKey

    from moechat.app.tui.commands import MoechatCommands
    from moechat.app.tui.screens.settings import SettingsScreen
    from moechat.app.tui.screens.wizard import WizardScreen

    async with without_model(tmp_path) as (app, pilot):
        async def offered() -> list[str]:  # the palette's entries over the screen shown
            return [hit.text async for hit in MoechatCommands(app.screen).discover()]

        assert "New chat" in await offered()
        for key, dialog in (("f2", "TextPrompt"), ("f8", "Confirm")):
            await pilot.press(key)
            await until(pilot, lambda d=dialog: type(app.screen).__name__ == d, f"the {dialog} dialog")
            await pilot.press("f1", "ctrl+p")
            await pilot.pause()
            assert type(app.screen).__name__ == dialog and not CommandPalette.is_open(app)
            footer = {k.action for k in app.screen.query_one(Footer).query(FooterKey)}
            assert not footer & {"help", "command_palette"}
            await pilot.press("escape")
        for key, screen in (("f12", SettingsScreen), (None, WizardScreen)):
            if key:
                await pilot.press(key)
            else:
                app.action_setup()
            await until(pilot, lambda s=screen: isinstance(app.screen, s), screen.__name__)
            assert await offered() == ["Help", "Toggle theme"]  # the chat's actions do nothing here; settings and setup are open
            await pilot.press("ctrl+p")
            await until(pilot, lambda: CommandPalette.is_open(app), "the palette")
            await pilot.press("escape")
            await until(pilot, lambda s=screen: isinstance(app.screen, s), screen.__name__)
            await pilot.press("f1")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen), "the help")
            assert await offered() == ["Toggle theme"]  # "Help" did nothing over the help
            source = app.screen.query_one("Markdown").source
            if screen is SettingsScreen:  # its fields, as the README's options table says them
                assert "| Quantized experts | reload model | routed experts' storage" in source and "ctrl+n" not in source.lower()
            else:  # its steps and keys, not the chat's
                assert "1/4 Choose the model" in source and "Esc | cancel" in source and "ctrl+n" not in source.lower()
            await pilot.press("escape", "escape")
            await until(pilot, lambda: app.screen is app.chat, "the chat")


@pilot_test
@pytest.mark.notorch
async def test_a_remapped_key_another_action_holds_is_refused_with_a_notice(tmp_path, stored):
    (tmp_path / "settings.toml").write_text('[keys]\nnew_chat = "f3"\nregenerate = "F10"\n')
    app = make_app(tmp_path, failing("no model here"))
    async with app.run_test(size=SIZE) as pilot:
        chat = app.chat
        await pilot.pause()
        (notice,) = [n.message for n in app._notifications if "[keys]" in n.message]
        assert "new_chat = 'f3' ignored: f3 is already Experts (toggle_experts)" in notice and "F10" not in notice
        await pilot.press("f3")  # still the expert view, and no new chat
        assert chat.side_panel_shown and len(app.store.conversations()) == 2
        await pilot.press("ctrl+n")  # new_chat keeps its default key
        await until(pilot, lambda: len(app.store.conversations()) == 3, "the new chat")
        await pilot.press("f1")
        rows = app.screen.query_one("Markdown").source.splitlines()
        assert [r for r in rows if "| f3 |" in r.lower()] == ["| f3 | Experts |"]
        assert any(r.lower().startswith("| f10 | regenerate") for r in rows)  # "F10" as Textual reports it


@pilot_test
@pytest.mark.notorch
@pytest.mark.parametrize("size", [(80, 24), (60, 20)])
async def test_a_narrow_terminal_keeps_the_input_dialogs_and_help_on_the_screen(tmp_path, stored, size):
    """At 60 columns F3 pushed the expert view off the screen and left the input no columns (8 at 80); the help (90
    wide) and the dialogs (70) were cut at the right, Cancel with them."""
    app = make_app(tmp_path, failing("no model here"))
    async with app.run_test(size=size) as pilot:
        chat, width = app.chat, size[0]
        await pilot.pause()
        await pilot.press("f3")
        await pilot.pause()
        side, box = chat.query_one("#side-panel").region, chat.query_one("#input").region
        assert side.right <= width and box.width >= 24 and box.right <= side.x
        await pilot.press("f4")  # the chat list is back on a key
        assert chat.query_one("#sidebar").display
        await pilot.press("f3", "f1")
        assert app.screen.query_one("#help").region.right <= width
        await pilot.press("escape", "f2")
        await pilot.pause()
        assert app.screen.query_one(".dialog").region.right <= width and app.screen.query_one("#cancel").region.right <= width


@pilot_test
@pytest.mark.notorch
@pytest.mark.parametrize("size", [(80, 24), (60, 20)])
async def test_a_narrow_terminals_footer_shows_f1_for_the_help(tmp_path, size):
    """Below 100 columns the footer's last keys went under the command palette's, F1 Help with them, while the input's
    placeholder said "F1 help": an 80-column terminal showed no way to the keys."""
    from textual.widgets import Footer
    from textual.widgets._footer import FooterKey

    async with without_model(tmp_path, size) as (app, pilot):
        def keys():
            return {key.action: key.region for key in app.screen.query_one(Footer).query(FooterKey)}

        await until(pilot, lambda: {"help", "command_palette"} <= keys().keys() and all(r.width for r in keys().values()),
                    "the footer's keys laid out")
        shown, palette = keys()["help"], keys()["command_palette"]
        assert shown.right <= palette.x, (shown, palette)
        assert "F1 help" in str(app.chat.query_one("#input").placeholder)


@pilot_test
@pytest.mark.notorch
@pytest.mark.parametrize("size, key, panel", [((120, 40), "f4", "#conversations"), ((80, 24), "f3", "#conversations"),
                                              ((120, 40), "f3", "#heatmap")])
async def test_hiding_the_panel_that_has_the_focus_gives_it_to_the_input(tmp_path, stored, size, key, panel):
    """F4 on the chat list (F3 below 100 columns, F3 on the expert view) hid the panel with the focus in it: nothing had
    the focus, and typing went nowhere until a click."""
    from moechat.app.tui.widgets.message_view import ChatInput

    async with without_model(tmp_path, size) as (app, pilot):
        chat = app.chat
        if panel == "#heatmap":
            await pilot.press("f3")
            await pilot.pause()
        chat.query_one(panel).focus()
        await pilot.pause()
        await pilot.press(key, "h", "i")
        assert app.focused is chat.query_one(ChatInput) and chat.query_one(ChatInput).text == "hi"

@pilot_test
@pytest.mark.notorch
async def test_narrowing_the_terminal_with_the_expert_view_shown_hides_the_chat_list(tmp_path, stored):
    """F3 on a wide terminal, then the window made narrow: the chat list stayed, and the chat was left 14 columns at 60
    (one word a line). As F3 on a narrow terminal does, the list makes room; F4 brings it back and a resize that stays
    narrow leaves it."""
    async with without_model(tmp_path) as (app, pilot):
        chat = app.chat
        await pilot.press("f3")
        await pilot.pause()
        assert chat.query_one("#sidebar").display
        await pilot.resize_terminal(60, 20)
        await until(pilot, lambda: chat.has_class("-narrow"), "the narrow layout")
        await pilot.pause()
        assert not chat.query_one("#sidebar").display and chat.query_one("#input").region.width >= 24
        await pilot.press("f4")
        await pilot.resize_terminal(62, 20)
        await pilot.pause()
        assert chat.query_one("#sidebar").display  # brought back on purpose: kept


@pilot_test
@pytest.mark.notorch
async def test_the_expert_view_says_no_model_is_loaded_and_a_reload_waits_for_frames_again(tmp_path):
    """F3 after a failed load said "waiting for the first expert frame…", as if a reply were coming: it says no model is
    loaded and what to do, wrapped to the panel (a frame from the model before is gone too); a load waits again, and a
    remote backend, which sends none, says so."""
    from moechat.app.tui.messages import EngineReady, Frame

    async with without_model(tmp_path) as (app, pilot):
        chat = app.chat
        await pilot.press("f3")
        await pilot.pause()

        def shown() -> str:
            heatmap = chat.heatmap
            assert all(len(heatmap.render_line(y).text) == heatmap.size.width for y in range(heatmap.size.height))
            return " ".join(" ".join(heatmap.render_line(y).text.split()) for y in range(heatmap.size.height)).strip()

        said = shown()
        assert said.startswith("no model is loaded (the status line says why): fix the settings") and "waiting" not in said
        assert said.endswith("pick a model with Ctrl+P's Setup wizard")
        chat.show_loading(0.5, "reading the weights")
        await pilot.pause()
        assert shown() == "waiting for the first expert frame…"
        app.post_message(EngineReady("served-model", "remote", "remote http://host:8000/v1", remote=True))
        await pilot.pause()  # a remote backend sends no frames: it waited for them for ever
        assert shown().startswith("a remote server runs the model: its experts are not seen here")
        chat.show_loading(0.5, "reading the weights")
        await pilot.pause()
        chat.show_frame(Frame([[1, 0]], [[True, False]], [1], 2, "utility", 7))
        await until(pilot, lambda: chat.heatmap.frame is not None, "the frame drawn")
        chat.show_failed("the model failed to load")
        await pilot.pause()
        assert chat.heatmap.frame is None and shown().startswith("no model is loaded")


@pilot_test
@pytest.mark.notorch
async def test_the_chat_list_that_made_room_comes_back_with_the_width_but_never_against_f4(tmp_path, stored):
    """Widened again after the chat list made room for the expert view, the list stayed hidden until F4. It comes back
    with the width, or when the expert view closes; a list F4 hid (wide or narrow) stays hidden."""
    async with without_model(tmp_path) as (app, pilot):
        chat = app.chat

        async def resize(width: int) -> None:
            await pilot.resize_terminal(width, 30)
            await until(pilot, lambda: chat.has_class("-narrow") == (width < 100), f"the layout at {width} columns")
            await pilot.pause()

        def listed() -> bool:
            return chat.query_one("#sidebar").display

        await pilot.press("f3")
        await resize(60)
        assert not listed()
        await resize(120)
        assert listed() and chat.side_panel_shown  # back with the width
        await resize(60)
        await pilot.press("f3")
        assert listed()  # the expert view closed: nothing to make room for
        await pilot.press("f3", "f4")  # the list hidden by the view, then shown by F4, then hidden by F4 on purpose
        assert listed()
        await pilot.press("f4")
        await resize(120)
        assert not listed()  # the user's choice
        await pilot.press("f4", "f3")  # shown by F4; hidden wide by F4, then narrowed with the view shown
        await pilot.press("f4")
        await resize(60)
        await resize(120)
        assert not listed()


@pilot_test
@pytest.mark.notorch
async def test_line_breaks_show_as_written(tmp_path):
    """A pasted list of lines (or lines typed with Ctrl+J), or a reply's poem, showed joined into one line: Markdown joins
    a paragraph's lines. Kept in a reply's later Markdown widget too (a long reply's next segment)."""
    from textual.widgets._markdown import MarkdownParagraph

    store_chat(tmp_path, "lines", ("user", "first line\nsecond line\nthird line"), ("assistant", "one\ntwo"))
    async with without_model(tmp_path) as (app, pilot):
        await until(pilot, lambda: len(app.chat.query(MessageView)) == 2, "the chat")
        await pilot.pause()
        user, reply = app.chat.query(MessageView)
        assert user.query_one(MarkdownParagraph).region.height == 3
        assert reply.query_one(MarkdownParagraph).region.height == 2
        segment = await reply.next_segment()
        await segment.update("roses\nviolets\nsugar")
        await pilot.pause()
        assert segment.query_one(MarkdownParagraph).region.height == 3


@pilot_test
@pytest.mark.notorch
async def test_page_keys_in_the_message_box_scroll_the_chat_log(tmp_path):
    """PageUp/PageDown typed in the message box did nothing: a keyboard-only user had to Shift+Tab onto a message. A
    message taller than the box still pages through itself."""
    from moechat.app.tui.widgets.message_view import ChatInput

    store_chat(tmp_path, "long", *[("user" if i % 2 == 0 else "assistant", f"message {i}\n\nmore of {i}") for i in range(30)])
    async with without_model(tmp_path) as (app, pilot):
        log, box = app.chat.query_one(ChatLog), app.chat.query_one(ChatInput)
        await until(pilot, lambda: log.max_scroll_y > 0 and log.scroll_y == log.max_scroll_y, "the chat at its end")
        bottom = log.max_scroll_y
        assert app.focused is box
        for key, at in [("pageup", lambda y: 0 < y < bottom), ("ctrl+home", lambda y: y == 0),
                        ("pagedown", lambda y: 0 < y < bottom), ("ctrl+end", lambda y: y == bottom)]:
            await pilot.press(key)
            await until(pilot, lambda at=at: at(log.scroll_y), f"{key} to scroll the log")
        box.text = "line\n" * 20  # 21 lines: the box scrolls
        box.move_cursor(box.document.end)
        await pilot.pause()
        assert box.max_scroll_y > 0 and box.cursor_location[0] == 20
        await pilot.press("pageup")
        await pilot.pause()
        assert box.cursor_location[0] < 20 and log.scroll_y == bottom and app.focused is box


@pilot_test
async def test_a_message_too_long_for_the_context_comes_back_to_the_input(tmp_path, checkpoint):
    """It stayed in the chat, so the next request carried it and was refused too ("the prompt has 3022 tokens")."""
    from moechat.app.tui.widgets.message_view import ChatInput

    path = checkpoint("qwen3_moe")
    app = make_app(tmp_path, lambda: EngineConfig(str(path), context_len=128), max_new_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.chat
        await until(pilot, lambda: chat.model == path.name, "the engine to load")
        await send(pilot, "Hello!")
        await until(pilot, lambda: chat.reply is None and len(app.store.messages(chat.conv_id)) == 2, "the first reply")
        box = chat.query_one(ChatInput)
        box.text = "the sea " * 100  # 200-odd tokens: past the 128-token context on its own
        await pilot.press("enter")
        await until(pilot, lambda: any("back in the input" in e for e in errors(app)), "the refusal")
        assert box.text == ("the sea " * 100).strip() and chat.reply is None
        assert [m.content for m in app.store.messages(chat.conv_id)][0] == "Hello!"
        assert len(app.store.messages(chat.conv_id)) == 2 and len(chat.query_one(ChatLog).views()) == 2  # not stored, not shown
        box.text = ""
        box.focus()  # not a click: the notice's toast lies over the input
        await pilot.press(*"And the moon?", "enter")
        await until(pilot, lambda: chat.reply is None and len(app.store.messages(chat.conv_id)) == 4, "the next reply")
        assert [m.role for m in app.store.messages(chat.conv_id)] == ["user", "assistant"] * 2


@pilot_test
async def test_first_run_opens_the_wizard_before_the_model_loads(tmp_path):
    from moechat.app.tui.screens.wizard import WizardScreen

    loads = []

    def factory():
        loads.append(1)
        raise MoechatError("no model yet")

    app = MoechatApp(factory, store_path=tmp_path / "chats.sqlite3", settings_file=tmp_path / "settings.toml",
                     first_run=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.2)
        assert isinstance(app.screen, WizardScreen) and not loads
        app.screen.dismiss(None)  # cancelled: chat with what the settings say
        await until(pilot, lambda: loads and app.screen is app.chat, "the engine to start after the wizard")


@pytest.mark.notorch
def test_last_code_block():
    assert last_code_block("a\n```py\nx = 1\n```\nb\n```\ny\n```") == "y"
    assert last_code_block("no code") is None
    assert last_code_block("```sh\nunfinished") == "unfinished"  # a reply stopped inside a block


@pytest.mark.notorch
def test_moechat_opens_the_app_only_on_a_terminal(monkeypatch):
    from moechat.app import cli, plain_chat
    from moechat.app.tui import app as tui_app

    ran = []
    monkeypatch.setattr(tui_app, "run_tui", lambda args: ran.append("tui") or 0)
    monkeypatch.setattr(plain_chat, "cmd_chat", lambda args: ran.append("plain") or 0)
    for tty in (True, False):
        monkeypatch.setattr(sys.stdin, "isatty", lambda tty=tty: tty, raising=False)
        monkeypatch.setattr(sys.stdout, "isatty", lambda tty=tty: tty, raising=False)
        assert cli.main([]) == 0
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    assert cli.main(["chat", "--plain"]) == 0
    assert ran == ["tui", "plain", "plain"]


def still_loading_app(tmp_path: Path) -> MoechatApp:
    """An app whose model loads until the app closes: no engine output, no notification, nothing that moves."""
    release = threading.Event()

    def loading():
        release.wait()
        raise MoechatError("closed")

    app = make_app(tmp_path, loading)
    close = app.bridge.close
    app.bridge.close = lambda: (release.set(), close())
    return app


@pytest.mark.notorch
def test_snapshot_chat_screen(tmp_path, stored, snap_compare):
    """The chat screen with a stored conversation while the model loads (the factory waits for the
    app to close, so no engine output makes it differ from run to run)."""
    app = still_loading_app(tmp_path)

    async def ready(pilot):
        await until(pilot, lambda: app.chat.state.startswith("loading"), "the loading state")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_snapshot_reasoning(tmp_path, snap_compare):
    """A reply's reasoning folded above its answer, and one cut off while thinking, open (no engine: nothing moves)."""
    store = ChatStore(tmp_path / "chats.sqlite3")
    conv = store.create("capital")
    store.add(conv, "user", "What is the capital of France?")
    store.add(conv, "assistant", "<think>\nThe capital of France: Paris, on the Seine.\n</think>\n\nIt is **Paris**.")
    store.add(conv, "user", "And of Italy?")
    store.add(conv, "assistant", "<think>\nItaly's capital is Rome. Let me check", finished=False)
    store.close()
    app = still_loading_app(tmp_path)

    async def ready(pilot):
        await until(pilot, lambda: len(app.chat.query(MessageView)) == 4 and app.chat.state.startswith("loading"), "the chat")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


@pilot_test
@pytest.mark.notorch
async def test_corrupt_settings_file_opens_the_app_with_defaults_and_a_notice(tmp_path, stored):
    (tmp_path / "settings.toml").write_text("theme = [unclosed\n", encoding="utf-8")
    app = make_app(tmp_path, failing("not needed"))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        notices = [n.message for n in app._notifications]
        assert any("settings" in n for n in notices), notices  # one line naming the file's problem
        assert app.is_running and app.settings.theme == "dark"  # defaults
    assert (tmp_path / "settings.toml").read_text(encoding="utf-8") == "theme = [unclosed\n"  # left for the user to fix


@pilot_test
async def test_wizard_in_the_app_shows_each_decision_once(tmp_path):
    """Inside the app, the wizard's own calibration messages stop at the wizard; one posted to the app reaches no
    screen (the app has no handler for them)."""
    from moechat.app.tui.messages import CalibrationDone, CalibrationProgress
    from moechat.app.tui.screens.wizard import WizardScreen
    app = MoechatApp(failing("no model yet"), store_path=tmp_path / "chats.sqlite3", settings_file=tmp_path / "settings.toml",
                     first_run=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.2)
        wizard = app.screen
        assert isinstance(wizard, WizardScreen)
        rows = {"expert cache ratio": ("0", "no GPU"), "draft length γ": ("2", "fastest")}
        wizard.post_message(CalibrationProgress(0.5, "halfway"))
        wizard.post_message(CalibrationDone(rows, str(tmp_path / "p.toml")))
        app.post_message(CalibrationDone(rows, str(tmp_path / "q.toml")))
        await pilot.pause(0.5)
        assert wizard.query_one("#decisions").row_count == len(rows)  # the wizard's message once, no echo
        wizard.dismiss(None)


@pilot_test
async def test_the_app_chats_through_a_remote_backend(tmp_path, served, monkeypatch):
    from conftest import SERVER_KEY

    from moechat.app.remote import RemoteConfig, RemoteEngine

    url, model = served
    monkeypatch.setenv("MOECHAT_API_KEY", SERVER_KEY)
    remote = RemoteEngine(RemoteConfig(url))
    remote.close()
    assert remote.summary == f"{model.name} {remote.where}"  # plain chat's line: the model, then where, in one wording
    app = make_app(tmp_path, lambda: RemoteConfig(url), max_new_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        chat = app.chat
        await until(pilot, lambda: chat.model == model.name, "the remote backend to answer")
        status = chat.query_one("#status").render().plain
        assert f"at {url} (remote backend)" == remote.where and remote.where in status
        assert status.count(model.name) == 1  # named once, first
        await send(pilot, "Hello over the network")
        await until(pilot, lambda: chat.reply is None and chat.stats is not None, "the remote reply")
        (conv,) = app.store.conversations()
        messages = app.store.messages(conv.id)
        assert [m.role for m in messages] == ["user", "assistant"] and messages[1].finished and messages[1].content
        assert chat.stats.remote == url and 1 <= chat.stats.new_tokens <= 6
        assert messages[1].stats["remote"] == url
        await pilot.press("f3")
        await pilot.pause()
        assert f"remote {url}" in str(chat.query_one("#engine").render())
        assert not errors(app)


@pilot_test
async def test_a_replys_reasoning_folds_above_its_answer(tmp_path, monkeypatch):
    """Qwen3 thinks in <think>…</think> before it answers: the block shows open while the model thinks, folds with a
    word count once the answer starts, and the answer alone is the Markdown (and what `c` copies). A block the
    template opened in the prompt (only `</think>` in the reply) moves out of the answer when it closes."""
    from textual.widgets import Collapsible, Static

    from moechat.app.tui.screens import chat as chat_screen

    monkeypatch.setattr(chat_screen, "REDRAW_S", 0)  # every delta drawn as it comes: the states between them are checked

    store_chat(tmp_path, "thought", ("user", "The capital of France?"),
               ("assistant", "<think>\nFrance's capital.\n</think>\n\nParis."))
    app = make_app(tmp_path, failing("no model here"))
    async with app.run_test(size=SIZE) as pilot:
        chat = app.chat
        await until(pilot, lambda: len(chat.query(MessageView)) == 2, "the stored chat")
        user, stored = chat.query(MessageView)
        box = stored.query_one(".reasoning", Collapsible)
        assert box.display and box.collapsed and box.title == "thought: 2 words"
        assert stored.query_one(".reasoning-text", Static).render().plain == "France's capital."
        assert stored.markdown.source == "Paris." and stored.split()[1] == "Paris."
        assert not user.query(".reasoning")  # a user's message has no reasoning block

        async def stream(request_id: int, deltas: list[str], seen: list, reason: str = "stop", user=None) -> MessageView:
            view = await reply_view(chat, request_id)
            for i, delta in enumerate(deltas):
                await chat.reply_delta(request_id, delta)
                box = view.query_one(".reasoning", Collapsible)
                seen.append((box.display, box.collapsed, chat.reply.answer))
                if user and i in user:
                    box.collapsed = user[i]  # the user folds or opens it: the next tokens leave it so
            await chat.reply_finished(request_id, "", reason, None)
            return view

        seen = []
        view = await stream(7, ["<th", "ink>\nWhich", " city?", "\n</th", "ink>\n\nPar", "is."], seen)
        assert seen == [(False, True, ""), (True, False, ""), (True, False, ""), (True, False, ""), (True, True, "Par"),
                        (True, True, "Paris.")]
        assert view.markdown.source == "Paris." and view.query_one(".reasoning", Collapsible).title == "thought: 2 words"
        assert app.store.messages(chat.conv_id)[-1].content == "<think>\nWhich city?\n</think>\n\nParis."  # stored whole

        seen = []
        await stream(9, ["<think>\nWhich", " city?", " France", "\n</think>\n\nPar", "is", "."], seen,
                     user={1: True, 4: False})
        # opened as it thinks, folded by the user and left so, folded at the answer, opened by the user and left so
        assert [s[1] for s in seen] == [False, False, True, True, True, False]
        seen = []
        cut = await stream(10, ["<think>\nWhich", " city?"], seen, reason="length")
        box = cut.query_one(".reasoning", Collapsible)
        assert box.title == "reasoning, cut off: 2 words" and not box.collapsed and cut.markdown.source == ""

        seen = []
        view = await stream(8, ["Which", " city?", "\n</think>\n\n", "Paris."], seen)
        assert [s[2] for s in seen] == ["Which", "Which city?", "", "Paris."]  # the answer so far became reasoning
        assert view.markdown.source == "Paris."
        assert view.query_one(".reasoning-text", Static).render().plain == "Which city?"


@pilot_test
async def test_a_reply_is_drawn_at_most_once_a_frame_and_whole_at_its_end(tmp_path, monkeypatch):
    """Text that comes within a frame of the last redraw waits for one timer, which draws all of it; the reply's end
    draws it whole at once and cancels that timer. Every delta is stored all the same."""

    from moechat.app.tui.screens import chat as chat_screen

    store_chat(tmp_path, "frames", ("user", "Count."))
    app = make_app(tmp_path, failing("no model here"))
    async with app.run_test(size=SIZE) as pilot:
        chat = app.chat
        await until(pilot, lambda: len(chat.query(MessageView)) == 1, "the stored chat")

        monkeypatch.setattr(chat_screen, "REDRAW_S", 3600.0)  # one frame longer than the test: nothing falls due
        view = await reply_view(chat, 1)
        for delta in ["One", ", two", ", three"]:
            await chat.reply_delta(1, delta)
        reply = chat.reply
        assert reply.answer == "One" and reply.redraw is not None  # the first drawn at once, the rest held for one timer
        assert view.content == "One, two, three"
        await chat.reply_finished(1, "", "stop", None)
        assert view.markdown.source == "One, two, three"
        await chat._show_due(reply)  # a timer that fired as the reply ended: the ended reply is left as its end drew it
        assert view.markdown.source == "One, two, three" and chat.reply is None
        assert app.store.messages(chat.conv_id)[-1].content == "One, two, three"

        monkeypatch.setattr(chat_screen, "REDRAW_S", 0.05)
        view = await reply_view(chat, 2)
        for delta in ["Four", ", five", ", six"]:
            await chat.reply_delta(2, delta)
        await until(pilot, lambda: chat.reply.answer == "Four, five, six", "the timer to draw the held text")
        await until(pilot, lambda: view.markdown.source == "Four, five, six", "the stream to write it")
        await chat.reply_finished(2, "", "stop", None)
        assert view.markdown.source == "Four, five, six"


def test_an_answer_moves_to_a_new_markdown_widget_only_between_blocks():
    from moechat.app.tui.widgets.message_view import segment_cut

    whole = len("Two and more")
    assert segment_cut("Intro.\n\n", "One.\n\nTwo and more") == (6, 6 + whole)  # after the last blank line
    assert segment_cut("Para.\n\n", "Next") == (0, 4)  # a blank line that ended the text written before
    assert segment_cut("Para.\n\n", "2") == (None, 0)  # "2" or "2." (a list)? it waits for the next draw
    assert segment_cut("", "One.\n\n2. item")[0] is None  # a list may go on: not split before an item
    assert segment_cut("", "1. One\n\n   more of the item")[0] is None  # nor before an item's own paragraph
    assert segment_cut("", "One.\n\n    indented code")[0] is None
    assert segment_cut("```\ncode\n", "\n\nstill code") == (None, 12)  # inside a fence
    assert segment_cut("~~~\ncode\n", "\n\nstill code")[0] is None
    assert segment_cut("```\ncode\n```\n", "\n\nAfter.") == (2, 8)
    assert segment_cut("Close it with ``` alone.\n\n", "After it") == (0, 8)  # a ``` inside a line is no fence


@pilot_test
async def test_a_long_answer_streams_into_several_markdown_widgets_that_hold_it_whole(tmp_path, monkeypatch):
    """Past SEGMENT_CHARS the stream moves on at a blank line outside code (Textual restyles every block of a widget
    when one is added); the widgets together hold the answer exactly, during the reply and after its end."""
    from textual.widgets import Markdown

    from moechat.app.tui import live_reply
    from moechat.app.tui.screens import chat as chat_screen

    monkeypatch.setattr(chat_screen, "REDRAW_S", 0)
    monkeypatch.setattr(live_reply, "SEGMENT_CHARS", 20)
    store_chat(tmp_path, "long", ("user", "Write at length."))
    app = make_app(tmp_path, failing("no model here"))
    async with app.run_test(size=SIZE) as pilot:
        chat = app.chat
        await until(pilot, lambda: len(chat.query(MessageView)) == 1, "the stored chat")
        view = await reply_view(chat, 3)
        deltas = ["A first paragraph, long enough.\n\n", "```\nx = 1\n\ny = 2\n```\n\n", "- one\n\n", "- two\n\n",
                  "Then a closing paragraph.\n\nThe end."]
        for delta in deltas:
            await chat.reply_delta(3, delta)
        whole = "".join(deltas)
        await until(pilot, lambda: view.answer_source == whole, "the widgets to hold the answer")
        segments = [m.source for m in view.query(Markdown)]
        assert len(segments) >= 2 and not any(s.startswith(("- ", "y = 2")) for s in segments)  # never inside a block
        assert all(s.count("```") % 2 == 0 for s in segments)
        await chat.reply_finished(3, "", "stop", None)
        assert view.answer_source == whole and len(view.query(Markdown)) == len(segments)

        view = await reply_view(chat, 4)  # a token a draw, as from a slow model
        tokens = ["A first", " paragraph", " of words.", "\n\n", "Second", " one.", "\n\n", "2", ".", " a list?", "\n\n",
                  "Third", " and last."]
        for token in tokens:
            await chat.reply_delta(4, token)
        whole = "".join(tokens)
        await chat.reply_finished(4, "", "stop", None)
        segments = [m.source for m in view.query(Markdown)]
        assert "".join(segments) == whole and len(segments) >= 2
        assert not any(s.startswith(("2", ".")) for s in segments)


@pytest.mark.notorch
def test_the_log_window_holds_the_newest_messages_that_add_up_to_its_characters():
    assert window_start([]) == 0 and window_start([10, 20]) == 0
    assert window_start([LOG_CHARS, 10, 10]) == 1  # the oldest would pass LOG_CHARS
    assert window_start([10, LOG_CHARS // 2, LOG_CHARS // 2]) == 1
    assert window_start([5, 3 * LOG_CHARS, 2 * LOG_CHARS]) == 1  # however long, the last exchange stays


@pilot_test
@pytest.mark.notorch
async def test_a_long_conversation_shows_its_newest_messages_and_the_rest_behind_a_button(tmp_path):
    """The log holds the newest LOG_CHARS of a conversation: opened, the rest waits behind "earlier messages"; each
    press shows the next window above, in order; sending folds the log back to its window."""
    from textual.widgets import Button

    answer = "An answer.\n\n" + "A paragraph of the answer. " * 40  # about 1 100 characters
    exchanges = [(("user", f"question {i}"), ("assistant", f"{i}: {answer}")) for i in range(20)]
    store_chat(tmp_path, "long", *[m for pair in exchanges for m in pair])
    app = make_app(tmp_path, failing("no model in this test"))
    async with app.run_test(size=SIZE) as pilot:
        chat = app.chat
        await until(pilot, lambda: errors(app), "the load failure")
        stored = app.store.messages(chat.conv_id)
        ids = [m.id for m in stored]

        def shown() -> list[int]:
            return [v.message_id for v in chat.query_one(ChatLog).views()]

        def button() -> Button | None:
            return next(iter(chat.query("#earlier").results(Button)), None)

        first = window_start([len(m.content) for m in stored])
        assert 2 < first < len(stored) - 2 and shown() == ids[first:]
        assert sum(len(m.content) for m in stored[first:]) <= LOG_CHARS < sum(len(m.content) for m in stored[first - 1:])
        assert str(button().label) == f"▲ {first} earlier messages"
        assert chat.query_one("#log").children[0] is button()  # above the first message

        while button() is not None:
            before = chat.query_one(ChatLog).views()
            chat.query_one("#log").scroll_home(animate=False)  # the log opens at its end: the user scrolls up to it
            await pilot.pause()
            await pilot.click("#earlier")
            await until(pilot, lambda before=before: len(shown()) > len(before), "earlier messages")
            assert shown() == ids[-len(shown()):]  # in order, the newest still last
            log = chat.query_one("#log")  # the message that was first is where the reader was, the earlier ones above it
            await until(pilot, lambda before=before, log=log: log.scroll_y > 0 and before[0].region.y == log.region.y + 1,
                        "the first message at the top")
        assert shown() == ids

        await send(pilot, "one more question")  # stored and shown; the engine has no model: its empty reply is dropped
        await until(pilot, lambda: len(app.store.messages(chat.conv_id)) == len(ids) + 1 and chat.reply is None, "the reply")
        stored = app.store.messages(chat.conv_id)
        assert shown() == [m.id for m in stored[window_start([len(m.content) for m in stored]):]]
        assert str(button().label) == f"▲ {len(stored) - len(shown())} earlier messages"


@pilot_test
@pytest.mark.notorch
async def test_control_characters_in_a_chat_never_reach_the_terminal(tmp_path):
    """A reply's `ESC ]0;…BEL` went to the terminal as it was (Textual drops only BEL, BS, VT, FF and CR): it retitled
    the window and swallowed what followed; `ESC [2J` cleared the screen under the app."""
    store_chat(tmp_path, "escapes", ("user", "say \x1b[31mred\x00"), ("assistant", "Done\x1b]0;owned\x07 here\x1b[2J\x9b1m."))
    async with without_model(tmp_path) as (app, pilot):
        await pilot.pause()
        drawn = app.screen._compositor.render_full_update().render_segments(app.console)
        assert "Done]0;owned here[2J1m." in drawn and "say [31mred" in drawn  # the text stays, its controls go
        assert "\x1b]0;owned" not in drawn and "\x1b[2J" not in drawn and "\x9b" not in drawn and "\x1b[31mred" not in drawn
        assert app.store.messages(app.chat.conv_id)[-1].content == "Done\x1b]0;owned\x07 here\x1b[2J\x9b1m."


@pilot_test
@pytest.mark.notorch
async def test_sigterm_quits_as_ctrl_q_does_keeping_the_reply_being_written(tmp_path, stored):
    """`kill` ended the app at once: the terminal stayed in its screen, mouse and raw modes, and the reply being written
    lost what came after its last save."""
    import os
    import signal

    caught: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))  # in place of the kill itself
    try:
        async with without_model(tmp_path) as (app, pilot):
            view = await reply_view(app.chat, 7)
            await app.chat.reply_delta(7, "the sea is")
            await until(pilot, lambda: view.answer_source == "the sea is", "the reply on screen")
            os.kill(os.getpid(), signal.SIGTERM)
            await until(pilot, lambda: not app.is_running, "the app to quit", timeout=10)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not caught and app.return_code == 0
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        last = store.messages(store.conversations()[0].id)[-1]
    assert (last.role, last.content, last.finished) == ("assistant", "the sea is", False)


LONG_SUMMARY = ("on cuda:0 (the only GPU) in bfloat16 (the GPU supports it) · 48/6144 int4 (GPTQ) "
                "experts on the GPU · drafter self (γ 4) · policy spac · calibration profile",
                "cuda:0 bf16 · 48/6144 int4 (GPTQ) on GPU · drafter self γ4 · policy spac · profile")
DEMO_SUMMARY = ("on cpu in float32 · all 256 experts on the CPU · drafter none · policy spac",
                "cpu fp32 · no drafter · policy spac")


@pilot_test
@pytest.mark.notorch
@pytest.mark.parametrize("model, summary, figures, said", [
    ("demo", DEMO_SUMMARY, (23.4, None, None, 4), {
        160: "demo  ·  23.4 tok/s  ·  acceptance –  ·  hit rate –  ·  4 tokens  ·  " + DEMO_SUMMARY[0],
        120: "demo · 23.4 tok/s · 4 tok · cpu fp32 · no drafter · policy spac",
        80: "demo · 23.4 tok/s · 4 tok · cpu fp32 · no drafter · policy spac"}),
    ("Qwen3-30B-A3B-GPTQ-Int4", LONG_SUMMARY, (23.4, 0.81, 0.95, 120), {
        160: "Qwen3-30B-A3B-GPTQ-Int4 · 23.4 tok/s · acc 0.81 · hit 0.95 · 120 tok · " + LONG_SUMMARY[1],
        120: "Qwen3-30B-A3B-GPTQ-Int4 · 23.4 tok/s · acc 0.81 · hit 0.95 · 120 tok · cuda:0 bf16 · 48/6144 int4 (GPTQ) on GPU",
        80: "Qwen3-30B-A3B-GPTQ-Int4 · 23.4 tok/s · acc 0.81 · hit 0.95 · 120 tok"}),
])
async def test_the_status_line_takes_a_short_form_that_fits_rather_than_a_cut(tmp_path, model, summary, figures, said):
    """Below about 150 columns the status line's engine summary was cut mid-word (`... · 0/256 experts on the fa`). The
    figures stay first; a narrower terminal gets them abbreviated and the summary's short form, whole parts only."""
    from moechat.app.tui.messages import EngineReady, Stats

    tps, acceptance, hit_rate, tokens = figures
    async with without_model(tmp_path, (160, 30)) as (app, pilot):
        app.post_message(EngineReady(model, *summary))
        await until(pilot, lambda: app.chat.model == model, "the engine ready")
        app.chat.show_stats(Stats(tokens_per_s=tps, acceptance=acceptance, hit_rate=hit_rate, new_tokens=tokens))
        status = app.chat.query_one("#status")
        for width, line in said.items():
            await pilot.resize_terminal(width, 30)
            await until(pilot, lambda w=width: status.content_size.width == w - 2, f"the status line at {width} columns")
            await pilot.pause()
            assert status.render().plain == line and len(line) <= width - 2
        app.chat.show_failed("the model failed to load: pick one with the setup wizard")  # not a summary: kept whole
        await pilot.pause()
        assert status.render().plain.endswith("engine stopped: the model failed to load: pick one with the setup wizard")


@pilot_test
@pytest.mark.notorch
async def test_a_note_set_before_the_view_is_composed_shows_once_it_is():
    """A log filled again while an earlier fill was still mounting (another window's change, checked twice): the
    unanswered note reached a view whose role line did not exist yet, and the app ended on NoMatches."""
    from textual.app import App
    from textual.widgets import Label

    from moechat.app.tui.screens.held import UNANSWERED

    early, late = MessageView("user", "hi"), MessageView("assistant", "hello", finished=False)
    early.set_note(UNANSWERED)  # not mounted: nothing to update yet, nothing raised
    async with App().run_test() as pilot:
        await pilot.app.mount_all([early, late])
        assert str(early.query_one(".role", Label).content) == f"you · {UNANSWERED}"
        assert str(late.query_one(".role", Label).content) == late.role_line == f"moechat · {late.end_line}"
        late.set_note("")
        assert str(late.query_one(".role", Label).content) == "moechat"
