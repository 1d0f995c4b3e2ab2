"""The flags several commands share (the engine's, sampling, the chat template's) and the engine's objects the
sampling and thinking flags make: generate, chat, serve and the benchmarks alike."""
from __future__ import annotations

import argparse

from .engine_config import first
from .options import SETTINGS_SAMPLING, add_flags
from .parser import add_renamed
from .terminal_text import as_typed


def int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that loads a model: the engine options of app/options.py."""
    add_flags(p, "engine")
    add_renamed(p, host_ram_mib="--ram-budget-gib (in GiB)", expert_cache_mib="--expert-cache-gib (in GiB)")


def add_sampling_args(p: argparse.ArgumentParser, temperature: float, max_new_tokens: int, top_p: float = 1.0,
                      from_settings: bool = False) -> None:
    """The sampling options of app/options.py, with this command's defaults for the three the settings hold; with
    `from_settings` (the chat) those three default to the settings' values, which the defaults given here are."""
    add_flags(p, "sampling", temperature=temperature, max_new_tokens=max_new_tokens, top_p=top_p)
    if from_settings:
        default_to_settings(p, SETTINGS_SAMPLING)


def default_to_settings(p: argparse.ArgumentParser, names) -> None:
    """These flags unset default to None, so a flag typed is told from one left out and the settings' value applies."""
    for action in p._actions:
        if action.dest in names:
            action.default, action.help = None, action.help.replace("(default: ", "(default: the settings, else ")


def add_template_args(p: argparse.ArgumentParser) -> None:
    """The options of app/options.py that shape a chat prompt (a command sending messages, not token ids)."""
    add_flags(p, "template")


def request_thinking(args) -> bool | None:
    """`--thinking`, else the settings' `thinking`, as the chat template's `enable_thinking` (the app reads its own
    settings, which its screen edits)."""
    from .reasoning import enable_thinking
    from .settings import load_settings

    return enable_thinking(first(args.thinking, load_settings()[0].thinking))


def sampling_params(args, settings=None):
    """The flags' SamplingParams; the chat's (`settings` given): where a flag was left out, the settings' value."""
    from ..engine import SamplingParams

    given = {name: getattr(args, name) for name in SETTINGS_SAMPLING}
    if settings is not None:
        given = {name: getattr(settings, name) if value is None else value for name, value in given.items()}
    return SamplingParams(top_k=args.top_k, seed=args.seed, stop=[as_typed(s) for s in args.stop], **given)
