"""User settings: `settings.toml` in moechat's config directory (platformdirs).

A broken file never stops moechat: a file it cannot parse runs on defaults, a key with a bad value on
that key's default; either says so in one line and leaves the file as it is for the user to fix (a save
first keeps a copy as `settings.toml.broken`). Only keys this version knows are read. Every engine value set here wins
over the machine's calibration profile (`moechat calibrate`); unset ones come from the profile.
`save_settings` rewrites only the keys that changed, so the user's comments and unknown keys stay.

`Settings` is built from the settings options of OPTIONS (app/options.py): one field each, with its
default and check. `Settings(**{name: value})` is the one validator: the settings screen checks each
field by building Settings with that field alone, and shows the one-line ValueError under it.
"""
from __future__ import annotations

import os
import shutil
import tempfile

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI
    import tomli as tomllib
from dataclasses import field, fields, make_dataclass
from pathlib import Path

from .options import OPTIONS

SETTINGS_OPTIONS = tuple(o for o in OPTIONS if o.setting)
# Fields the running engine cannot take without loading the model again; the rest apply live.
RELOAD_FIELDS = frozenset(o.name for o in SETTINGS_OPTIONS if not o.live)


def settings_path() -> Path:
    from platformdirs import user_config_dir

    return Path(user_config_dir("moechat")) / "settings.toml"


def _check_all(self) -> None:
    for o in SETTINGS_OPTIONS:
        o.check(getattr(self, o.name))


def _field(o):
    return field(default_factory=type(o.default)) if isinstance(o.default, (dict, list)) else field(default=o.default)


# One field per settings option of OPTIONS, its default and check from there; None: unset (the
# calibration profile's value, else the engine's default).
Settings = make_dataclass("Settings", [(o.name, f"{o.kind.__name__} | None", _field(o)) for o in SETTINGS_OPTIONS],
                          namespace={"__post_init__": _check_all, "__module__": __name__,
                                     "__doc__": "The user's settings; `Settings(**{key: value})` checks each value."})


def load_settings(path: Path | None = None) -> tuple[Settings, str | None]:
    """The saved settings and, when the file could not be used whole, a one-line notice: an unreadable file
    gives the defaults, a bad value its key's default while every other key keeps the file's value."""
    path = path or settings_path()
    if not path.exists():
        return Settings(), None
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        return Settings(), f"settings file {path} is not usable ({err}): using defaults; fix or delete the file"
    good, problems = _checked(raw)
    problems += _misspelt(raw)
    if not problems:
        return Settings(**good), None
    return Settings(**good), (f"settings file {path}: {'; '.join(problems)}: using the default for "
                              f"{'it' if len(problems) == 1 else 'them'}; fix the file or set it in the settings screen")


def _checked(raw: dict) -> tuple[dict, list[str]]:
    """The file's known keys -> (those whose values pass their check, one problem per key that does not)."""
    good, problems = {}, []
    for f in fields(Settings):
        if f.name in raw:
            try:
                Settings(**{f.name: raw[f.name]})
                good[f.name] = raw[f.name]
            except ValueError as err:
                problems.append(str(err))
    return good, problems


def kept_aside_on_save(path: Path | None = None) -> bool:
    """Whether save_settings keeps the file as `.broken` first: it cannot be read, or a value of it is bad."""
    path = path or settings_path()
    try:
        return path.exists() and bool(_checked(tomllib.loads(path.read_text(encoding="utf-8")))[1])
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return True


def _misspelt(raw: dict) -> list[str]:
    """Unknown keys that look like a known one (`modle`): said, since the setting meant does not apply. Other unknown
    keys pass in silence (a newer moechat's, kept by save_settings)."""
    import difflib

    from .options import OPTIONS

    names = [f.name for f in fields(Settings)]
    flags_only = {o.name: o.flag for o in OPTIONS if o.name not in names and o.flag}  # --top-k, --expert-cache-gib
    problems = []
    for key in (k for k in raw if k not in names):
        near = difflib.get_close_matches(key, names, n=1, cutoff=0.8)
        if key in flags_only:
            problems.append(f"{key!r} is a command-line option only ({flags_only[key]}): ignored in the file")
        elif near:
            problems.append(f"unknown key {key!r} ignored (did you mean {near[0]!r}?)")
    return problems


def save_settings(settings: Settings, path: Path | None = None) -> Path:
    """Write `settings`, changing only what differs from the file: comments and unknown keys stay.

    A value back to None removes its key; a default value is not added to a file that lacks it.
    An unreadable file, or one with a bad value (which `settings` replaces), is kept as `settings.toml.broken`
    first. Atomic: a temporary file in the same directory replaces the old one.
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
        else:
            if _checked(doc.unwrap())[1]:  # the user's bad value is about to be replaced: keep what they wrote
                shutil.copyfile(path, path.with_name(path.name + ".broken"))
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
