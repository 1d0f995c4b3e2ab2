"""`moechat generate`: one reply headlessly, its text on standard output (or one JSON object: --json), its stats line
on standard error; its request from the flags (`--prompt`, `--prompt-ids`, `--raw`, `--system`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from .engine_config import choices, engine_config
from .flags import add_engine_args, add_sampling_args, add_template_args, int_list, request_thinking, sampling_params
from .parser import fail
from .terminal_text import as_typed, for_terminal


def add_generate(sub) -> None:
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


def add_request_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("text", nargs="?", type=as_typed, metavar="PROMPT", help="the user message, as --prompt gives it "
                     "(`moechat generate \"Hello\"`)")
    src.add_argument("--prompt", type=as_typed, help="a user message (sent through the model's chat template unless --raw); "
                     "- reads it from standard input (a long document: one argument holds at most 128 KiB)")
    src.add_argument("--prompt-ids", type=int_list, metavar="1,2,3", help="prompt as token ids")
    p.add_argument("--raw", action="store_true", help="send --prompt as plain text, without the chat template")
    p.add_argument("--system", type=as_typed, default=None, metavar="TEXT", help="system message")
    add_sampling_args(p, temperature=0.0, max_new_tokens=128)
    add_template_args(p)


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
        return fail(f"cannot write the trace to {path} ({err.strerror}): pick another --trace path")
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
                return fail(ev.message)
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
        return fail("interrupted" + (f": the routing so far is in {args.trace}" if kept else ""), 130)
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
