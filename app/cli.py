"""`moechat` command line. Keeps start-up light: PyTorch is imported only by commands that run a model."""
from __future__ import annotations

import argparse
import errno
import os
import sys

from .. import version_text
from .flags import add_engine_args, add_sampling_args, add_template_args, default_to_settings
from .options import add_flags
from .other_tools import not_a_command, their_command
from .parser import Parser, command_parser, fail, flag_before_the_command
from .terminal_text import as_typed


def cmd_chat(args) -> int:
    if args.plain or not (sys.stdin.isatty() and sys.stdout.isatty()):
        if args.setup:
            return fail("the setup wizard needs a terminal: run `moechat --setup` in one")
        from .plain_chat import cmd_chat as plain_chat

        return plain_chat(args)
    from .tui.app import run_tui

    return run_tui(args)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="moechat", description="Chat with Mixture-of-Experts models larger than your GPU.")
    parser.add_argument("--version", action="version", version=version_text())
    parser.add_argument("--setup", action="store_true",
                        help="open the setup wizard (model, memory budgets, calibration), then the chat")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)

    from .generate import add_generate

    add_generate(sub)

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
    bench_sub = bench.add_subparsers(dest="bench_command", parser_class=Parser, required=True)
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
    if said := flag_before_the_command(parser, commands, argv):
        parser.error(said)
    if argv[:1] == ["help"]:  # as `git help`: the help asked for, `moechat help serve` serve's
        words = [w for w in argv[1:] if not w.startswith("-")]
        command = command_parser(parser, words)
        if command.prog != " ".join([parser.prog, *words]):  # `moechat help chta` printed moechat's help, exit 0
            parser.error(f"{' '.join(words)!r} is not a command")
        command.print_help()
        return 0
    if argv and not argv[0].startswith("-") and argv[0] not in commands:
        parser.error(their_command(argv, commands) or not_a_command(argv, commands))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's parser: `moechat serve --prot 1` points to `moechat serve --help`, which lists its flags
        command = command_parser(parser, argv)
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

            return fail(f"PyTorch is not installed: run {INSTALLER}, or `pip install torch` "
                         "(CPU-only machines: --index-url https://download.pytorch.org/whl/cpu)")
        return fail(f"missing Python package {err.name!r}: reinstall moechat (pip install moechat)")
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except BrokenPipeError:  # `moechat models --json | head`: the reader left; say nothing more into the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as err:
        from ..engine import MoechatError, out_of_vram

        if isinstance(err, (MoechatError, ValueError)):
            return fail(str(err))
        if said := out_of_vram(err):
            return fail(said)
        if _out_of_memory(err):
            return fail(f"out of memory ({err}): close other programs, or give moechat less to hold: a --ram-budget-gib "
                         "below the experts' size (read from disk then), --quant int4, or a shorter --context-len")
        return fail(f"internal error ({type(err).__name__}: {err}); please report it")


def _out_of_memory(err: Exception) -> bool:
    """An allocation the system refused (a limit on the process's memory, Windows' commit limit; Linux's OOM killer says
    nothing): Python's MemoryError, an mmap's ENOMEM, PyTorch's CPU allocator's message."""
    return (isinstance(err, MemoryError) or getattr(err, "errno", None) == errno.ENOMEM
            or any(s in str(err) for s in ("Cannot allocate memory", "can't allocate memory", "not enough memory")))


if __name__ == "__main__":
    sys.exit(main())
