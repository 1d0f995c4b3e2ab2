"""`moechat chat` (app/plain_chat.py) and the chat store: a reply saved as it streams, so a kill or a closed terminal
keeps it; a chat deleted in another window goes on in a new one; a store that fails is said and the chat goes on."""
from __future__ import annotations

import io
import signal
import sys

import pytest

from moechat.app import plain_chat
from moechat.app.chat_text import WRITING_HERE_ELSEWHERE
from moechat.app.chats import ChatStore
from moechat.engine.config import SamplingParams
from moechat.engine.events import TokenDelta


class Streaming:
    """An engine that streams `words` one by one, and calls `during(i)` before the i-th."""

    def __init__(self, words: list[str], during=lambda i: None) -> None:
        self.words, self.during = words, during

    def generate(self, request, params):
        for i, word in enumerate(self.words):
            self.during(i)
            yield TokenDelta(word, [i])


def run(engine, store, lines: str, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    assert plain_chat._chat(engine, plain_chat.Keeper(store, None), SamplingParams(), remote=True) == 0


def test_a_reply_is_saved_as_it_streams(tmp_path, monkeypatch, capsys):
    """It was stored only at its end: a kill, or SIGHUP from a closed terminal, left an empty reply."""
    monkeypatch.setattr(plain_chat, "SAVE_INTERVAL_S", 0.0)  # a save due at every token
    seen = []

    def look(i: int) -> None:
        with ChatStore(tmp_path / "chats.sqlite3") as other:  # what a kill at this moment would leave
            conv = other.conversations()[0].id
            seen.append([(m.role, m.content, m.finished) for m in other.messages(conv)])

    with ChatStore(tmp_path / "chats.sqlite3") as store:
        run(Streaming(["The ", "sea ", "is ", "wide."], look), store, "tell me about the sea\n", monkeypatch)
    assert [s[-1][1] for s in seen] == ["", "The ", "The sea ", "The sea is "]  # the reply so far, before each token
    assert all(s[-1][2] is False for s in seen) and seen[0][0] == ("user", "tell me about the sea", True)
    capsys.readouterr()


def test_a_chat_deleted_elsewhere_goes_on_in_a_new_one(tmp_path, monkeypatch, capsys):
    """The next line failed with 'internal error (KeyError ...)' and the command exited."""
    path = tmp_path / "chats.sqlite3"

    def delete_the_chat(i: int) -> None:
        if i == 0 and len(seen) == 0:
            seen.append(1)
            with ChatStore(path) as other:
                other.delete(other.conversations()[0].id)

    seen: list[int] = []
    with ChatStore(path) as store:
        run(Streaming(["Hi."], delete_the_chat), store, "first\nsecond\n", monkeypatch)
        convs = store.conversations()
        assert len(convs) == 1 and [(m.role, m.content) for m in store.messages(convs[0].id)] == [
            ("user", "second"), ("assistant", "Hi.")]
    err = capsys.readouterr().err
    assert "deleted in another moechat window" in err and "Traceback" not in err and "internal error" not in err


def test_a_backup_restored_while_a_reply_streams_keeps_its_rows_and_the_chat_goes_on_in_a_new_one(tmp_path, monkeypatch,
                                                                                                   capsys):
    """The reply's next save overwrote the backup's message of the same id, and the next line went into the backup's chat
    of the same id."""
    import os
    import shutil
    import sqlite3

    monkeypatch.setattr(plain_chat, "SAVE_INTERVAL_S", 0.0)  # a save due at every token
    path = tmp_path / "chats.sqlite3"
    with ChatStore(tmp_path / "backup.sqlite3") as backup:  # chat 1, messages 1 to 3: the ids the chat holds
        conv = backup.create("from the backup")
        for role, content in (("user", "q"), ("assistant", "a"), ("user", "q2")):
            backup.add(conv, role, content)

    def rows(file) -> list[list[tuple]]:
        with sqlite3.connect(file) as raw:
            return [raw.execute(f"SELECT * FROM {table} ORDER BY id").fetchall() for table in ("conversations", "messages")]

    def restore(i: int) -> None:
        if i == 1 and not restored:  # as the first reply streams
            restored.append(1)
            shutil.copy(tmp_path / "backup.sqlite3", tmp_path / "restoring")
            os.replace(tmp_path / "restoring", path)

    before, restored = rows(tmp_path / "backup.sqlite3"), []
    with ChatStore(path, notice=lambda line: None) as store:
        run(Streaming(["Hi ", "there."], restore), store, "first\nsecond\n", monkeypatch)
        chats = {c.title: [(m.role, m.content) for m in store.messages(c.id)] for c in store.conversations()}
    after = rows(path)
    assert after[0][:1] == before[0] and after[1][:3] == before[1]
    assert chats == {"from the backup": [("user", "q"), ("assistant", "a"), ("user", "q2")],
                     "second": [("user", "second"), ("assistant", "Hi there.")]}
    err = capsys.readouterr().err
    assert "this chat is not in the file put in place of the chat database; this reply is not saved" in err
    assert "it goes on in a new one" in err and "Traceback" not in err


def test_a_store_that_fails_is_said_and_the_chat_goes_on(tmp_path, monkeypatch, capsys):
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        store._db.execute("PRAGMA query_only = ON")  # every write refused, as on a read-only file
        run(Streaming(["Still ", "here."]), store, "hello\nagain\n", monkeypatch)
    out, err = capsys.readouterr()
    assert out.count("Still here.") == 2 and err.count("this message is not saved") == 2 and "Traceback" not in err


def test_a_message_that_got_no_reply_is_not_stored(tmp_path, monkeypatch, capsys):
    """The refused message (a prompt past the context) stayed stored, so the app later sent it back to the model."""
    from moechat.engine.events import Error

    class Refusing(Streaming):
        def generate(self, request, params):
            if request.messages[-1]["content"].startswith("x"):
                yield Error("the prompt is longer than the context")
                return
            yield from super().generate(request, params)

    with ChatStore(tmp_path / "chats.sqlite3") as store:
        run(Refusing(["A dog."]), store, "x-too-long\nWhat is a dog?\nxx again\n", monkeypatch)
        ((conv),) = store.conversations()
        assert conv.title == "What is a dog?"  # the chat the refused first line started went with it
        assert [(m.role, m.content) for m in store.messages(conv.id)] == [("user", "What is a dog?"), ("assistant", "A dog.")]
    capsys.readouterr()


def test_a_conversation_longer_than_the_context_in_characters_goes_on(tmp_path, monkeypatch, capsys, checkpoint):
    """With a small context, the history's characters passed the engine's check before tokenizing, which the trimming
    reached first: the command exited with "moechat: error: the prompt has N characters" and read no more lines."""
    from moechat.engine.config import EngineConfig
    from moechat.engine.generate import Engine

    engine = Engine(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), context_len=256))
    longest = max(map(len, engine.model.tokenizer.get_vocab()))
    question = "Tell me about the wide sea and the moon over it. " * 2  # 100 characters: a turn fits the context
    lines = "".join(f"{i}: {question}\n" for i in range(2 * longest * 256 // len(question) + 4)) + "And the stars?\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        assert plain_chat._chat(engine, plain_chat.Keeper(store, None), SamplingParams(max_new_tokens=4), remote=False) == 0
        ((conv),) = store.conversations()
        messages = store.messages(conv.id)
    err = capsys.readouterr().err
    assert "error" not in err and "oldest messages no longer fit" in err
    assert [m.content for m in messages if m.role == "user"][-1] == "And the stars?" and messages[-1].role == "assistant"
    engine.close()


def test_a_message_longer_than_the_context_alone_is_not_told_to_reset(tmp_path, monkeypatch, capsys, checkpoint):
    """The earlier turns are left out of a request before the engine counts it, so a refusal for the context is the new
    message alone: the line said "(/reset starts a new conversation)", which cannot help; the conversation goes on."""
    from moechat.engine.config import EngineConfig
    from moechat.engine.generate import Engine

    engine = Engine(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), context_len=64))
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello!\n" + "the sea " * 60 + "\nAnd the moon?\n"))
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        assert plain_chat._chat(engine, plain_chat.Keeper(store, None), SamplingParams(max_new_tokens=4), remote=False) == 0
        ((conv),) = store.conversations()
        users = [m.content for m in store.messages(conv.id) if m.role == "user"]
    err = capsys.readouterr().err
    assert "but the context holds 64" in err and "/reset" not in err and "this message alone is too long" in err
    assert users == ["Hello!", "And the moon?"]  # the refused message is not stored; the turns around it are
    engine.close()


def test_a_reply_stopped_with_ctrl_c_is_stored_as_stopped_not_cut(tmp_path, monkeypatch, capsys):
    """Stored unfinished, the app later showed it as "interrupted" (a crash's mark); the app stores its own stops finished."""
    def ctrl_c(i: int) -> None:
        if i == 2:
            raise KeyboardInterrupt

    with ChatStore(tmp_path / "chats.sqlite3") as store:
        run(Streaming(["The ", "sea ", "is ", "wide."], ctrl_c), store, "tell me about the sea\n", monkeypatch)
        ((conv),) = store.conversations()
        reply = store.messages(conv.id)[-1]
    assert (reply.role, reply.content, reply.finished, reply.finish) == ("assistant", "The sea ", True, "cancelled")
    assert "moechat: stopped" in capsys.readouterr().err


class Ending(Streaming):
    """Streams `words`, then ends with `end`: a Finished whose finish_reason it names, or an Error."""

    def __init__(self, words: list[str], end: str) -> None:
        super().__init__(words)
        self.end = end

    def generate(self, request, params):
        from moechat.engine.events import Error, Finished, Summary

        yield from super().generate(request, params)
        if self.end == "error":
            yield Error("the server went away")
            return
        yield Finished(list(range(len(self.words))), "".join(self.words),
                       Summary(1, len(self.words), len(self.words), 0, 0, 0.1, 0.1, 0.1, 0, 0, 0, self.end))


@pytest.mark.parametrize("end, finish", [("length", "length"), ("eos", "stop"), ("error", "failed")])
def test_why_a_reply_ended_is_stored_as_the_app_stores_it(tmp_path, monkeypatch, capsys, end, finish):
    """The app shows a reply cut at the length limit, or failed, as such after a restart: plain chat stores why too, and
    says a cut one is cut (it stopped mid-word with its usual stats line)."""
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        run(Ending(["The ", "sea."], end), store, "tell me about the sea\n", monkeypatch)
        ((conv),) = store.conversations()
        reply = store.messages(conv.id)[-1]
    assert (reply.content, reply.finished, reply.finish) == ("The sea.", True, finish)
    said = capsys.readouterr().err
    assert ("cut at the length limit: --max-new-tokens raises it" in said) == (end == "length"), said


def interrupt_the_fit_of(n: int, monkeypatch) -> list[str]:
    """Ctrl-C while the n-th message is fitted to the context -> the messages fitted, as they come."""
    calls = []

    def fit(engine, messages, reply_room):
        calls.append(messages[-1]["content"])
        if len(calls) == n:
            raise KeyboardInterrupt
        return messages, ""

    monkeypatch.setattr("moechat.app.history.fit_for_engine", fit)
    return calls


def test_ctrl_c_while_a_long_history_is_fitted_stops_that_message_not_the_chat(tmp_path, monkeypatch, capsys):
    """Fitting a long conversation to the context takes a moment (0.4 s at 60 turns of the demo) before the reply starts:
    a Ctrl-C there ended `moechat chat` ("interrupted", exit 130) and the lines after it were never read."""
    calls = interrupt_the_fit_of(1, monkeypatch)
    monkeypatch.setattr(sys, "stdin", io.StringIO("first\nsecond\n"))
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        try:
            assert plain_chat._chat(Streaming(["Hi."]), plain_chat.Keeper(store, None), SamplingParams(), remote=False) == 0
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C ended the chat")
        ((conv),) = store.conversations()
        stored = [(m.role, m.content) for m in store.messages(conv.id)]
    assert calls == ["first", "second"] and stored == [("user", "second"), ("assistant", "Hi.")]
    assert "moechat: stopped" in capsys.readouterr().err


def test_ctrl_c_while_the_next_message_is_fitted_keeps_the_turns_before(tmp_path, monkeypatch, capsys):
    """A Ctrl-C before the second message was stored took back the first turn's rows instead (the Keeper still held
    them), and with them the chat that turn had started: the whole conversation was deleted from the store."""
    calls = interrupt_the_fit_of(2, monkeypatch)
    monkeypatch.setattr(sys, "stdin", io.StringIO("first\nsecond\nthird\n"))
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        assert plain_chat._chat(Streaming(["Hi."]), plain_chat.Keeper(store, None), SamplingParams(), remote=False) == 0
        convs = store.conversations()
        stored = [(m.role, m.content) for c in convs for m in store.messages(c.id)]
    assert calls == ["first", "second", "third"] and len(convs) == 1
    assert stored == [("user", "first"), ("assistant", "Hi."), ("user", "third"), ("assistant", "Hi.")]
    capsys.readouterr()


def ctrl_c_in(method: str, monkeypatch) -> None:
    """A real Ctrl-C the first time Keeper.<method> runs: SIGINT, whose handler Python runs before raise_signal returns."""
    original, came = getattr(plain_chat.Keeper, method), []

    def pressed(self, *args, **kw):
        if not came:
            came.append(True)
            signal.raise_signal(signal.SIGINT)
        return original(self, *args, **kw)

    monkeypatch.setattr(plain_chat.Keeper, method, pressed)


@pytest.mark.parametrize("moment", ["reply", "drop_turn"])
def test_ctrl_c_as_a_reply_ends_is_a_ctrl_c_at_the_prompt(tmp_path, monkeypatch, capsys, moment):
    """Between a reply's end and the next prompt (the reply stored, its stats said: milliseconds) a Ctrl-C ended the whole
    chat ("interrupted", exit 130), the lines after it unread and the reply's end unsaved; so did one pressed while a
    reply stopped before its first token was taken back from the store."""
    monkeypatch.setattr(plain_chat, "SAVE_INTERVAL_S", 1e9)  # Keeper.reply runs once a turn: as the reply ends
    ctrl_c_in(moment, monkeypatch)
    first = [True] if moment == "drop_turn" else []  # the first reply stopped before its first token

    def stop(i: int) -> None:
        if first:
            first.clear()
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(sys, "stdin", io.StringIO("first\nsecond\n"))
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        try:
            assert plain_chat._chat(Streaming(["Hi."], stop), plain_chat.Keeper(store, None), SamplingParams(),
                                    remote=True) == 0
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C ended the chat")
        stored = [(m.role, m.content) for c in store.conversations() for m in store.messages(c.id)]
    assert stored == ([("user", "first"), ("assistant", "Hi.")] if moment == "reply" else []) + [
        ("user", "second"), ("assistant", "Hi.")]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back as it was
    capsys.readouterr()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_a_replys_escape_sequences_reach_a_terminal_as_caret_notation_and_the_store_as_they_are(tmp_path, monkeypatch,
                                                                                                   tty):
    """A reply's `ESC ]0;…BEL` retitled the user's terminal window and its `ESC [2J` cleared it: they went to it raw.
    A pipe still gets the reply byte for byte."""
    out = Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        run(Streaming(["Hi\x1b]0;owned\x07 ", "there\x1b[2J\x9b1m."]), store, "hello\n", monkeypatch)
        stored = store.messages(store.conversations()[0].id)[-1].content
    assert stored == "Hi\x1b]0;owned\x07 there\x1b[2J\x9b1m."
    shown = "Hi^[]0;owned^G there^[[2JM-^[1m." if tty else stored
    assert out.getvalue() == f"moechat> {shown}\n"


class Closing(Streaming):
    def close(self) -> None:
        pass


def test_a_reply_the_locales_encoding_cannot_write_is_kept_and_the_chat_goes_on(tmp_path, monkeypatch):
    """Under an ASCII locale (PYTHONUTF8=0 LC_ALL=C) a reply's "é" ended the chat ("moechat: error: 'ascii' codec
    can't encode ..."), exit 1, and the reply was lost: its row stayed empty and unfinished."""
    from moechat.app.cli import main

    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="surrogateescape")  # how Python opens it there
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n"))
    monkeypatch.setattr(plain_chat, "_open_engine", lambda args: (Closing(["Caf\u00e9 ", "\U0001f642."]), "fake", True))
    monkeypatch.setattr(plain_chat, "ChatStore", lambda notice: ChatStore(tmp_path / "chats.sqlite3", notice=notice))
    assert main(["chat", "--plain"]) == 0
    out.flush()
    assert out.buffer.getvalue().decode("ascii") == "moechat> Caf? ?.\n" * 2
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        stored = [m.content for m in store.messages(store.conversations()[0].id)]
    assert stored == ["hello", "Caf\u00e9 \U0001f642.", "again", "Caf\u00e9 \U0001f642."]


@pytest.mark.parametrize("errors", ["surrogateescape", "strict"])
def test_utf8_lines_are_taken_and_a_line_that_is_not_is_refused_alone(tmp_path, monkeypatch, capsys, errors):
    """Under an ASCII locale (PYTHONUTF8=0 LC_ALL=C: stdin ascii, surrogateescape) "café" typed or piped was refused as
    "not valid UTF-8"; under a UTF-8 one (stdin strict) a byte that is not UTF-8 ended the chat (exit 1, "'utf-8' codec
    can't decode byte 0xe9"), the lines after it unread."""
    from moechat.app.cli import main

    encoding = "ascii" if errors == "surrogateescape" else "utf-8"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xc3\xa9\ncaf\xe9\nagain\n"), encoding, errors))
    monkeypatch.setattr(plain_chat, "_open_engine", lambda args: (Closing(["Oui."]), "fake", True))
    monkeypatch.setattr(plain_chat, "ChatStore", lambda notice: ChatStore(tmp_path / "chats.sqlite3", notice=notice))
    assert main(["chat", "--plain"]) == 0
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        stored = [m.content for m in store.messages(store.conversations()[0].id)]
    assert stored == ["caf\u00e9", "Oui.", "again", "Oui."]
    assert capsys.readouterr().err.count("that line is not valid UTF-8 text: not sent") == 1


@pytest.mark.parametrize("words", [[], ["<think>\n\n</think>\n\n"]])
def test_an_empty_reply_says_so_as_the_app_does(tmp_path, monkeypatch, capsys, words):
    """A reply the model ended at once printed a blank line where the app and the export say "(empty reply)"."""
    with ChatStore(tmp_path / "chats.sqlite3") as store:
        run(Ending(words, "eos"), store, "hello\n", monkeypatch)
        reply = store.messages(store.conversations()[0].id)[-1]
    assert (reply.content, reply.finished) == ("".join(words), True)
    assert "moechat> " + "".join(words) + "(empty reply)\n" in capsys.readouterr().out


class Recording(Ending):
    """Ending at the end of turn, and each request's messages kept as (role, content)."""

    def __init__(self, words: list[str]) -> None:
        super().__init__(words, "eos")
        self.sent: list[list[tuple[str, str]]] = []

    def generate(self, request, params):
        self.sent.append([(m["role"], m["content"]) for m in request.messages])
        return super().generate(request, params)


class Typed(io.StringIO):
    """Lines typed, and before the line that starts with a key of `meanwhile`, its function run (another window)."""

    def __init__(self, lines: str, meanwhile: dict) -> None:
        super().__init__(lines)
        self.meanwhile = meanwhile

    def readline(self, *args) -> str:
        line = super().readline(*args)
        for start, then in self.meanwhile.items():
            if line.startswith(start):
                then()
        return line


def test_a_turn_after_another_window_wrote_into_the_chat_reads_the_chat_as_stored(tmp_path, monkeypatch, capsys):
    """Plain chat sent the model its own memory of the chat: the turn another window added was stored before its next
    message and reply, yet the model never read it."""
    path = tmp_path / "chats.sqlite3"

    def other_window() -> None:
        with ChatStore(path) as other:
            conv = other.conversations()[0].id
            _, reply = other.claim_reply(conv, "from the app")
            other.update(reply, "the app's answer", finished=True, finish="stop")

    engine = Recording(["Hi."])
    monkeypatch.setattr(sys, "stdin", Typed("first\nsecond\nthird\n", {"second": other_window}))
    with ChatStore(path) as store:
        assert plain_chat._chat(engine, plain_chat.Keeper(store, None), SamplingParams(), remote=True) == 0
        stored = [(m.role, m.content) for m in store.messages(store.conversations()[0].id)]
    turn = [("user", "first"), ("assistant", "Hi."), ("user", "from the app"), ("assistant", "the app's answer")]
    assert engine.sent[1:] == [turn + [("user", "second")], turn + [("user", "second"), ("assistant", "Hi."), ("user", "third")]]
    assert stored == turn + [("user", "second"), ("assistant", "Hi."), ("user", "third"), ("assistant", "Hi.")]
    assert capsys.readouterr().err.count(plain_chat.WRITTEN_THERE) == 1  # said once: the third turn saw nothing new


def test_a_message_into_a_chat_another_window_writes_into_is_not_sent(tmp_path, monkeypatch, capsys):
    """Plain chat started a second reply beside the one the app was writing: the two interleaved the chat."""
    path, other = tmp_path / "chats.sqlite3", []

    def begins() -> None:  # the app's reply into this chat, being written while plain chat's next line comes
        other.append(ChatStore(path))
        other.append(other[0].claim_reply(other[0].conversations()[0].id, "from the app")[1])

    def ends() -> None:
        other[0].update(other[1], "the app's answer", finished=True, finish="stop")
        other[0].close()

    engine = Recording(["Hi."])
    monkeypatch.setattr(sys, "stdin", Typed("first\nsecond\nthird\n", {"second": begins, "third": ends}))
    with ChatStore(path) as store:
        assert plain_chat._chat(engine, plain_chat.Keeper(store, None), SamplingParams(), remote=True) == 0
        stored = [(m.role, m.content) for m in store.messages(store.conversations()[0].id)]
    assert [sent[-1] for sent in engine.sent] == [("user", "first"), ("user", "third")]
    assert stored == [("user", "first"), ("assistant", "Hi."), ("user", "from the app"), ("assistant", "the app's answer"),
                      ("user", "third"), ("assistant", "Hi.")]
    assert f"moechat: {WRITING_HERE_ELSEWHERE}; this message is not sent" in capsys.readouterr().err


def test_a_turn_whose_take_back_failed_does_not_hold_the_chat_as_being_written(tmp_path, monkeypatch, capsys):
    """A reply that got nothing back is taken back with its chat; where the store refused that delete (locked by another
    window's write), its lock stayed held here and every later message was refused as "being written" in that chat; and
    the rows left were read as another window's, sent again with each next message (refused again, a prompt too long)."""
    from moechat.app.chats import ChatStoreError
    from moechat.engine.events import Error

    class RefusingFirst(Streaming):
        def generate(self, request, params):
            if any(m["content"] == "first" for m in request.messages):
                yield Error("the prompt is longer than the context")
                return
            yield from super().generate(request, params)

    with ChatStore(tmp_path / "chats.sqlite3") as store:
        def locked(conv_id, generation=None):
            raise ChatStoreError("chat database is locked")

        monkeypatch.setattr(store, "delete", locked)
        run(RefusingFirst(["Hi."]), store, "first\nsecond\n", monkeypatch)
        stored = [(m.role, m.content) for c in store.conversations() for m in store.messages(c.id)]
    err = capsys.readouterr().err
    assert "being written" not in err and "another moechat window" not in err
    assert stored[-2:] == [("user", "second"), ("assistant", "Hi.")]
