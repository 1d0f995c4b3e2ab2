"""The `moechat` parser's answers to a bad command line and a failed command, each one line `moechat: error: ...`:
argparse's errors said in the command's words (a missing argument with its help, a flag's typo with the command line
with the closest flag, llama.cpp's flags with moechat's: `other_tools.py`), a removed flag with what replaced it."""
from __future__ import annotations

import argparse
import shlex
import sys

from .other_tools import GPU_LAYERS, ON_THE_GPU, THEIR_FLAGS, before_dashes, instead, ours, unglued

MISSING = ("the following arguments are required: ", "one of the arguments ")  # argparse's words for what is missing


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input in one line, never a usage dump."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)  # what error() reads again for flags it does not know
        parsed = super().parse_known_args(args, namespace)
        taken = [w for a in self._actions if not a.option_strings and isinstance(w := getattr(parsed[0], a.dest, None), str)]
        if ours(self, unglued(taken)) and (said := self._translated()):  # a word with a space argparse took for the message:
            self.error(said)  # `-p"Hello world"`, `-m="a b/c"` (after `--` it is the message)
        return parsed

    def error(self, message: str):  # noqa: D401 - argparse API
        if translated := self._translated():
            message = translated
        elif message.startswith(MISSING) and (unknown := self._unknown_beside_missing()):
            args, extras = unknown  # argparse checks what is missing first: `generate --bogus` said "no message to send"
            message = self.unrecognized(args, extras)
        elif message.startswith("one of the arguments PROMPT"):  # `moechat generate` alone, or with its input piped
            message = f'no message to send: {self.prog} "Hello", or {self.prog} - to read it from standard input'
        elif message.startswith(MISSING[0]):
            message = self._needs(message[len(MISSING[0]):]) or message
        elif "invalid choice" in message:
            message = self._not_a_subcommand(message) or message
        self.exit(2, f"moechat: error: {message} (see `{self.prog} --help`)\n")

    def unrecognized(self, args: argparse.Namespace, unknown: list[str]) -> str:
        """What to say of arguments this command does not take: flags typed wrong as the command line with the flags meant
        (argparse's `suggest_on_error` is Python 3.14's, and for choices only), else another tool's habit (`instead`)."""
        typos = self._typos(unknown)
        if typos and getattr(self, "_given", None) is not None:  # the flags alone: a value after one was taken for the
            return f"unknown flag {' '.join(sorted(typos))}; did you mean: {self._line(typos)}"  # prompt, the prompt unknown
        return f"unrecognized arguments: {' '.join(unknown)}{instead(self, args, unknown)}"

    def _typos(self, words: list[str]) -> dict[str, str]:
        """{typed: meant} for the long flags among `words` this parser lacks but has one close to (`--prot`: `--port`)."""
        flags = [f for f, action in self._option_string_actions.items()
                 if f.startswith("--") and not isinstance(action, _Renamed)]  # not a removed flag's old name
        typed = {w.split("=")[0] for w in before_dashes(words) if w.startswith("--")} - set(flags)
        return {w: close[0] for w in typed if (close := closest_flag(w, flags))}

    def _line(self, fixes: dict[str, str], given: list[str] | None = None) -> str:
        """The command line as given to this parser (or `given`), each flag in `fixes` replaced (`--prot=1`: `--port=1`)
        up to `--` (the message after it stays as typed)."""
        def fixed(word: str) -> str:
            flag, eq, value = word.partition("=")
            return fixes.get(flag, flag) + eq + value

        given = self._given if given is None else given
        flags = before_dashes(given)
        return shlex.join([*self.prog.split(), *map(fixed, flags), *given[len(flags):]])

    def _translated(self) -> str | None:
        """llama.cpp's flags in place of moechat's as the line with moechat's, whatever argparse made of them (`generate -n
        5 Hi` said "unrecognized arguments: -n Hi": it took 5 for the message), also glued to their value (`-n5`); None
        without them."""
        given = unglued(getattr(self, "_given", None) or [])
        theirs = ours(self, given)
        if not theirs:
            return None
        flag = next(iter(theirs))
        if flag in ON_THE_GPU:
            return f"{flag} is llama.cpp's; {GPU_LAYERS}"
        return f"{flag} is llama.cpp's; moechat's is {theirs[flag]}: {self._line({**self._typos(given), **theirs}, given)}"

    def _unknown_beside_missing(self) -> tuple[argparse.Namespace, list[str]] | None:
        """(args, the arguments this parser does not know) parsed again with nothing required, else None."""
        if getattr(self, "_given", None) is None:
            return None
        required = [a for a in [*self._actions, *self._mutually_exclusive_groups] if a.required]
        for item in required:
            item.required = False
        try:
            args, extras = super().parse_known_args(self._given)
        finally:
            for item in required:
                item.required = True
        return (args, extras) if extras else None

    def _not_a_subcommand(self, message: str) -> str | None:
        """`moechat bench nothing`: argparse's "argument bench_command: invalid choice" named its own variable; the closest
        command instead, else the ones there are (None: a flag's choice, whose argparse words name the flag)."""
        import difflib
        import re

        found = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        word = re.search(r"invalid choice: '([^']*)'", message)
        if not found or not word or not message.startswith(f"argument {found[0].dest}:"):
            return None
        command, names = self.prog.partition(" ")[2] or self.prog, list(found[0].choices)
        close = difflib.get_close_matches(word[1], names, n=1, cutoff=0.7)
        return f"{word[1]!r} is not a {command} command; " + (f"did you mean: {self.prog} {close[0]}" if close else
                                                              f"{command} takes one of: {', '.join(names)}")

    def _needs(self, names: str) -> str | None:
        """What the one required argument `names` lists takes, as its help says (None: several, or no help)."""
        command = self.prog.partition(" ")[2] or self.prog
        found = [a for a in self._actions if names in (*a.option_strings, a.metavar, a.dest)]
        if found and isinstance(found[0], argparse._SubParsersAction):  # `moechat bench` alone said "bench_command"
            return f"{command} needs one of: {', '.join(found[0].choices)}"
        if found and found[0].help and "%" not in found[0].help:  # `simulate` alone: where traces come from
            return f"{command} needs {names}: {found[0].help}"
        return None


def fail(message: str, code: int = 1) -> int:
    print(f"moechat: error: {' '.join(str(message).split())}", file=sys.stderr)  # one line, whatever a library said
    return code


class _Renamed(argparse.Action):
    """A removed flag: using it is a one-line error naming the flag that replaced it."""

    def __init__(self, option_strings, dest, new: str, **kw):
        super().__init__(option_strings, argparse.SUPPRESS, nargs="?", help=argparse.SUPPRESS)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was replaced by {self.new}")


def add_renamed(p: argparse.ArgumentParser, **renamed: str) -> None:
    """Old flags (old_name="--new-flag ...") that now only say what replaced them."""
    for old, new in renamed.items():
        p.add_argument("--" + old.replace("_", "-"), action=_Renamed, new=new)

def command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the command `argv` names (`moechat bench generate`'s for bench generate), else `parser`."""
    for word in argv:
        commands = parser._subparsers._group_actions[0].choices if parser._subparsers else {}
        if word in commands:
            parser = commands[word]
    return parser


def closest_flag(word: str, flags: list[str]) -> tuple[str, float] | None:
    """(the flag `word` is a typo of, how close: 1 for two neighbours swapped, the commonest slip, else difflib's ratio of at
    least 0.7), or None. difflib alone took `--prot` for `--prompt` (0.86) over `--port` (0.83)."""
    import difflib

    swapped = [f for f in flags if len(f) == len(word) and
               (d := [i for i, (a, b) in enumerate(zip(word, f)) if a != b]) and len(d) == 2 and d[1] == d[0] + 1
               and word[d[0]] == f[d[1]] and word[d[1]] == f[d[0]]]
    if swapped:
        return swapped[0], 1.0
    close = difflib.get_close_matches(word, flags, n=1, cutoff=0.7)
    return (close[0], difflib.SequenceMatcher(None, word, close[0]).ratio()) if close else None


def flag_before_the_command(parser: argparse.ArgumentParser, commands: dict, argv: list[str]) -> str | None:
    """What to say of a flag first that moechat itself does not take (None: argparse's error does): a command's
    (`moechat --model X`, or llama.cpp's `-m X`, `-n5`) with the command line that takes it, a typo of one (`--modle x`
    said "'x' is not a moechat command"), llama.cpp's -ngl, else unrecognized."""
    words = unglued(argv[:1]) + argv[1:]  # `moechat -n5 Hi`: -n 5 Hi
    flag = words[0].split("=")[0] if argv and argv[0].startswith("-") else None
    if flag in ON_THE_GPU:  # `moechat -ngl 99 ...`
        return f"{flag} is llama.cpp's; {GPU_LAYERS}"
    if not flag or any(known.startswith(flag) for known in parser._option_string_actions) or parser._typos([flag]):
        return None  # moechat's own (argparse takes `--setu`), or a typo of one (`--verison`), which argparse names
    ours = THEIR_FLAGS.get(flag, (flag,))[0]
    value = [f"={shlex.quote(words[0].partition('=')[2])}"] if "=" in words[0] else [*map(shlex.quote, words[1:2])]  # `--model=X`

    def line(command: str, meant: str) -> str:
        return " ".join(["moechat", command, meant, *value]).replace(" =", "=")

    taker = next((name for name in ("chat", *commands) if ours in commands[name]._option_string_actions), None)
    if taker:
        said = f"{flag} goes after a command" if ours == flag else f"{flag} is llama.cpp's; moechat's goes after a command"
        return f"{said}, e.g. {line(taker, ours)}"
    close = [(typo, name) for name in ("chat", *commands) for typo in commands[name]._typos([flag]).values()]
    ranked = sorted(close, key=lambda c: -closest_flag(flag, [c[0]])[1])  # stable: chat's first among equals
    return f"unknown flag {flag}; did you mean: {line(ranked[0][1], ranked[0][0])}" if ranked else \
        f"unrecognized arguments: {argv[0]}"
