"""User settings: `settings.toml` in moechat's config directory (platformdirs).

A broken file never stops moechat: a file it cannot parse runs on defaults, a key with a bad value on
that key's default; either says so in one line and leaves the file as it is for the user to fix (a save
first keeps a copy as `settings.toml.broken`, then `.broken.1`, ...). Only keys this version knows are read. Every
engine value set here wins over the machine's calibration profile (`moechat calibrate`); unset ones come from the profile.
`save_settings` writes only the keys it is given into the file as it is at that moment, so the user's comments, unknown
keys and edits made while the app ran stay; a symlinked file is written through, with its permissions.

`Settings` is built from the settings options of OPTIONS (app/options.py): one field each, with its
default and check. `Settings(**{name: value})` is the one validator: the settings screen checks each
field by building Settings with that field alone, and shows the one-line ValueError under it.
"""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI
    import tomli as tomllib
from dataclasses import field, fields, make_dataclass
from pathlib import Path

from .options import OPTION, OPTIONS

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
        raw = _read(path)
    except UNREADABLE as err:
        return Settings(), f"settings file {path} is not usable ({_short(err)}): using defaults; fix or delete the file"
    good, problems = _checked(raw)
    problems += _misspelt(raw)
    if not problems:
        return Settings(**good), None
    return Settings(**good), (f"settings file {path}: {'; '.join(problems)}: using the default for "
                              f"{'it' if len(problems) == 1 else 'them'}; fix the file or set it in the settings screen")


# What reading a file can raise: OSError, ValueError (TOMLDecodeError, UnicodeDecodeError, an integer of more
# than 4300 digits), RecursionError (thousands of nested arrays)
UNREADABLE = (OSError, ValueError, RecursionError)


def _read(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def _short(err: BaseException, limit: int = 200) -> str:
    text = str(err)
    return text if len(text) <= limit else text[:limit] + "…"


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
        return path.exists() and bool(_checked(_read(path))[1])
    except UNREADABLE:
        return True


def _misspelt(raw: dict) -> list[str]:
    """Unknown keys that look like a known one (`modle`): said, since the setting meant does not apply. Other unknown
    keys pass in silence (a newer moechat's, kept by save_settings)."""
    import difflib

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


def save_settings(updates: dict, path: Path | None = None) -> tuple[Settings, str | None]:
    """Write the settings in `updates` into the file as it is now -> (the settings the file then holds, a notice).

    Only those keys change: comments, unknown keys and anything edited since the app started stay. None removes a
    key; a default value is not added to a file that lacks it. A file that cannot be read is kept as
    `settings.toml.broken` (never over an earlier copy) and replaced; a bad value is copied there the same way and
    dropped (its default). The notice says so. Atomic: a temporary file beside the real one (a symlink's target)
    replaces it, with its permissions; a read-only file is refused with OSError. Two processes saving at once take turns.
    """
    Settings(**updates)  # every value checked before anything is written
    path = path or settings_path()
    target = _link_target(path) if path.is_symlink() else path  # dotfiles: the link stays, its file changes
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent):  # another process saving at once (a second window): it reads what this one writes
        notice = _rewrite(target, updates)
    return load_settings(path)[0], notice


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on the settings' folder while a save reads, changes and replaces the file: of two processes
    saving at once, the last to write dropped the other's key. Where the folder cannot be locked (Windows has no fcntl, a
    file system may refuse) saves run unlocked, as before."""
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        fd = None
    try:
        if fd is not None:
            with suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # the lock goes with it


def _rewrite(target: Path, updates: dict) -> str | None:
    """save_settings' read, change and atomic write of `target` -> its notice."""
    import tomlkit
    from tomlkit.exceptions import TOMLKitError

    doc, notice, mode = tomlkit.document(), None, 0o600
    if target.exists() and not target.is_dir():
        mode = stat.S_IMODE(target.stat().st_mode)
        if not mode & 0o222:
            raise OSError(f"{target} is read-only: make it writable (chmod u+w) to save settings")
    try:
        text = target.read_text(encoding="utf-8")
        tomllib.loads(text)  # readable as load_settings reads it (tomlkit takes some files tomllib refuses)
        doc = tomlkit.parse(text)
    except FileNotFoundError:
        pass
    except (*UNREADABLE, TOMLKitError) as err:  # moechat could not read it: set aside, start anew
        kept = _keep_copy(target, move=True)
        notice = f"the settings file could not be read ({_short(err, 80)}): kept as {kept.name}, a new one written"
    else:
        raw = doc.unwrap()
        bad = sorted(set(raw) & {f.name for f in fields(Settings)} - _checked(raw)[0].keys())
        if bad:  # the user's bad values are about to go: keep what they wrote
            kept = _keep_copy(target, move=False)
            notice = f"the bad value of {', '.join(bad)} replaced; the file as it was is kept as {kept.name}"
            for name in bad:
                doc.pop(name)  # its default, unless `updates` sets it
    _apply(doc, updates)
    _write_atomic(target, tomlkit.dumps(doc), mode)
    return notice


def _link_target(path: Path) -> Path:
    """The file a symlink names; a loop raises OSError on every Python (Path.resolve raised RuntimeError on 3.11 and
    returned the link itself from 3.13, whose save then replaced the link)."""
    try:
        return Path(os.path.realpath(path, strict=True))
    except FileNotFoundError:  # a link to a file not made yet (a fresh dotfiles checkout): it is made there
        return Path(os.path.realpath(path))


def _apply(doc, updates: dict) -> None:
    for name, value in updates.items():
        default = OPTION[name].default
        if name == "keys":
            _update_keys(doc, value)
        elif value is None:
            doc.pop(name, None)
        elif name in doc:
            if doc[name].unwrap() != value or type(doc[name].unwrap()) is not type(value):
                doc[name] = value
        elif value != default:
            doc[name] = value


def _keep_copy(path: Path, move: bool) -> Path:
    """`path` kept as the first free `settings.toml.broken`, `.broken.1`, ...: an earlier copy may be the only full one."""
    kept = path.with_name(path.name + ".broken")
    n = 0
    while kept.exists():
        n += 1
        kept = path.with_name(f"{path.name}.broken.{n}")
    if move:
        os.replace(path, kept)
    else:
        shutil.copyfile(path, kept)
    return kept


def _write_atomic(path: Path, text: str, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            if hasattr(os, "fchmod"):  # not on Windows before Python 3.13 (its files have no such modes)
                os.fchmod(out.fileno(), mode)
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
