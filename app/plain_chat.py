"""`moechat chat`: a line-by-line terminal chat on the engine (no TUI), also usable with piped input."""
from __future__ import annotations

import sys
from pathlib import Path

HELP = "type a message; /reset starts over, /quit or Ctrl-D leaves, Ctrl-C stops a reply"


def cmd_chat(args) -> int:
    from ..engine import Engine, Error, Finished, Request, TokenDelta
    from .cli import engine_config, sampling_params
    from .history import fit_for_engine

    print("moechat: loading the model...", file=sys.stderr, flush=True)
    engine = Engine(engine_config(args))
    params = sampling_params(args)
    name = Path(args.model).name if Path(args.model).name != "model" else Path(args.model).parent.name
    drafter = (f"draft model {Path(args.draft).parent.name}/{Path(args.draft).name}" if engine.drafter.name == "model"
               else engine.drafter.name)
    print(f"moechat: {name} on {engine.model.device}, drafter: {drafter}; {HELP}", file=sys.stderr)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages, said = list(start), ""
    interactive = sys.stdin.isatty()
    while True:
        try:
            text = input("you> " if interactive else "")
        except EOFError:
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        if not text.strip():
            continue
        if text.strip() in ("/quit", "/exit"):
            return 0
        if text.strip() == "/reset":
            messages = list(start)
            print("moechat: conversation cleared", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        request, notice = fit_for_engine(engine, messages, params.max_new_tokens)
        if notice and notice != said:  # once per cut
            print(f"moechat: {notice}", file=sys.stderr)
        said = notice
        sys.stdout.write("moechat> ")
        reply, finished = [], None
        events = engine.generate(Request(messages=list(request)), params)
        try:
            for ev in events:
                if isinstance(ev, TokenDelta):
                    reply.append(ev.text)
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                elif isinstance(ev, Error):
                    print(f"\nmoechat: error: {ev.message}"
                          + (" (/reset starts a new conversation)" if "context" in ev.message else ""),
                          file=sys.stderr)
                elif isinstance(ev, Finished):
                    finished = ev
        except KeyboardInterrupt:
            events.close()  # cancels the request; the engine is ready for the next one
            print("\nmoechat: stopped", file=sys.stderr)
        print(flush=True)
        if finished is None and not reply:
            messages.pop()  # nothing came back: the user's message can be sent again
            continue
        messages.append({"role": "assistant", "content": finished.text if finished else "".join(reply)})
        if finished:
            s = finished.summary
            print(f"[{s.new_tokens} tokens, {s.decode_tokens_per_s:.1f} tok/s, acceptance {s.acceptance_rate:.2f}, "
                  f"expert hit rate {s.hit_rate:.2f}]" + (f" [{s.lossy}]" if s.lossy else ""), file=sys.stderr)
