"""User settings: `settings.toml` in moechat's config directory (platformdirs).

A broken file never stops moechat: it runs on defaults, says so in one line, and leaves the file as
it is for the user to fix. Only keys this version knows are read. Every engine value set here wins
over the machine's calibration profile (`moechat calibrate`); unset ones come from the profile.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path


def settings_path() -> Path:
    from platformdirs import user_config_dir

    return Path(user_config_dir("moechat")) / "settings.toml"


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

    def __post_init__(self) -> None:
        for name in ("model", "draft", "policy"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"`{name}` must be a non-empty string, got {value!r}")
        for name in ("draft_len", "utility_bound"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"`{name}` must be a whole number, got {value!r}")
        for name in ("expert_cache_ratio", "forgetting"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise ValueError(f"`{name}` must be a number, got {value!r}")


def load_settings(path: Path | None = None) -> tuple[Settings, str | None]:
    """The saved settings and, when the file could not be used, a one-line notice (defaults then apply)."""
    path = path or settings_path()
    if not path.exists():
        return Settings(), None
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
        return Settings(**{f.name: raw.get(f.name) for f in fields(Settings)}), None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, ValueError) as err:
        return Settings(), f"settings file {path} is not usable ({err}): using defaults; fix or delete the file"
