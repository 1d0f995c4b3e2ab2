"""User settings: `settings.toml` in moechat's config directory (platformdirs).

A broken file never stops moechat: it runs on defaults, says so in one line, and leaves the file as
it is for the user to fix. Only keys this version knows are read. Every engine value set here wins
over the machine's calibration profile (`moechat calibrate`); unset ones come from the profile.
`save_settings` rewrites only the keys that changed, so the user's comments and unknown keys stay.

`Settings(**{name: value})` is the one validator: the settings screen checks each field by building
Settings with that field alone, and shows the one-line ValueError under it.
"""
from __future__ import annotations

import os
import tempfile
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI
    import tomli as tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

THEMES = ("dark", "light")  # besides Textual's built-in theme names
# Fields the running engine cannot take without loading the model again; the rest apply live.
RELOAD_FIELDS = frozenset({"model", "draft", "draft_len", "policy", "expert_cache_ratio", "utility_bound", "forgetting",
                           "vram_budget_gib", "ram_budget_gib", "context_len"})


def settings_path() -> Path:
    from platformdirs import user_config_dir

    return Path(user_config_dir("moechat")) / "settings.toml"


def textual_themes() -> tuple[str, ...]:
    from textual.theme import BUILTIN_THEMES  # only when a theme name is not dark/light: keeps start-up light

    return tuple(BUILTIN_THEMES)


@dataclass
class Settings:
    model: str | None = None  # checkpoint directory or a pulled OWNER/NAME; None: the embedded demo
    draft: str | None = None  # none | self | DIR; None: the demo's own draft for the demo, else none
    # None: the calibration profile's value, else the engine's default
    draft_len: int | None = None  # γ
    policy: str | None = None
    expert_cache_ratio: float | None = None
    utility_bound: int | None = None  # K
    forgetting: float | None = None  # λ
    # Memory budgets in GiB the wizard and calibration plan for; None: what the probe finds free
    vram_budget_gib: float | None = None
    ram_budget_gib: float | None = None
    context_len: int | None = None  # None: the model's
    # Sampling of chat replies (applied live)
    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 512
    theme: str = "dark"  # dark | light | a Textual theme name
    keys: dict[str, str] = field(default_factory=dict)  # action id -> key, e.g. {"stop": "escape"}

    def __post_init__(self) -> None:
        for name in ("model", "draft", "policy", "theme"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"`{name}` must be a non-empty string, got {value!r}")
        _whole(self, "draft_len", 1, 32, "γ")
        _whole(self, "utility_bound", 1, 16, "K")
        _whole(self, "max_new_tokens", 1, None)
        _whole(self, "context_len", 1, None)
        _number(self, "expert_cache_ratio", "in [0, 1]", lambda v: 0 <= v <= 1)
        _number(self, "forgetting", "in [0, 1] (λ)", lambda v: 0 <= v <= 1)
        _number(self, "vram_budget_gib", "> 0 GiB", lambda v: v > 0)
        _number(self, "ram_budget_gib", "> 0 GiB", lambda v: v > 0)
        _number(self, "temperature", ">= 0 (0 is greedy)", lambda v: v >= 0)
        _number(self, "top_p", "in (0, 1]", lambda v: 0 < v <= 1)
        if self.policy is not None:
            from ..engine.config import POLICIES

            if self.policy not in POLICIES:
                raise ValueError(f"`policy` must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.theme not in THEMES and self.theme not in textual_themes():
            raise ValueError(f"`theme` must be dark, light or a Textual theme name (e.g. nord, dracula), got {self.theme!r}")
        if not isinstance(self.keys, dict) or not all(isinstance(k, str) and isinstance(v, str) and v.strip()
                                                      for k, v in self.keys.items()):
            raise ValueError(f"`keys` must be a table of action = \"key\" strings, got {self.keys!r}")


def _whole(s: Settings, name: str, lo: int, hi: int | None, symbol: str = "") -> None:
    value = getattr(s, name)
    if value is None and s.__dataclass_fields__[name].default is None:
        return
    what = f"a whole number in {lo}..{hi}" if hi is not None else f"a whole number >= {lo}"
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        raise ValueError(f"`{name}`{f' ({symbol})' if symbol else ''} must be {what}, got {value!r}")


def _number(s: Settings, name: str, rule: str, ok) -> None:
    value = getattr(s, name)
    if value is None and s.__dataclass_fields__[name].default is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value or not ok(value):
        raise ValueError(f"`{name}` must be a number {rule}, got {value!r}")


def load_settings(path: Path | None = None) -> tuple[Settings, str | None]:
    """The saved settings and, when the file could not be used, a one-line notice (defaults then apply)."""
    path = path or settings_path()
    if not path.exists():
        return Settings(), None
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
        return Settings(**{f.name: raw[f.name] for f in fields(Settings) if f.name in raw}), None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, ValueError) as err:
        return Settings(), f"settings file {path} is not usable ({err}): using defaults; fix or delete the file"


def save_settings(settings: Settings, path: Path | None = None) -> Path:
    """Write `settings`, changing only what differs from the file: comments and unknown keys stay.

    A value back to None removes its key; a default value is not added to a file that lacks it.
    An unreadable file is kept as `settings.toml.broken` before a fresh one is written. Atomic:
    a temporary file in the same directory replaces the old one.
    """
    import tomlkit
    from tomlkit.exceptions import TOMLKitError

    path = path or settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = tomlkit.document()
    if path.exists():
        try:
            doc = tomlkit.parse(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, TOMLKitError):
            os.replace(path, path.with_name(path.name + ".broken"))
    for f in fields(Settings):
        value, default = getattr(settings, f.name), f.default
        if f.name == "keys":
            _update_keys(doc, value)
        elif value is None:
            doc.pop(f.name, None)
        elif f.name in doc:
            if doc[f.name].unwrap() != value or type(doc[f.name].unwrap()) is not type(value):
                doc[f.name] = value
        elif value != default:
            doc[f.name] = value
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(tomlkit.dumps(doc))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _update_keys(doc, keys: dict[str, str]) -> None:
    import tomlkit

    if "keys" not in doc:
        if keys:
            doc["keys"] = tomlkit.table()
        else:
            return
    table = doc["keys"]
    for name in [k for k in table if k not in keys]:
        del table[name]
    for name, key in keys.items():
        if table.get(name) != key:
            table[name] = key
    if not keys and not table.trivia.comment and not list(table.value.body):
        del doc["keys"]
