"""What another tool's habits mean here: ollama's commands (`run`, `list`, `rm`) and llama.cpp's flags (`-m`, `-p`, `-n`,
`-c`, `-ngl`), typed as those tools take them, answered with what to type instead (one line, through the parser's error)."""
from __future__ import annotations

import argparse
import os
import shlex

# What llama.cpp's flags are here; its layers on the GPU have none: moechat places the experts itself.
THEIR_FLAGS = {"-m": "--model", "-p": "--prompt", "-n": "--max-new-tokens", "-c": "--context-len"}
ON_THE_GPU = ("-ngl", "--n-gpu-layers")
GPU_LAYERS = "moechat puts on the GPU what fits there by itself (--vram-budget-gib caps it)"


def _looks_like_a_model(word: str) -> bool:
    return "/" in word or os.sep in word or os.path.isdir(word)


def their_command(argv: list[str], commands) -> str | None:
    """What to type instead of ollama's commands (`ollama run MODEL [PROMPT]`, list, rm) and `help`, else None."""
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
    if word == "help":
        return f"'help' is not a command: moechat {argv[1] + ' ' if argv[1:2] and argv[1] in commands else ''}--help"
    return None


def instead(command: argparse.ArgumentParser, args, unknown: list[str]) -> str:
    """What to type for arguments another tool taught (llama.cpp's -m, a model without --model, a message unquoted), or ''."""
    flags, words = command._option_string_actions, [w for w in unknown if not w.startswith("-")]
    flag = next((w for w in unknown if w in THEIR_FLAGS or w in ON_THE_GPU), None)
    if flag in ON_THE_GPU and "--vram-budget-gib" in flags:
        return f"; {GPU_LAYERS}"
    if THEIR_FLAGS.get(flag) in flags:
        return f"; {flag} is llama.cpp's, moechat's is {THEIR_FLAGS[flag]}"
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
