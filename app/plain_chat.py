"""`moechat chat`: a line-by-line terminal chat on the engine or a remote backend (no TUI), also usable with piped
input. Each conversation is kept in the chat store (app/chats.py), as the app keeps its own: the app lists it."""
from __future__ import annotations

import functools
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager

from .chat_text import EMPTY_REPLY, elsewhere, finish_of, shows_nothing, title_from
from .chats import (
    SAVE_INTERVAL_S,
    ChatBusyError,
    ChatStore,
    ChatStoreError,
    ReplacedError,
)
from .terminal_text import as_typed, for_terminal

HELP = "type a message; /reset starts over, /quit or Ctrl-D leaves, Ctrl-C stops a reply"
# another window wrote into this chat between two turns: the model is sent the chat as stored, not only what it saw here
WRITTEN_THERE = ("this chat has messages from another moechat window since your last one: the reply reads them too, as "
                 "the chat stores them (/reset starts a new chat)")


class Keeper:
    """The conversation in the chat store as far as it can be kept: a chat deleted in another window, or not in the file
    put in place of the database (a backup restored: its ids are other chats there), goes on in a new one; a store that
    fails (the disk full, the database locked) is said once per message and the chat goes on."""

    def __init__(self, store, system: str | None) -> None:
        self.store, self.system = store, system or ""
        self.conv_id: int | None = None
        self.generation = store.generation  # the store's when the ids below were read: its writes name it
        self.reply_id: int | None = None
        self.user_id: int | None = None
        self.last = 0  # the chat's last message the model has seen, as stored (this chat's last reply): others' come after
        self.last_before = 0  # the turn before's, back where the turn is dropped
        self.new_chat = False  # the message being answered started its chat
        self.saved_at = 0.0
        self.said = False  # the store's failure said for the reply being written

    def user(self, text: str) -> list[dict] | None:
        """The user's message stored with an unfinished reply after it, in one claim of the chat (ChatBusyError: another
        window writes a reply there, nothing stored) -> the chat as stored before it where another window wrote there
        since this chat's last turn (what the model is to read instead of what it read), else None."""
        self.reply_id = self.user_id = None
        for _ in range(2):  # a second time in a new chat where the first was deleted elsewhere
            try:
                self.new_chat = self.conv_id is None
                if self.new_chat:
                    self.conv_id = self.store.create(title=title_from(text), system_prompt=self.system)
                    self.generation, self.last = self.store.generation, 0
                self.user_id, self.reply_id = self.store.claim_reply(self.conv_id, text, self.generation)
                self.saved_at, self.said = time.monotonic(), False
                return self._written_since()
            except KeyError as err:
                print(f"moechat: {elsewhere(isinstance(err, ReplacedError))}: it goes on in a new one", file=sys.stderr)
                self.conv_id = None
            except ChatBusyError:
                raise
            except ChatStoreError as err:
                print(f"moechat: {err}; this message is not saved", file=sys.stderr)
                return None
        return None

    def _written_since(self) -> list[dict] | None:
        """After a claim: the chat's system prompt and messages before it, where one came after this chat's last reply
        (another window's turn, or its Regenerate of that reply), else None. Unread (the store failing): None."""
        self.last_before, self.last = self.last, self.reply_id
        try:
            earlier = [m for m in self.store.messages(self.conv_id) if m.id < self.user_id]
            if not any(m.id > self.last_before for m in earlier):
                return None
            system = self.store.conversation(self.conv_id).system_prompt
        except (KeyError, ChatStoreError):
            return None
        return ([{"role": "system", "content": system}] if system else []) + [
            {"role": m.role, "content": m.content} for m in earlier if m.content]

    def due(self) -> bool:
        """Whether the reply streaming has gone unsaved for SAVE_INTERVAL_S."""
        return self.reply_id is not None and time.monotonic() - self.saved_at >= SAVE_INTERVAL_S

    def reply(self, text: str, finished: bool, finish: str | None = None) -> None:
        """The reply so far; finish: why a finished one ended (chat_text.FINISHES)."""
        if self.reply_id is None:
            return
        try:
            self.store.update(self.reply_id, text, finished=finished, generation=self.generation, finish=finish)
        except KeyError as err:
            print(f"\nmoechat: {elsewhere(isinstance(err, ReplacedError))}; this reply is not saved", file=sys.stderr)
            self.reply_id = None
        except ChatStoreError as err:  # said once per reply; the next save (and its last) tries again
            if not self.said:
                print(f"\nmoechat: {err}; this reply is not saved yet", file=sys.stderr)
            self.said = True
        self.saved_at = time.monotonic()

    def drop_turn(self) -> None:
        """Nothing came back (the prompt refused, Ctrl-C before the first token): the message is not in the conversation
        the model saw, so it goes from the stored one too, with its empty reply (and the chat it alone started)."""
        try:
            if self.new_chat and self.conv_id is not None and self.user_id is not None:
                self.store.delete(self.conv_id, self.generation)
                self.conv_id = None
            for message_id in (self.reply_id, self.user_id):
                if message_id is not None:
                    self.store.delete_message(message_id, self.generation)
            if self.reply_id is not None:  # gone: the turn before's reply is the last this chat stores of its own
                self.last = self.last_before
        except ChatStoreError:
            pass  # they stay, this chat's own (not read as another window's); the next message still goes on
        if self.reply_id is not None:  # not written here any more, gone or not (held, the chat's next turn was refused)
            self.store.let_go(self.reply_id)
        self.reply_id = self.user_id = None


class CtrlC:
    """Plain chat's SIGINT: a KeyboardInterrupt while `armed` (at the prompt and during a reply, which catch it), else held
    until `arm` raises it (the next prompt takes it as its own). Between a reply's end and the next prompt (the reply
    stored, its stats said) a Ctrl-C ended the whole chat, the reply's end unsaved."""

    def __init__(self) -> None:
        self.armed, self.held = True, False

    def __call__(self, signum, frame) -> None:
        if self.armed:
            raise KeyboardInterrupt
        self.held = True

    def arm(self) -> None:
        self.armed = True
        if self.held:
            self.held = False
            raise KeyboardInterrupt

    @contextmanager
    def installed(self):
        """This as the SIGINT handler, where Python's own is (the main thread; not where Ctrl-C is ignored)."""
        mine = threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        before = signal.signal(signal.SIGINT, self) if mine else None
        try:
            yield self
        finally:
            if mine:
                signal.signal(signal.SIGINT, before)


def _open_engine(args):
    """(engine, one line saying what runs, whether it is remote): the remote backend the flags or settings name, else
    the embedded engine."""
    from .remote import RemoteEngine, backend_overridden, remote_config

    remote = remote_config(args)
    if remote is None and (notice := backend_overridden(args)):
        print(f"moechat: {notice}", file=sys.stderr)
    if remote is not None:
        from .settings import load_settings

        if notice := load_settings()[1]:  # engine_config says it for the embedded engine; a remote one skips that
            print(f"moechat: warning: {notice}", file=sys.stderr)
        print(f"moechat: connecting to {remote.url}...", file=sys.stderr, flush=True)
        engine = RemoteEngine(remote)
        return engine, engine.summary, True
    from ..engine import Engine
    from .engine_config import engine_config
    from .generate import print_notices
    from .models import draft_model_name, model_name

    config = engine_config(args)  # a model not there (not pulled, a typo) refused before the line that says it loads
    print("moechat: loading the model...", file=sys.stderr, flush=True)
    engine = Engine(config)
    print_notices(engine)
    drafter = draft_model_name(args.draft) if engine.drafter.name == "model" else engine.drafter.name
    return engine, f"{model_name(args.model)} on {engine.model.device}, drafter: {drafter}", False


def cmd_chat(args) -> int:
    from .flags import request_thinking, sampling_params
    from .settings import load_settings

    params = sampling_params(args, load_settings()[0])  # a flag typed, else the settings' temperature, top-p, length
    reconfigure = getattr(sys.stdin, "reconfigure", None)  # a text file's; a stream a caller put there may lack it
    if reconfigure:  # a byte that is not UTF-8 under a UTF-8 locale: its line refused, not the chat ended (UnicodeDecodeError)
        reconfigure(errors="surrogateescape")
    said = functools.partial(print, "\nmoechat:", file=sys.stderr)  # the file deleted under it: made again, in one line
    with ChatStore(notice=said) as store:  # first: a chat database that cannot be used is said before minutes of loading
        engine, what, remote = _open_engine(args)
        try:
            print(f"moechat: {what}; {HELP}", file=sys.stderr)
            return _chat(engine, Keeper(store, args.system), params, remote, request_thinking(args))
        finally:
            engine.close()


def _chat(engine, kept: Keeper, params, remote: bool, thinking: bool | None = None) -> int:
    with CtrlC().installed() as ctrl_c:
        return _lines(engine, kept, params, remote, thinking, ctrl_c)


def _lines(engine, kept: Keeper, params, remote: bool, thinking: bool | None, ctrl_c: CtrlC) -> int:
    from ..engine import Error, Finished, MoechatError, Request, TokenDelta
    from .generate import acceptance, fast_tier
    from .history import fit_for_engine

    start = [{"role": "system", "content": kept.system}] if kept.system else []
    messages, said = list(start), ""
    interactive, shown = sys.stdin.isatty(), for_terminal(sys.stdout)
    while True:
        try:
            ctrl_c.arm()  # a Ctrl-C held since the last reply ended is one here
            text = as_typed(input("you> " if interactive else ""))
            ctrl_c.armed = False  # until the reply starts: held
        except EOFError:
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        if not text.strip():
            continue
        if text.strip() in ("/quit", "/exit"):
            return 0
        if text.strip() == "/reset":
            messages, kept.conv_id = list(start), None
            print("moechat: conversation cleared", file=sys.stderr)
            continue
        if re.fullmatch(r"/(\w+|\?)", text.strip()):  # a lone word (or ollama's /?) after a slash is a command, not a message
            print(f"moechat: unknown command {text.strip()}: /reset starts over, /quit leaves", file=sys.stderr)
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes the terminal's encoding could not read
            print("moechat: that line is not valid UTF-8 text: not sent", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        reply, finished, stopped, failed, events, stored = [], None, False, False, None, False
        try:  # Ctrl-C from here on stops this reply: while a long history is fitted to the context, it ended the chat
            ctrl_c.arm()
            try:
                stored = True  # drop_turn takes back this message's rows from here on; before, the Keeper holds the last turn's
                if (earlier := kept.user(text)) is not None:
                    messages = earlier + messages[-1:]
                    print(f"moechat: {WRITTEN_THERE}", file=sys.stderr)
                request, notice = (messages, "") if remote else fit_for_engine(engine, messages, params.max_new_tokens)
            except ChatBusyError as err:  # nothing stored: the line can be typed again once that reply ends
                messages.pop()
                print(f"moechat: {err}; this message is not sent", file=sys.stderr)
                continue
            except MoechatError as err:  # the chat template refuses it, say: one line, and the next message
                messages.pop()
                kept.drop_turn()
                print(f"moechat: error: {' '.join(str(err).split())}", file=sys.stderr)
                continue
            if notice and notice != said:  # once per cut
                print(f"moechat: {notice}", file=sys.stderr)
            said = notice
            sys.stdout.write("moechat> ")
            events = engine.generate(Request(messages=list(request), thinking=thinking), params)
            for ev in events:
                if isinstance(ev, TokenDelta):
                    reply.append(ev.text)
                    sys.stdout.write(shown(ev.text))
                    sys.stdout.flush()
                    if kept.due():
                        kept.reply("".join(reply), finished=False)
                elif isinstance(ev, Error):  # the embedded engine is sent no turn that does not fit: the message is too long
                    hint = " (/reset starts a new conversation)" if remote else " (this message alone is too long: shorten it)"
                    print(f"\nmoechat: error: {ev.message}" + (hint if "context" in ev.message else ""), file=sys.stderr)
                    failed = True
                elif isinstance(ev, Finished):
                    finished = ev
            ctrl_c.armed = False  # the reply's end stored and said before the next prompt: a Ctrl-C meanwhile waits for it
        except KeyboardInterrupt:
            ctrl_c.armed = False
            if events is not None:
                events.close()  # cancels the request; the engine (or the server) is ready for the next one
            stopped = True
            print("\nmoechat: stopped", file=sys.stderr)
        if finished is not None and shows_nothing(finished.text):  # the model ended its turn at once: as the app says it
            sys.stdout.write(EMPTY_REPLY)
        print(flush=True)
        if finished is None and not reply:
            messages.pop()  # nothing came back: the user's message can be sent again
            if stored:
                kept.drop_turn()
            continue
        answer = finished.text if finished else "".join(reply)
        messages.append({"role": "assistant", "content": answer})
        # stopped by the user, or failed, as the app stores it: ended, not cut off
        why = finished.summary.finish_reason if finished else "cancelled" if stopped else "failed" if failed else None
        kept.reply(answer, finished=why is not None, finish=finish_of(why) if why else None)
        if why is None and kept.reply_id is not None:  # cut off (a remote stream ended without its end): interrupted
            kept.store.let_go(kept.reply_id)
        if finished:
            s = finished.summary
            hits = f"{s.hit_rate:.2f}" if s.hits + s.misses else "n/a"  # a remote server other than moechat's sends none
            experts = f"expert hit rate {hits}" if remote or fast_tier(engine) else "experts all on the CPU"
            cut = " [cut at the length limit: --max-new-tokens raises it]" if s.finish_reason == "length" else ""
            print(f"[{s.new_tokens} tokens, {s.decode_tokens_per_s:.1f} tok/s, acceptance {acceptance(s)}, "
                  f"{experts}]" + (f" [{s.lossy}]" if s.lossy else "") + cut, file=sys.stderr)
