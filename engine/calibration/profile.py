"""The saved calibration: one TOML file per machine and model, in moechat's config directory.

    <user_config_dir("moechat")>/profiles/<fingerprint>-<model slug>.toml

(the directory of app/settings.py's settings file; moechat has no environment override for it,
tests point XDG_CONFIG_HOME elsewhere). A profile that cannot be used (corrupt, written on another
machine, an older or newer schema, measured for another model at its path) never stops moechat: `load_profile`
renames it to `<name>.bad` (replacing an older `.bad`), says so in one line, and the caller runs on defaults until the next
`moechat calibrate` writes a fresh one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shlex
import types
import typing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..shared_files import write_whole
from .types import Decisions, Hardware, Measurements

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI
    import tomli as tomllib

SCHEMA = 1  # bump whenever a field changes meaning; older files are then recalibrated


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class Profile:
    fingerprint: str  # the machine (probe.fingerprint)
    model: str  # model key: the resolved model directory
    hardware: Hardware
    measurements: Measurements
    decisions: Decisions
    schema: int = SCHEMA
    created: str = field(default_factory=_now)  # UTC, ISO 8601
    config_hash: str = ""  # model_digest of the model measured; "" (profiles written before it): config.json's mtime
    budgets: dict[str, int] | None = None  # vram_budget_bytes, ram_budget_bytes, context_len decided for (unset: absent)


def profiles_dir() -> Path:
    from platformdirs import user_config_dir

    return Path(user_config_dir("moechat")) / "profiles"


def model_key(model_dir: str | os.PathLike) -> str:
    """The key a model's profile is saved under: its resolved directory."""
    return str(Path(model_dir).expanduser().resolve())


def model_digest(model_dir: str | os.PathLike) -> str:
    """A hash of the model's config.json ("" when it cannot be read): another model put at the same path differs."""
    try:
        return hashlib.sha256((Path(model_dir).expanduser() / "config.json").read_bytes()).hexdigest()[:16]
    except OSError:
        return ""


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[-40:] or "x"


def profile_path(fingerprint: str, key: str) -> Path:
    """Readable (the model's last two path parts) and unique (a hash of the whole key)."""
    tail = "-".join(Path(key).parts[-2:])
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    return profiles_dir() / f"{_slug(fingerprint)}-{_slug(tail)}-{digest}.toml"


def _plain(value):
    """asdict output without None (TOML has no null: a missing key reads back as None)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def check_profiles_writable() -> None:
    """MoechatError, before minutes of measuring, where a profile could not be saved (a file where the folder goes, no
    write permission): it failed after them with an internal error."""
    from ..errors import MoechatError

    folder = profiles_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            read_only = bool(getattr(os, "statvfs", None) and os.statvfs(folder).f_flag & os.ST_RDONLY)
            raise PermissionError("on a read-only file system: remount it read-write" if read_only else "not writable by you")
    except OSError as err:
        raise MoechatError(f"calibration profiles cannot be saved in {folder} ({err.strerror or err}): move what is at that "
                           "path aside, or fix its permissions") from None


def save_profile(profile: Profile) -> Path:
    """Write atomically (a half-written file would read as corrupt); returns the path."""
    import tomlkit

    from ..errors import MoechatError

    data = _plain(dataclasses.asdict(profile))
    head = {k: data.pop(k) for k in ("schema", "created", "fingerprint", "model", "config_hash")}
    path = profile_path(profile.fingerprint, profile.model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, lambda tmp: tmp.write_text(tomlkit.dumps({**head, **data}), encoding="utf-8"))
    except OSError as err:
        raise MoechatError(f"cannot save the calibration profile {path} ({err.strerror or err}): free disk space or fix the "
                           "folder's permissions, then calibrate again") from None
    return path


def _value(tp, raw, where: str):
    """raw as type tp, or ValueError naming the key."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # X | None: None never reaches here (missing key)
        return _value(next(a for a in args if a is not type(None)), raw, where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, raw, where)
    if origin is list:
        if not isinstance(raw, list):
            raise ValueError(f"{where} should be a list")
        return [_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(raw)]
    if origin is dict:
        if not isinstance(raw, dict):
            raise ValueError(f"{where} should be a table")
        return {str(k): _value(args[1], v, f"{where}.{k}") for k, v in raw.items()}
    if tp is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    if tp in (int, str, bool) and isinstance(raw, tp) and (tp is bool or not isinstance(raw, bool)):
        return raw
    raise ValueError(f"{where} should be {getattr(tp, '__name__', tp)}, got {type(raw).__name__}")


def _build(cls, raw, where: str):
    if not isinstance(raw, dict):
        raise ValueError(f"{where} should be a table")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in raw:
            kwargs[f.name] = _value(hints[f.name], raw[f.name], f"{where}.{f.name}" if where else f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{where + '.' if where else ''}{f.name} is missing")
    return cls(**kwargs)


def measurements_from(raw: dict) -> Measurements:
    """A profile's [measurements] table as Measurements (ValueError when it does not fit)."""
    return _build(Measurements, raw, "measurements")


def _written_after(model_dir: str, created: str) -> bool:
    """Whether the model's config.json was written after a profile from before `config_hash` (its decisions were for that
    model's sizes): a `git pull` that brought another demo model, a model downloaded again into its folder."""
    try:
        written = (Path(model_dir).expanduser() / "config.json").stat().st_mtime
        return written > datetime.fromisoformat(created).timestamp() + 1  # `created` is cut to the second
    except (OSError, ValueError, TypeError):
        return False


def _set_aside(path: Path, why: str, key: str) -> str:
    bad = path.with_name(path.name + ".bad")
    try:
        path.replace(bad)
        where = f"moved to {bad.name}"
    except OSError as err:
        where = f"left in place ({err.strerror})"
    return (f"calibration profile {path} {why}: {where}; running on defaults, recalibrate with "
            f"`moechat calibrate --model {shlex.quote(key)}`")


def load_profile(fingerprint: str, key: str) -> tuple[Profile | None, str]:
    """This machine's profile for the model, and a one-line notice when a file exists but cannot be
    used (it is then renamed to `<name>.bad`). (None, "") when there is none. Never raises."""
    path = profile_path(fingerprint, key)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, ""
    except (OSError, UnicodeDecodeError) as err:
        return None, _set_aside(path, f"cannot be read ({err})", key)
    try:
        raw = tomllib.loads(text)
        schema = raw.get("schema")
        if schema != SCHEMA:
            return None, _set_aside(path, f"has schema {schema!r}, this moechat writes {SCHEMA}", key)
        profile = _build(Profile, raw, "")
    except Exception as err:  # bad TOML, wrong types, a record refusing its values: never a crash
        return None, _set_aside(path, f"is corrupt ({err})", key)
    if profile.fingerprint != fingerprint:
        return None, _set_aside(path, "was measured on another machine", key)
    if profile.model != key:
        return None, _set_aside(path, f"belongs to another model ({profile.model})", key)
    changed = profile.config_hash != model_digest(key) if profile.config_hash else _written_after(key, profile.created)
    if changed:  # its decisions were for that model's sizes
        return None, _set_aside(path, "was measured for another model at this path (its config.json changed since)", key)
    drafter = profile.decisions.drafter
    if drafter not in ("none", "self") and not Path(drafter).expanduser().is_dir():  # as the engine reads it
        return None, _set_aside(path, f"drafts with {drafter}, which is no longer there", key)
    return profile, ""
