"""`MoechatApp`: the Textual app. It owns the chat store and the engine thread (EngineBridge), paints
before the model loads (the bridge starts in on_mount) and routes what the engine posts to the
chat screen. Importing this module imports no torch: the engine loads in the bridge's thread."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

from textual.app import App
from textual.binding import Binding
from textual.filter import LineFilter

from ...engine import native, write_whole
from ..bridge import EngineBridge
from ..chat_export import export_markdown
from ..chat_file import DamagedFile
from ..chats import ChatStore, ChatStoreError
from ..options import SETTINGS_SAMPLING, in_app_words, winning_flags
from ..settings import Settings, kept_aside_on_save, load_settings, save_settings, settings_path
from ..terminal_text import CONTROLS
from . import messages as m
from .commands import BINDINGS, CHAT_ACTIONS, MoechatCommands, checked_keymap
from .guard import store_failures_noticed
from .screens.chat import ChatScreen
from .screens.damaged_chats import moved_aside
from .screens.dialogs import Confirm, TextPrompt
from .screens.help import HelpScreen

DARK_LIGHT_THEMES = ("textual-dark", "textual-light")


def textual_theme(name: str) -> str:
    return {"dark": DARK_LIGHT_THEMES[0], "light": DARK_LIGHT_THEMES[1]}.get(name, name)


class ControlFilter(LineFilter):
    """Drops the control characters of what the app draws (a reply's, a pasted message's): Textual drops only BEL, BS,
    VT, FF and CR, so a reply's `ESC ]0;…` retitled the terminal and its `ESC [2J` cleared it. They take no cells in
    Textual's layout, so the lines keep their widths."""

    def apply(self, segments: list, background) -> list:
        return [segment._replace(text=CONTROLS.sub("", segment.text))
                if not segment.control and CONTROLS.search(segment.text) else segment for segment in segments]


CONTROL_FILTER = ControlFilter()


class MoechatApp(App):
    CSS_PATH = "moechat.tcss"
    TITLE = "moechat"
    COMMANDS = App.COMMANDS | {MoechatCommands}
    BINDINGS: ClassVar[list[Binding]] = BINDINGS  # ids and keys in commands.py

    def __init__(self, config_factory: Callable, sampling=None, store_path: Path | None = None,
                 export_dir: Path | None = None, first_run: bool = False, settings_file: Path | None = None) -> None:
        """sampling: SamplingParams for replies; None: the settings' temperature, top-p and max new tokens."""
        super().__init__()
        self.store = ChatStore(store_path, notice=lambda text: self.notify(text, severity="warning", timeout=15))
        self.store_path = self.store.path
        self.bridge = EngineBridge(self.post_message, config_factory)
        self.export_dir, self.first_run = export_dir, first_run
        self.settings_file = settings_file or settings_path()
        self.settings, self.settings_notice = load_settings(self.settings_file)
        self.sampling = sampling or sampling_from(self.settings)
        self.thinking = self.settings.thinking  # auto | on | off (None: auto): the chat template's enable_thinking
        self.chat = ChatScreen()
        self.bridge_started = False
        self.unsaved_replies: list[tuple[str, str]] = []  # (why, the text) for each reply quitting could not save, and a
        # message refused while its chat was not shown
        self.engine_notice: Callable[[], str | None] | None = None  # run_tui's: a --model over the settings' backend
        self.flags: dict[str, object] = {}  # run_tui's settings typed as flags: every load takes them over the file
        self.store_notice: str | None = None  # run_tui's: where a damaged chat database went

    def get_default_screen(self) -> ChatScreen:
        return self.chat

    def get_line_filters(self) -> list[LineFilter]:
        return [*super().get_line_filters(), CONTROL_FILTER]

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        return self.runs_on(action, self.screen)

    def runs_on(self, action: str, screen) -> bool:
        """Chat actions only on the chat screen (the wizard and settings keep their own keys and footer); settings and
        the wizard once each: a second one under the first would write back what the first saved. In a dialog its own
        keys only, as its footer shows them: Textual keeps the app's F1 from a modal screen, but not the palette's Ctrl+P,
        whose entries did nothing there."""
        from .screens.settings import SettingsScreen
        from .screens.wizard import WizardScreen

        if action in ("settings", "setup") and any(isinstance(s, (SettingsScreen, WizardScreen)) for s in self.screen_stack):
            return False
        if action == "command_palette" and isinstance(screen, (TextPrompt, Confirm)):
            return False
        if action == "help" and isinstance(screen, HelpScreen):  # shown already: F1 there closes it
            return False
        return action not in CHAT_ACTIONS or screen is self.chat

    def notify(self, message: str, *, title: str = "", severity="information", timeout: float | None = None,
               markup: bool = False) -> None:
        """Every toast as plain text: they quote paths, titles and the settings' `[keys]`, which are not markup."""
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=False)

    def on_mount(self) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError):  # Windows, or not the main thread: as before
            # `kill` (SIGTERM) quits as Ctrl+Q does: it ended the process with the terminal left in the app's screen,
            # mouse and raw modes, and the reply being written unsaved since its last save
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.exit)
        for notice in (self.settings_notice, self.apply_look(self.settings)):
            if notice:
                self.notify(notice, severity="warning", timeout=10)
        if self.store_notice:  # a path to note down: longer
            self.notify(self.store_notice, severity="warning", timeout=30)
        if self.first_run:  # the model the wizard picks loads when it closes, not the default one first
            self.action_setup()
        else:
            self.call_after_refresh(self.start_engine)  # the screen paints first; the model loads while the UI runs

    async def on_unmount(self) -> None:
        try:
            with contextlib.suppress(ChatStoreError):  # the file deleted a moment ago: made again (else kept pending)
                self.store.changed_elsewhere()
            self.unsaved_replies = self.chat.save_partial()  # what the database would not take: run_tui prints it
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)  # a later SIGTERM: the default again
            self.bridge.close()
            self.store.close()

    # ---- what the engine thread posts (dropped once shutting down: on_unmount saves the reply) -------
    def on_engine_loading(self, msg: m.EngineLoading) -> None:
        if not self.is_running:
            return
        self.chat.show_loading(msg.fraction, msg.label)

    def on_engine_ready(self, msg: m.EngineReady) -> None:
        if not self.is_running:
            return
        self.chat.show_ready(msg.model, msg.summary, msg.brief, msg.remote)
        if msg.notice:
            self.notify(msg.notice, title="moechat", severity="warning", timeout=8)

    async def on_engine_failed(self, msg: m.EngineFailed) -> None:
        if not self.is_running:
            return
        said = in_app_words(msg.message)  # the settings screen's names, not the command line's flags
        if msg.request_id is None:
            self.notify(said, title="moechat", severity="error", timeout=10)
            self.chat.show_failed(said)
            return
        back = await self.chat.reply_refused(msg.request_id) if msg.request_fault else ""  # where the message went
        if not back:
            await self.chat.reply_finished(msg.request_id, "", "failed", None)
        self.notify(said + back, title="moechat", severity="error", timeout=15 if back else 10)

    async def on_reply_delta(self, msg: m.ReplyDelta) -> None:
        if not self.is_running:
            return
        await self.chat.reply_delta(msg.request_id, msg.text)

    def on_reply_notice(self, msg: m.ReplyNotice) -> None:
        if self.is_running:
            self.notify(msg.text, title="moechat", timeout=8)

    def on_reply_progress(self, msg: m.ReplyProgress) -> None:
        if self.is_running:
            self.chat.reply_progress(msg.request_id, msg.done, msg.total)

    def on_reply_stats(self, msg: m.ReplyStats) -> None:
        if not self.is_running:
            return
        self.chat.show_stats(msg.stats)

    def on_expert_frame(self, msg: m.ExpertFrame) -> None:
        if not self.is_running:
            return
        self.chat.show_frame(msg.frame)

    async def on_reply_finished(self, msg: m.ReplyFinished) -> None:
        if not self.is_running:
            return
        await self.chat.reply_finished(msg.request_id, msg.text, msg.reason, msg.stats)

    # ---- actions --------------------------------------------------------------------------------
    def action_stop(self) -> None:
        self.chat.stop()

    async def action_new_chat(self) -> None:
        await self.chat.new_chat()

    async def action_regenerate(self) -> None:
        await self.chat.regenerate()

    def _conversation(self, none_yet: str):
        """The chat the log shows; None, said, where there is none yet or it was deleted in another window."""
        conv = self.chat.current_conversation()
        if conv is None and self.chat.conv_id is not None:
            self.call_later(self.chat.deleted_elsewhere)
        elif conv is None and none_yet:
            self.notify(none_yet, severity="warning")
        return conv

    @store_failures_noticed
    def action_rename_chat(self) -> None:
        conv, generation = self._conversation("no conversation yet: send a message first"), self.chat.generation
        if conv is not None:
            self.push_screen(TextPrompt("Rename chat", conv.title), lambda title: self._rename(conv.id, title, generation))

    @store_failures_noticed
    async def _rename(self, conv_id: int, title: str | None, generation: int) -> None:
        """generation: the store's when the dialog opened (a backup restored while it was open has another chat of its id)."""
        if not title:
            return
        try:
            self.store.rename(conv_id, title, generation)
        except KeyError:  # deleted in another window while the dialog was open
            await self.chat.deleted_elsewhere()
            return
        await self.chat.refresh_conversations()

    @store_failures_noticed
    def action_system_prompt(self) -> None:
        conv, generation = self._conversation("no conversation yet: start one with Ctrl+N"), self.chat.generation
        if conv is not None:
            self.push_screen(TextPrompt("System prompt (Ctrl+S saves)", conv.system_prompt, multiline=True),
                             lambda text: self._set_system_prompt(conv.id, text, generation))

    @store_failures_noticed
    async def _set_system_prompt(self, conv_id: int, text: str | None, generation: int) -> None:
        """generation: as _rename's."""
        if text is None:
            return
        try:
            self.store.set_system_prompt(conv_id, text, generation)
        except KeyError:
            await self.chat.deleted_elsewhere()
            return
        self.notify("system prompt saved" if text else "system prompt cleared")

    @store_failures_noticed
    def action_delete_chat(self) -> None:
        conv = self._conversation("")
        if conv is None or self.chat.refuse_delete():  # before asking: it would be refused after the answer
            return

        async def done(yes: bool | None) -> None:
            if yes:
                await self.chat.delete_chat()

        self.push_screen(Confirm(f"Delete “{conv.title}”?"), done)

    @store_failures_noticed
    def action_export_chat(self) -> Path | None:
        conv = self._conversation("no conversation to export")
        if conv is None:
            return None
        folder = self.export_dir or _documents_dir()
        slug = re.sub(r"[^\w-]+", "-", conv.title).strip("-")[:40] or "chat"
        path = folder / f"moechat-{conv.id}-{slug}.md"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            text = export_markdown(self.store, conv.id)
            write_whole(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))  # a full disk keeps the last export
        except KeyError:  # deleted in another window a moment ago
            self.call_later(self.chat.deleted_elsewhere)
            return None
        except OSError as err:
            self.notify(f"could not write {path}: {err.strerror}", severity="error")
            return None
        self.notify(f"exported to {path}")
        return path

    def _copy(self, code: bool) -> None:
        view = self.chat.target_message()
        if view is None:
            self.notify("no reply to copy yet", severity="warning")
        else:
            view.action_copy_code() if code else view.action_copy()

    def action_copy_reply(self) -> None:
        self._copy(code=False)

    def action_copy_code(self) -> None:
        self._copy(code=True)

    def action_toggle_sidebar(self) -> None:
        self.chat.toggle_sidebar()

    def action_toggle_experts(self) -> None:
        self.chat.toggle_side_panel()

    def action_help_quit(self) -> None:
        """Ctrl+C (outside the input): stops a reply being written, as in a terminal; else says how to quit."""
        if self.chat.reply is not None:
            self.chat.stop()
            return
        keys = [key for key, active in self.active_bindings.items() if active.binding.action in ("quit", "app.quit")]
        self.notify(f"Press {keys[0] if keys else 'ctrl+q'} to quit the app", title="Do you want to quit?")

    def action_help(self) -> None:
        """The app's keys; on a screen with help of its own (the settings), that."""
        if not isinstance(self.screen, HelpScreen):
            own = getattr(self.screen, "help_markdown", None)
            self.push_screen(HelpScreen(own() if own else None))

    def apply_look(self, settings: Settings) -> str | None:
        """Theme and keys from the settings; a notice when some of them cannot be used."""
        keymap, notice = checked_keymap(settings.keys)
        self.set_keymap(keymap)
        theme = textual_theme(settings.theme)
        self.theme = theme if theme in self.available_themes else DARK_LIGHT_THEMES[0]
        return notice

    def action_toggle_theme(self) -> None:
        self.theme = DARK_LIGHT_THEMES[1] if self.theme == DARK_LIGHT_THEMES[0] else DARK_LIGHT_THEMES[0]
        if not kept_aside_on_save(self.settings_file):  # never rewrite a file the user has to fix (a typo'd key is kept)
            theme = "light" if self.theme == DARK_LIGHT_THEMES[1] else "dark"
            try:
                save_settings({"theme": theme}, self.settings_file)  # the file's other keys stay as they are now
                self.settings = replace(self.settings, theme=theme)  # what the engine runs with: a reload reads the rest
            except OSError as err:
                self.notify(f"theme not remembered: {err}", severity="warning")

    def start_engine(self) -> None:
        self.bridge_started = True
        self._say_engine_notice()
        self.bridge.start()

    def action_reload(self) -> None:
        if self.chat.reply is not None:
            self.bridge.stop()
        self.chat.show_loading(0.0, "reloading")
        self._say_engine_notice()
        self.bridge.reload()

    def _say_engine_notice(self) -> None:
        """What the command line changes about the engine the settings name (a --model over their backend)."""
        notice = self.engine_notice() if self.engine_notice is not None else None
        if notice:
            self.notify(notice, severity="warning", timeout=10)

    def action_settings(self) -> None:
        from .screens.settings import SettingsScreen

        def done(result) -> None:  # SettingsResult(settings, needs_reload) or None (cancelled)
            if result is None:
                return
            before, self.settings, self.settings_notice = self.settings, result.settings, None
            self.sampling = sampling_from(result.settings, self.sampling, before)  # a flag typed stays till its field changes
            if result.settings.thinking != before.thinking:  # --thinking too
                self.thinking = result.settings.thinking
            notice = self.apply_look(result.settings)
            if notice:
                self.notify(notice, severity="warning")
            if result.notice:
                self.notify(result.notice, severity="warning", timeout=10)
            if result.needs_reload and self.bridge_started:  # as the screen's button says: "Save and reload model"
                self.notify("settings saved; reloading the model")
                self.action_reload()
            else:
                self.notify("settings saved and applied")

        self.push_screen(SettingsScreen(self.settings, self.settings_notice, self.settings_file, self.flags), done)

    def action_setup(self) -> None:
        from .screens.wizard import WizardScreen

        def done(model_dir: str | None) -> None:
            """The wizard saved the model and budgets to the settings file (or was left): load what they say."""
            if model_dir is None and not self.settings_file.exists():
                self._skip_setup()
            self.settings, self.settings_notice = load_settings(self.settings_file)
            if self.bridge_started:
                self.action_reload()  # the model was unloaded for the wizard's measurements
            else:
                self.start_engine()

        freed = self.bridge.unload() if self.bridge_started else None
        self.push_screen(WizardScreen(path=self.settings_file, memory_freed=freed), done)

    def _skip_setup(self) -> None:
        """The first start's wizard left: an empty settings file (the defaults, the demo), so that the next start does not
        open it again (it did at every start until it was finished); said where it is."""
        try:
            save_settings({}, self.settings_file)
        except OSError as err:
            self.notify(f"setup skipped, but cannot write the settings ({err}): the wizard opens at the next start",
                        severity="warning", timeout=10)
            return
        self.notify("setup skipped: the setup wizard is in the command palette (Ctrl+P), and `moechat --setup` opens it",
                    timeout=10)


def sampling_from(settings: Settings, base=None, before: Settings | None = None):
    """The chat's SamplingParams: the settings' temperature, top-p and max new tokens over `base`; given the settings
    `before` a save, only those the save changed."""
    from ...engine import SamplingParams

    base = base or SamplingParams()
    changed = [n for n in SETTINGS_SAMPLING if before is None or getattr(before, n) != getattr(settings, n)]
    return replace(base, **{n: getattr(settings, n) for n in changed})


def _documents_dir() -> Path:
    from platformdirs import user_documents_dir

    path = Path(user_documents_dir())
    return path if path.is_dir() else Path.cwd()


# What Textual's driver writes as it gives the terminal back (linux_driver.py: stop_application_mode), written before the
# line of a bus error that ends the process under the app (the shell restores the terminal's modes, not these): mouse and
# focus reports, bracketed paste and in-band resize off, Kitty's keyboard protocol popped, the main screen, the cursor
TERMINAL_RESET = "\x1b[?1000l\x1b[?1003l\x1b[?1015l\x1b[?1006l\x1b[?2004l\x1b[?2048l\x1b[<u\x1b[?1049l\x1b[?25h\x1b[?1004l"


def run_tui(args) -> int:
    """`moechat` on a terminal: the TUI with the command line's engine and sampling options."""
    import copy

    from ..engine_config import engine_config
    from ..flags import sampling_params
    from ..remote import backend_overridden, remote_config

    base = copy.copy(args)
    first_run = args.setup or (not settings_path().exists() and args.model is None and not args.backend)
    # Sampling: a flag typed, else the settings' (the settings screen edits them); the command line's seed, top-k, stops.
    # The settings (or --backend) may name a remote backend; read again at every reload, as the engine's options are.
    def config():
        return remote_config(base) or engine_config(copy.copy(base))

    try:
        app, moved = MoechatApp(config, first_run=first_run), None
    except DamagedFile as err:  # junk or damaged: the dialog offers to move it aside (Quit: the line, as before)
        moved = moved_aside(err)
        app = MoechatApp(config, first_run=first_run)
    app.store_notice = moved
    app.engine_notice = lambda: backend_overridden(base)
    app.flags = winning_flags(args)
    app.sampling = sampling_params(args, app.settings)
    app.thinking = args.thinking or app.settings.thinking
    native.report_bus_errors(before=TERMINAL_RESET)  # a model file truncated under the app: the terminal back, then the line
    try:
        app.run()
    finally:
        native.report_bus_errors(before="")
    for why, text in app.unsaved_replies:  # replies the database would not take: here they are, not lost
        print(f"moechat: {why}; the text follows", file=sys.stderr)
        print(text)
    code = app.return_code or 0  # 1 after an exception Textual showed
    if app.bridge.still_running:  # quit while a model loads: ending the interpreter under a thread inside PyTorch's ops
        sys.stdout.flush()  # aborts it ("terminate called without an active exception"); chats and settings are on disk
        sys.stderr.flush()
        os._exit(code)
    return code
