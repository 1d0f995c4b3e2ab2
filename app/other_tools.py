"""What another tool's habits mean here: ollama's commands (`run`, `list`, `rm`) and llama.cpp's flags (`-m`, `-p`, `-n`,
`-c`, `-ngl`), typed as those tools take them or glued to their value, answered with what to type instead (one line, through
the parser's error)."""
from __future__ import annotations

import argparse
import difflib
import itertools
import os
import re
import shlex

# llama.cpp's flags: moechat's for each (its layers on the GPU have none: moechat places the experts itself) and, glued to
# their value (`-n5`, `-c=4096`, `-m/path`, `-ngl99`; llama.cpp itself takes each as two words), what the value must look
# like (a number, a path), so that another of its short flags (`-np 4`, `-mg 0`, `-ptc 8`) is not read so; a prompt is any
# value but a lowercase word (`-ps`), a space included (`-p"Hello world"`: argparse took that word for the message)
THEIR_FLAGS = {"-m": ("--model", r"=.+|\S*[/\\.~]\S*"), "-p": ("--prompt", r".*[^a-z].*"),
               "-n": ("--max-new-tokens", r"=?-?\d+"), "-c": ("--context-len", r"=?\d+"),
               "-ngl": ("--vram-budget-gib", r"=?\d+"), "--n-gpu-layers": ("--vram-budget-gib", r"=\d+")}
ON_THE_GPU = tuple(flag for flag, (ours, _) in THEIR_FLAGS.items() if ours == "--vram-budget-gib")
GPU_LAYERS = "moechat puts on the GPU what fits there by itself (--vram-budget-gib caps it)"


def before_dashes(argv: list[str]) -> list[str]:
    """The arguments before `--`: those after it are the message's words, never flags to name or rewrite."""
    return argv[:argv.index("--")] if "--" in argv else argv


def unglued(argv: list[str]) -> list[str]:
    """`argv` with their flags glued to a value split in two (`-n5`: `-n 5`), up to `--`."""
    def split(word: str) -> list[str]:
        flag = next((f for f, (_, value) in THEIR_FLAGS.items()
                     if word.startswith(f) and re.fullmatch(value, word[len(f):], re.S)), None)
        return [flag, word[len(flag):].removeprefix("=")] if flag else [word]

    flags = before_dashes(argv)
    return [*(part for word in flags for part in split(word)), *argv[len(flags):]]


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


def ours(command: argparse.ArgumentParser, argv: list[str]) -> dict[str, str]:
    """llama.cpp's flags in `argv` (split from their values by `unglued`) that `command` takes under moechat's name:
    {theirs: ours}; `-ngl` too, where the command takes --vram-budget-gib (its value: GPU_LAYERS)."""
    flags = command._option_string_actions
    return {w: THEIR_FLAGS[w][0] for w in before_dashes(argv) if w in THEIR_FLAGS and THEIR_FLAGS[w][0] in flags}


def instead(command: argparse.ArgumentParser, args, unknown: list[str]) -> str:
    """What to type for arguments another tool taught (a model without --model, a message unquoted), or ''."""
    flags = command._option_string_actions  # a word after an unknown flag is its value (`serve --prot 8080`), not a model
    words = [w for i, w in enumerate(unknown) if not w.startswith("-") and not (i and unknown[i - 1].startswith("-"))]
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
