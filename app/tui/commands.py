"""The app's actions: key bindings (with ids, remappable from the settings' `[keys]` table) and the
command palette's entries (Ctrl+P). The ids are the action names."""
from __future__ import annotations

from functools import cache, partial

from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider

BINDINGS = [
    Binding("f1", "help", "Help", id="help"),  # first: below 100 columns the footer cuts its last keys, and this one lists them
    # priority: run as the app reads them, not once passed up from the input, after the Enter typed behind them (refused
    # there as sent into the reply being written): the message goes where these keys took the chat
    Binding("escape", "stop", "Stop", id="stop", priority=True),
    Binding("ctrl+n", "new_chat", "New chat", id="new_chat", priority=True),
    Binding("f2", "rename_chat", "Rename", id="rename_chat"),
    Binding("f8", "delete_chat", "Delete chat", show=False, id="delete_chat"),
    Binding("ctrl+r", "regenerate", "Regenerate", id="regenerate"),
    Binding("ctrl+o", "export_chat", "Export", show=False, id="export_chat"),
    Binding("ctrl+s", "system_prompt", "System prompt", show=False, id="system_prompt"),
    Binding("f5", "copy_reply", "Copy reply", show=False, id="copy_reply"),
    Binding("f9", "copy_code", "Copy code", show=False, id="copy_code"),
    Binding("f4", "toggle_sidebar", "Chats", id="toggle_sidebar"),
    Binding("f3", "toggle_experts", "Experts", id="toggle_experts"),
    Binding("f12", "settings", "Settings", show=False, id="settings"),
    Binding("ctrl+t", "toggle_theme", "Theme", show=False, id="toggle_theme"),
]

# (action, palette name, help) for the command palette; the action names are the bindings' ids too.
COMMANDS = [
    ("new_chat", "New chat", "start a new conversation"),
    ("rename_chat", "Rename chat", "rename this conversation"),
    ("delete_chat", "Delete chat", "delete this conversation"),
    ("export_chat", "Export chat", "write this conversation to a Markdown file"),
    ("system_prompt", "System prompt", "set this conversation's system prompt"),
    ("regenerate", "Regenerate", "write the last reply again"),
    ("stop", "Stop", "stop the reply being written"),
    ("copy_reply", "Copy reply", "copy the focused message, else the last reply"),
    ("copy_code", "Copy code block", "copy the last code block of the focused message, else of the last reply"),
    ("toggle_sidebar", "Toggle chat list", "show or hide the conversations"),
    ("toggle_experts", "Toggle expert view", "show or hide the expert heatmap and stats"),
    ("settings", "Settings", "memory budgets, policy, sampling, theme"),
    ("setup", "Setup wizard", "choose the model and calibrate"),
    ("reload", "Reload model", "load the model again with the saved settings"),
    ("help", "Help", "keys and where things live"),
    ("toggle_theme", "Toggle theme", "switch between light and dark"),
]


CHAT_ACTIONS = {action for action, _, _ in COMMANDS} - {"settings", "setup", "help", "toggle_theme"}


class MoechatCommands(Provider):
    """The palette's moechat actions (Ctrl+P), found by fuzzy name: those that run on the screen it opened over (the chat's
    did nothing over the settings or the wizard)."""

    def _commands(self) -> list[tuple[str, str, str]]:
        return [command for command in COMMANDS if self.app.runs_on(command[0], self.screen)]

    async def discover(self) -> Hits:
        for action, name, help_text in self._commands():
            yield DiscoveryHit(name, partial(self.app.run_action, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for action, name, help_text in self._commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), partial(self.app.run_action, action), help=help_text)


MODIFIERS = {"ctrl", "shift", "alt", "meta", "super", "hyper"}


@cache
def _key_names() -> frozenset[str]:
    """Textual's names of keys: its Keys ("escape", "f5", "pageup") and printable ASCII ("space", "minus", "slash")."""
    from textual.keys import Keys

    return frozenset({k.value.split("+")[-1] for k in Keys} | _printable_names())


@cache
def _printable_names() -> frozenset[str]:
    """Textual's names of the keys that type a character ("a", "space", "question_mark")."""
    from textual.keys import _character_to_key

    return frozenset(_character_to_key(chr(c)) for c in range(32, 127))


def known_key(key: str) -> bool:
    """Whether Textual can report `key` ("ctrl+g", "f5", "escape", "x", "question_mark"): a typo would bind nothing."""
    import unicodedata

    *mods, base = key.strip().lower().split("+")
    if not base or not set(mods) <= MODIFIERS:
        return False
    if len(base) == 1 or base in _key_names():
        return True
    try:
        unicodedata.lookup(base.replace("_", " "))  # Textual names printable keys by their Unicode names
        return True
    except KeyError:
        return False


def normal_key(key: str) -> str:
    """A key as Textual reports it: "Ctrl+G" -> "ctrl+g", "F5" -> "f5", "?" -> "question_mark" (a letter alone keeps its
    case: "G" is shift+g). Textual compares key names as written, so "F5" would never fire."""
    from textual.keys import _character_to_key

    *mods, base = [part.strip() for part in key.strip().split("+")]
    if len(base) == 1:
        base = _character_to_key(base.lower() if mods else base)
    return "+".join([*(m.lower() for m in mods), base if len(base) == 1 else base.lower()])


@cache
def _input_keys() -> dict[str, str]:
    """Keys the message box takes for itself while it has the focus (nearly always): bound there, they never reach the
    app."""
    from textual.widgets import TextArea

    from .widgets.message_view import ChatInput

    taken = {k.strip(): f"the input's {b.action.replace('_', ' ')}" for b in (*TextArea.BINDINGS, *ChatInput.BINDINGS)
             for k in b.key.split(",")}
    moves = {"tab": "moving the focus", "shift+tab": "moving the focus", "enter": "the input's send"}
    return {**taken, **moves, **dict.fromkeys(("ctrl+j", "shift+enter", "alt+enter"), "the input's new line")}


def _taken(defaults_of: set[str]) -> dict[str, str]:
    """key -> what holds it: Textual's own keys, the input's, and the defaults of the bindings `defaults_of`."""
    taken = {"ctrl+q": "quit", "ctrl+c": "stop or copy", "ctrl+p": "the command palette", **_input_keys()}
    for b in BINDINGS:
        if b.id in defaults_of:
            taken.update(dict.fromkeys(b.key.split(","), f"{b.description} ({b.id})"))
    return taken


def _clash(key: str, taken: dict[str, str]) -> str | None:
    if key in taken:
        return f"{key} is already {taken[key]}: pick a free key"
    if "+" not in key and (len(key) == 1 or key in _printable_names()):
        return f"{key} types into the input: add ctrl+ or alt+"
    return None


def checked_keymap(keys: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """The settings' `[keys]` (binding id -> keys) this app can honour, and a notice naming the unknown ids, the names
    that are no key and the keys another action (or the input) already holds: such an entry keeps its default key."""
    ids = {b.id for b in BINDINGS if b.id}
    problems = [f"{', '.join(sorted(set(keys) - ids))} ignored: the ids are {', '.join(sorted(ids))}"] if set(keys) - ids else []
    named = {}
    for name, value in keys.items():
        bad = [k for k in value.split(",") if not known_key(k)]
        if bad:
            problems.append(f"{name} = {value!r} ignored: {', '.join(repr(k.strip()) for k in bad)} is not a key name "
                            "(e.g. ctrl+g, f5, escape)")
        elif name in ids:
            named[name] = [normal_key(k) for k in value.split(",")]
    taken, keymap = _taken(ids - set(named)), {}
    for name, value in named.items():
        clashes = [c for k in value if (c := _clash(k, taken))]
        if clashes:  # Textual would take the key from the other action without a word, or the input would swallow it
            problems.append(f"{name} = {keys[name]!r} ignored: {'; '.join(clashes)}")
            continue
        keymap[name] = ",".join(value)
        taken.update(dict.fromkeys(value, f"{name} in [keys]"))
    for b in BINDINGS:  # refused: the entry's action keeps its default key, unless another entry took that meanwhile
        if b.id in named and b.id not in keymap and any(k in v.split(",") for k in b.key.split(",") for v in keymap.values()):
            problems.append(f"{b.id} has no key now: its default {b.key} went to another action")
    return keymap, "[keys] " + "; ".join(problems) if problems else None
