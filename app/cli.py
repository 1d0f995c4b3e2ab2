"""`moechat` command line. Keeps start-up light: PyTorch is imported only by commands that run a model."""
from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import shlex
import sys
from pathlib import Path

from .. import version_text
from .engine_config import choices, engine_config, first
from .options import SETTINGS_SAMPLING, add_flags
from .other_tools import GPU_LAYERS, ON_THE_GPU, THEIR_FLAGS, before_dashes, instead, not_a_command, ours, their_command, unglued
from .terminal_text import as_typed, for_terminal

MISSING = ("the following arguments are required: ", "one of the arguments ")  # argparse's words for what is missing


class _Parser(argparse.ArgumentParser):
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


def _fail(message: str, code: int = 1) -> int:
    print(f"moechat: error: {' '.join(str(message).split())}", file=sys.stderr)  # one line, whatever a library said
    return code


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None


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


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that loads a model: the engine options of app/options.py."""
    add_flags(p, "engine")
    add_renamed(p, host_ram_mib="--ram-budget-gib (in GiB)", expert_cache_mib="--expert-cache-gib (in GiB)")


def add_request_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("text", nargs="?", type=as_typed, metavar="PROMPT", help="the user message, as --prompt gives it "
                     "(`moechat generate \"Hello\"`)")
    src.add_argument("--prompt", type=as_typed, help="a user message (sent through the model's chat template unless --raw); "
                     "- reads it from standard input (a long document: one argument holds at most 128 KiB)")
    src.add_argument("--prompt-ids", type=_int_list, metavar="1,2,3", help="prompt as token ids")
    p.add_argument("--raw", action="store_true", help="send --prompt as plain text, without the chat template")
    p.add_argument("--system", type=as_typed, default=None, metavar="TEXT", help="system message")
    add_sampling_args(p, temperature=0.0, max_new_tokens=128)
    add_template_args(p)


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


def check_prompt_flags(args) -> None:
    """Before the model loads, refuse what a prompt would silently go without: the chat template's flags beside a
    prompt that skips the template, and a blank --prompt (an answer to nothing, exit 0)."""
    from ..engine import RequestError

    if args.text is not None:  # moechat generate "Hello": the positional form of --prompt
        args.prompt = args.text
    if args.prompt == "-":  # cat doc.txt | moechat generate --prompt -
        args.prompt = as_typed(sys.stdin.buffer.read().decode("utf-8", "surrogateescape"))
    skips = "--prompt-ids" if args.prompt_ids is not None else "--raw" if args.raw else None
    for flag, value in (("--system", args.system), ("--thinking", args.thinking)):
        if value is not None and skips:
            raise RequestError(f"{flag} goes into the chat template, which {skips} skips: drop one of the two")
    if args.prompt is not None and not args.prompt.strip():
        raise RequestError("the prompt is empty: give the text to send")


def make_request(args, tokenizer):
    from ..engine import Request, RequestError

    if args.prompt_ids is not None:
        return Request(token_ids=args.prompt_ids)
    if not args.raw and getattr(tokenizer, "chat_template", None):
        messages = (([{"role": "system", "content": args.system}] if args.system else [])
                    + [{"role": "user", "content": args.prompt}])
        return Request(messages=messages, thinking=request_thinking(args))
    if args.system is not None:  # a plain prompt has no place for it: dropping it would answer without it
        raise RequestError("this model has no chat template, so --system has nowhere to go: put it in --prompt instead")
    return Request(prompt=args.prompt)


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


def acceptance(summary) -> str:
    """The reply's draft acceptance for a stats line; n/a where nothing was drafted (no drafter)."""
    return f"{summary.acceptance_rate:.2f}" if summary.drafted else "n/a"


def fast_tier(engine) -> bool:
    """Whether the embedded engine keeps experts in a fast tier (VRAM, or a RAM pool): without one every expert runs on
    the CPU, no hit can happen and nothing moves (a stats line's "expert hit rate 0.00" read as a fault)."""
    model = getattr(engine, "model", None)  # a remote backend has none
    return model is not None and model.cache.capacity > 0


def stats_line(s, experts_cached: bool = True) -> str:
    """generate's stats line; a reply of one token had no decode step (it comes out of the prefill): no decode rate.
    experts_cached: the run has a fast tier, whose hit rate and copies are said."""
    decode = f"{s.decode_tokens_per_s:.1f} tok/s" if s.new_tokens > 1 else "n/a"
    experts = (f"expert hit rate {s.hit_rate:.2f}, {s.bytes_moved / 2**20:.1f} MiB moved" if experts_cached else
               "experts all on the CPU")
    return (f"[{s.new_tokens} token{'' if s.new_tokens == 1 else 's'}, prefill {s.prefill_tokens_per_s:.1f} tok/s, "
            f"decode {decode}, acceptance {acceptance(s)}, {experts}, finish: {s.finish_reason}]")


def print_notices(engine) -> None:
    """The loaded engine's lines for the user (native kernels missing, a rebuilt cache, a shrunk fast tier, a drafter
    with nothing to draft with), one per line on stderr: generate, chat and serve alike."""
    for notice in engine.notices:
        print(f"note: {notice}", file=sys.stderr)


def _check_writable(path: Path, flag: str) -> None:
    from ..engine import MoechatError

    why = ("it is a folder" if path.is_dir() else "its folder does not exist" if not path.parent.is_dir()
           else "its folder is not writable" if not os.access(path.parent, os.W_OK) else "")
    if why:
        raise MoechatError(f"cannot write {path}: {why}: pick another {flag} path")


def _write_trace(trace, path: str) -> int | None:
    try:
        trace.write(path)
    except OSError as err:
        return _fail(f"cannot write the trace to {path} ({err.strerror}): pick another --trace path")
    return None


def generate_json(args, engine, token_ids: list[int], text: str, stats: dict | None, interrupted: bool = False) -> str:
    """generate --json's object; an interrupted reply's is what came so far, with no stats (the run did not finish); one
    interrupted while the model loaded (engine None) has null for what only the loaded model knows."""
    where, profile = getattr(args, "placement", None), getattr(args, "profile", None)  # unset: stopped before they were
    loaded = engine is not None
    return json.dumps({"token_ids": token_ids, "text": text, "stats": stats, "interrupted": interrupted,
                       "profile": None if profile is None else str(profile),
                       "choices": choices(engine, args.sources) if loaded else None,
                       "quant": engine.model.store.quant if loaded else None,
                       "device": where and where.device, "dtype": where and where.dtype,
                       "decode_path": engine.model.decode_path() if loaded else None,
                       "costs": dataclasses.asdict(engine.model.runtime.costs) if loaded else None,
                       "placement": where and {"device": where.device_why, "dtype": where.dtype_why}})


def cmd_generate(args) -> int:
    check_prompt_flags(args)  # before PyTorch loads: a refused flag costs no start-up
    if args.temperature == 0 and (args.top_p != 1 or args.top_k or args.seed is not None):  # llama.cpp's default samples
        print("note: generate decodes greedily unless --temperature is above 0, so --top-p, --top-k and --seed do nothing "
              "here: add --temperature 0.7 to sample", file=sys.stderr)
    from ..engine import Engine, Error, Finished, TokenDelta, TraceRecorder

    if args.trace:
        _check_writable(Path(args.trace), "--trace")  # before the model loads, not after the reply
    try:
        engine = Engine(engine_config(args))
    except KeyboardInterrupt:  # Ctrl-C while the model loads: nothing generated, and a script still gets its object
        if args.json:
            print(generate_json(args, None, [], "", None, interrupted=True))
        raise
    print_notices(engine)
    request, params = make_request(args, engine.model.tokenizer), sampling_params(args)
    trace = TraceRecorder(engine.model.store.layers) if args.trace else None
    finished, shown, ids, pieces = None, for_terminal(sys.stdout), [], []  # the reply so far: its token ids and text
    events = engine.generate(request, params, trace)
    try:
        for ev in events:
            if isinstance(ev, TokenDelta):
                ids += ev.token_ids
                pieces.append(ev.text)
                if not args.json:
                    sys.stdout.write(shown(ev.text))
                    sys.stdout.flush()
            elif isinstance(ev, Error):
                return _fail(ev.message)
            elif isinstance(ev, Finished):
                finished = ev
    except KeyboardInterrupt:
        events.close()
        print(file=sys.stderr)
        if args.json:  # a script still gets one object: the reply so far
            print(generate_json(args, engine, ids, "".join(pieces), None, interrupted=True))
        if trace is not None:
            trace.drop_unfinished()
        kept = trace is not None and trace.records and _write_trace(trace, args.trace) is None  # the routing so far stays
        return _fail("interrupted" + (f": the routing so far is in {args.trace}" if kept else ""), 130)
    if trace and (failed := _write_trace(trace, args.trace)):
        return failed
    s = finished.summary
    if args.json:
        print(generate_json(args, engine, finished.token_ids, finished.text, s.to_dict()))
    else:
        print()
        print(f"[runs on {args.placement}]", file=sys.stderr)
        if args.profile is not None:
            print(f"[calibration profile: {args.profile}]", file=sys.stderr)
        print(stats_line(s, fast_tier(engine)), file=sys.stderr)
    if s.lossy:
        print(f"[{s.lossy}: {s.dropped} activations dropped]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    if args.plain or not (sys.stdin.isatty() and sys.stdout.isatty()):
        if args.setup:
            return _fail("the setup wizard needs a terminal: run `moechat --setup` in one")
        from .plain_chat import cmd_chat as plain_chat

        return plain_chat(args)
    from .tui.app import run_tui

    return run_tui(args)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moechat", description="Chat with Mixture-of-Experts models larger than your GPU.")
    parser.add_argument("--version", action="version", version=version_text())
    parser.add_argument("--setup", action="store_true",
                        help="open the setup wizard (model, memory budgets, calibration), then the chat")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text headlessly (scripts, checks, benchmarks)")
    add_engine_args(gen)
    add_request_args(gen)
    gen.add_argument("--trace", metavar="FILE", help="record routing to FILE (JSON Lines, see docs/trace-format.md)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object: token_ids, text, stats (null when interrupted), interrupted (Ctrl-C "
                          "ended the reply: the object holds what came so far, exit 130), profile (the calibration "
                          "profile used, or null), "
                          "choices (drafter, draft_len, policy, utility_bound, quant, expert_cache (experts on the fast "
                          "tier): each value that ran and where it came from: command line, settings, profile or default), "
                          "quant (the routed experts' format), device, dtype, placement (why each), costs (the scheduler's "
                          "unit costs and their source: the calibration profile or built-in defaults)")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat: the full-screen app on a terminal, line by line with --plain or "
                                       "when input or output is not a terminal (what `moechat` alone runs)")
    add_engine_args(chat)
    add_flags(chat, "backend")
    default_to_settings(chat, ("backend_key_env",))  # the settings' variable, else MOECHAT_API_KEY: the flag's default hid it
    chat.add_argument("--plain", action="store_true", help="line-by-line chat instead of the full-screen app")
    chat.add_argument("--system", type=as_typed, metavar="TEXT",
                      help="system message (plain chat; the app sets it per conversation)")
    chat.add_argument("--setup", action="store_true", help=argparse.SUPPRESS)  # set by `moechat --setup`
    # sampling (exact in distribution): less looping than greedy
    add_sampling_args(chat, temperature=0.7, max_new_tokens=512, top_p=0.9, from_settings=True)
    add_template_args(chat)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", parser_class=_Parser, required=True)
    from .bench.generate import add_bench_generate

    add_bench_generate(bench_sub)
    from .bench.chat import add_bench_chat

    add_bench_chat(bench_sub)
    from .bench.random_model import add_random_model

    add_random_model(bench_sub)
    from .bench.cpu_experts import add_bench_cpu_experts

    add_bench_cpu_experts(bench_sub)
    from .bench.kernels import add_bench_kernels

    add_bench_kernels(bench_sub)
    from .bench.e2e import add_bench_e2e

    add_bench_e2e(bench_sub)
    from .bench.quality import add_bench_quality

    add_bench_quality(bench_sub)
    from .bench.answers import add_bench_answers

    add_bench_answers(bench_sub)
    from .bench.serve import add_bench_serve

    add_bench_serve(bench_sub)
    from .server.command import add_serve

    add_serve(sub)
    from .simulate import add_simulate

    add_simulate(sub)
    from .estimate import add_estimate

    add_estimate(sub)
    from .calibrate import add_calibrate

    add_calibrate(sub)
    from .models import add_model_commands

    add_model_commands(sub)
    from .doctor import add_doctor

    add_doctor(sub)
    return parser


def _command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
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


def _flag_before_the_command(parser: argparse.ArgumentParser, commands: dict, argv: list[str]) -> str | None:
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


def main(argv: list[str] | None = None) -> int:
    # Before torch loads: OpenMP's idle threads sleep instead of spinning, so they do not take the cores the
    # native kernels' threads run on between PyTorch ops (measured: decode 28 -> 33 tok/s, docs/benchmarks.md).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    reconfigure = getattr(sys.stdout, "reconfigure", None)  # a text file's; a stream a caller put there may lack it
    if reconfigure and "utf" not in (getattr(sys.stdout, "encoding", None) or "utf").lower():  # an ASCII or Latin-1
        reconfigure(errors="replace")  # locale: what its encoding lacks is a "?" (it ended generate, and plain chat, reply lost)
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    commands = parser._subparsers._group_actions[0].choices
    if said := _flag_before_the_command(parser, commands, argv):
        parser.error(said)
    if argv[:1] == ["help"]:  # as `git help`: the help asked for, `moechat help serve` serve's
        words = [w for w in argv[1:] if not w.startswith("-")]
        command = _command_parser(parser, words)
        if command.prog != " ".join([parser.prog, *words]):  # `moechat help chta` printed moechat's help, exit 0
            parser.error(f"{' '.join(words)!r} is not a command")
        command.print_help()
        return 0
    if argv and not argv[0].startswith("-") and argv[0] not in commands:
        parser.error(their_command(argv, commands) or not_a_command(argv, commands))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's parser: `moechat serve --prot 1` points to `moechat serve --help`, which lists its flags
        command = _command_parser(parser, argv)
        command.error(command.unrecognized(args, unknown))
    if args.setup and getattr(args, "func", None):
        parser.error("--setup opens the chat with the setup wizard first: give it no command")
    if not getattr(args, "func", None):  # `moechat` alone: chat (the app on a terminal); `--setup` rides along
        args = parser.parse_args(["chat"] + (["--setup"] if args.setup else []))
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a reader that left is caught, not at exit
        return code
    except ModuleNotFoundError as err:
        if err.name == "torch":
            from ..engine import INSTALLER

            return _fail(f"PyTorch is not installed: run {INSTALLER}, or `pip install torch` "
                         "(CPU-only machines: --index-url https://download.pytorch.org/whl/cpu)")
        return _fail(f"missing Python package {err.name!r}: reinstall moechat (pip install moechat)")
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:  # `moechat models --json | head`: the reader left; say nothing more into the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as err:
        from ..engine import MoechatError, out_of_vram

        if isinstance(err, (MoechatError, ValueError)):
            return _fail(str(err))
        if said := out_of_vram(err):
            return _fail(said)
        if _out_of_memory(err):
            return _fail(f"out of memory ({err}): close other programs, or give moechat less to hold: a --ram-budget-gib "
                         "below the experts' size (read from disk then), --quant int4, or a shorter --context-len")
        return _fail(f"internal error ({type(err).__name__}: {err}); please report it")


def _out_of_memory(err: Exception) -> bool:
    """An allocation the system refused (a limit on the process's memory, Windows' commit limit; Linux's OOM killer says
    nothing): Python's MemoryError, an mmap's ENOMEM, PyTorch's CPU allocator's message."""
    return (isinstance(err, MemoryError) or getattr(err, "errno", None) == errno.ENOMEM
            or any(s in str(err) for s in ("Cannot allocate memory", "can't allocate memory", "not enough memory")))


if __name__ == "__main__":
    sys.exit(main())
