"""What another tool's habits mean here: ollama's commands (`run`, `list`, `rm`) and llama.cpp's flags (`-m`, `-p`, `-n`,
`-c`, `-ngl`), typed as those tools take them, answered with what to type instead (one line, through the parser's error)."""
from __future__ import annotations

import argparse
import difflib
import itertools
import os
import shlex

# What llama.cpp's flags are here; its layers on the GPU have none: moechat places the experts itself.
THEIR_FLAGS = {"-m": "--model", "-p": "--prompt", "-n": "--max-new-tokens", "-c": "--context-len"}
ON_THE_GPU = ("-ngl", "--n-gpu-layers")
GPU_LAYERS = "moechat puts on the GPU what fits there by itself (--vram-budget-gib caps it)"


def _looks_like_a_model(word: str) -> bool:
    return "/" in word or os.sep in word or os.path.isdir(word)


def their_command(argv: list[str], commands) -> str | None:
    """What to type instead of ollama's commands (`ollama run MODEL [PROMPT]`, list, rm), else None."""
    word, rest = argv[0], [shlex.quote(a) for a in argv[1:]]
    model = rest[0] if rest else "NAME"
    if word == "run":
        if len(rest) > 1:
            return f"'run' is not a command; to ask {model} once: moechat generate --model {model} {' '.join(rest[1:])}"
        return f"'run' is not a command; to chat with a model: moechat chat --model {model}"
    if word in ("list", "ls"):
        return f"{word!r} is not a command; moechat models lists the downloaded models"
    if word == "rm":
        return "'rm' is not a command; delete the model's folder (moechat models lists their paths)"
    return None


def not_a_command(argv: list[str], commands) -> str:
    """A word where a command goes: the command it is a typo of (`chta`), else how to use it as a model or a message."""
    word, words = argv[0], list(itertools.takewhile(lambda a: not a.startswith("-"), argv))
    close = difflib.get_close_matches(word.lower(), commands, n=1, cutoff=0.7) if len(word.split()) == 1 else []
    # a typo stays an error (`moechat chta` never sends "chta" to a model); words after it a command without
    # positionals cannot take are a message (`moechat what is MoE`)
    if close and (len(words) == 1 or commands[close[0]]._get_positional_actions()):
        return f"{word!r} is not a command; did you mean: moechat {' '.join([close[0], *map(shlex.quote, argv[1:])])}"
    if _looks_like_a_model(word):
        return f"{word!r} is not a command; to chat with a model: moechat chat --model {shlex.quote(word)}"
    return (f"{word!r} is not a command; to send it as a message: moechat generate {shlex.quote(' '.join(words))}, "
            "or moechat chat for a conversation")


def ours(command: argparse.ArgumentParser, unknown: list[str]) -> dict[str, str]:
    """llama.cpp's flags among `unknown` that `command` takes under moechat's name: {theirs: ours}."""
    return {w: THEIR_FLAGS[w] for w in unknown if THEIR_FLAGS.get(w) in command._option_string_actions}


def instead(command: argparse.ArgumentParser, args, unknown: list[str]) -> str:
    """What to type for arguments another tool taught (llama.cpp's -ngl, a model without --model, a message unquoted), or ''."""
    flags = command._option_string_actions  # a word after an unknown flag is its value (`serve --prot 8080`), not a model
    words = [w for i, w in enumerate(unknown) if not w.startswith("-") and not (i and unknown[i - 1].startswith("-"))]
    if any(w in ON_THE_GPU for w in unknown) and "--vram-budget-gib" in flags:
        return f"; {GPU_LAYERS}"
    if not words or "--model" not in flags:
        return ""
    text = getattr(args, "text", None)  # generate's message: the unknown words followed it
    if text is not None and _looks_like_a_model(text):
        return f"; name the model with --model: {command.prog} --model {shlex.quote(text)} {shlex.quote(' '.join(words))}"
    if text is not None:
        return f"; quote the message: {command.prog} {shlex.quote(' '.join([text, *words]))}"
    if len(words) > 1 and command.prog == "moechat chat":
        return f"; type the message once the chat opens, or send it alone: moechat generate {shlex.quote(' '.join(words))}"
    return f"; name the model with --model: {command.prog} --model {shlex.quote(words[0])}"
