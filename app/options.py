"""Every user option, declared once (Harlequin's model).

`OPTIONS` feeds the command-line flags (`add_flags`), `settings.toml` (the `Settings` dataclass in
settings.py is built from it), the settings screen and the wizard (their fields and validators) and
the README's options table (`python -m moechat.app.options --markdown` prints it; a test keeps the
README equal). An option's name is its settings key; its flag is `--name-with-dashes`. Research
knobs no user sets (utility variant, demote, lookahead, CPU cost model) are not here: they stay on
SchedulerConfig (docs/design.md says where each is set).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..engine import DTYPES, POLICIES, QUANTS, SchedulerConfig, SpecConfig

TOKENS_MAX = 10_000_000  # past any model's context; a larger whole number is not a TOML (64-bit) integer either
GIB_MAX = 100_000  # a budget above this is a typo, and past ~1e299 GiB its byte count overflows
THEMES = ("dark", "light")  # besides Textual's built-in theme names


def textual_themes() -> tuple[str, ...]:
    from textual.theme import BUILTIN_THEMES  # only when a theme name is not dark/light: keeps start-up light

    return tuple(BUILTIN_THEMES)


def theme_names() -> tuple[str, ...]:
    return THEMES + tuple(t for t in textual_themes() if t not in THEMES)


def _theme_problem(value) -> str | None:
    if value in THEMES or value in textual_themes():  # dark/light first: textual is not imported for them
        return None
    return "must be dark, light or a Textual theme name (e.g. nord, dracula)"


def _keys_problem(value) -> str | None:
    ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in value.items())
    return None if ok else "must be a table of action = \"key\" strings"


def _device_problem(value) -> str | None:
    return None if re.fullmatch(r"auto|cpu|cuda(:\d+)?", value) else "must be auto, cpu, cuda or cuda:N"


def _env_name_problem(value) -> str | None:
    ok = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value)
    return None if ok else "must be an environment variable's name ([A-Za-z_][A-Za-z0-9_]*, e.g. MOECHAT_API_KEY)"


def url_problem(value) -> str | None:
    """Why `value` cannot be a backend's URL (None: it can)."""
    from ipaddress import ip_address
    from urllib.parse import urlsplit

    if not re.fullmatch(r"https?://\S+", value, re.IGNORECASE):
        return "must be an http:// or https:// URL, e.g. http://localhost:8000/v1"
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (a port that is not a number raises here)
        if not parts.hostname:
            raise ValueError("no host")
        if "[" in parts.netloc:
            ip_address(parts.hostname)  # a bracketed host must be an IPv6 address
    except ValueError as err:
        return f"is not a valid URL ({err}), e.g. http://localhost:8000/v1"
    return None


def shown(value, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: a pasted page in a field is refused in one short line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def value_words(value) -> str:
    """A value as the help and the settings screen write it: on/off, 16 rather than 16.0."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else "" if value in ([], {}) else str(value)


@dataclass(frozen=True)
class Option:
    """One user option: its settings key, flag, type, unit, default, check, help and where it shows."""

    name: str  # the settings key; the flag is --name-with-dashes
    kind: type  # int | float | str | bool (--name / --no-name) | list (a repeatable flag) | dict (a settings table)
    default: object  # None: unset (`unset` says what applies then)
    help: str
    group: str  # engine: flags of the commands that load a model; sampling: of generate and chat; template: of those that
    # send messages (generate, chat); backend: of chat; app: none
    unit: str = ""  # what a number counts, e.g. GiB
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is refused: (low, high]
    choices: tuple = ()
    problem_of: Callable[[object], str | None] | None = None  # a check beyond kind, bounds and choices
    symbol: str = ""  # the paper's letter, named in messages
    unset: str = ""  # what applies when the option is not given
    live: bool = False  # the running engine takes a new value without loading the model again
    setting: bool = True  # a key of settings.toml
    label: str = ""  # the settings screen's label; "" keeps the option off the screen
    placeholder: str = ""  # the screen's hint in an empty field; "" shows the default
    widget: str = "input"  # on the screen: input | select | drafter
    metavar: str | None = None
    other_defaults: str = ""  # commands whose flag defaults differ from the settings' default

    @property
    def flag(self) -> str | None:
        return None if self.group == "app" else "--" + self.name.replace("_", "-")

    def rule(self) -> str:
        """What a good value is, as the end of "must be ..."."""
        if self.choices:
            return f"must be one of {', '.join(self.choices)}"
        if self.kind is int:
            if self.low is None:
                return "must be a whole number"
            return f"must be a whole number in {int(self.low)}..{int(self.high)}" if self.high is not None \
                else f"must be a whole number >= {self.low:g}"
        if self.kind is float:
            unit = f" {self.unit}" if self.unit else ""
            if self.high is None:
                return f"must be a number {'>' if self.low_open else '>='} {self.low:g}{unit}"
            return f"must be a number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]{unit}"
        return "must be a non-empty string"

    def problem(self, value) -> str | None:
        """None when `value` is good for this option, else the rule it breaks ("must be ...")."""
        if value is None and self.default is None:
            return None
        if self.kind in (int, float):
            kinds = (int,) if self.kind is int else (int, float)
            if not isinstance(value, kinds) or isinstance(value, bool) or isinstance(value, float) and not math.isfinite(value):
                return self.rule()  # a whole number is finite, however long (math.isfinite would overflow on it)
            if (self.low is not None and (value < self.low or self.low_open and value == self.low)) or \
                    (self.high is not None and value > self.high):
                return self.rule()
        elif self.kind is str:
            if not isinstance(value, str) or not value.strip():
                return self.rule()  # "must be one of none, int8, int4" where there are choices
            if self.choices and value not in self.choices:
                return self.rule()
        elif self.kind is bool and not isinstance(value, bool):
            return "must be true or false"
        elif self.kind is list and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return "must be a list of strings"
        return self.problem_of(value) if self.problem_of else None

    def check(self, value) -> None:
        """Raise ValueError, one line naming the settings key, when `value` is not good."""
        problem = self.problem(value)
        if problem:
            got = ("true" if value else "false") if isinstance(value, bool) else shown(value)  # as the TOML file wrote it
            raise ValueError(f"`{self.name}`{f' ({self.symbol})' if self.symbol else ''} {problem}, got {got}")

    def parse(self, text: str):
        """A flag's text as its value (argparse's `type`); garbage raises ArgumentTypeError in one line."""
        try:
            value = self.kind(text) if self.kind in (int, float) else text
        except ValueError:
            value = text
        problem = self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(f"{problem}, got {text!r}")
        return value

    def widget_choices(self) -> tuple[str, ...]:
        """What the settings screen's Select offers."""
        return self.choices or (theme_names() if self.name == "theme" else ())

    def add_flag(self, parser: argparse.ArgumentParser, default=None) -> None:
        """This option as a flag of `parser`; `default` for a command whose default differs."""
        default = self.default if default is None else default
        help_text = self.help_line(default).replace("%", "%%")  # argparse formats help with %: "5%" broke every --help
        kw = dict(default=default, help=help_text, metavar=self.metavar)
        if self.kind is list:
            parser.add_argument(self.flag, action="append", **kw)
        elif self.kind is bool:  # --name and --no-name
            parser.add_argument(self.flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            parser.add_argument(self.flag, type=self.parse, choices=self.choices or None, **kw)

    def help_line(self, default) -> str:
        when = self.unset if default is None else value_words(default)
        if default is None and self.setting:
            when = f"the settings, else {when}"
        return f"{self.help} (default: {when})" if when else self.help

    def default_text(self) -> str:
        """The default in words: the value, or what applies when unset."""
        return self.unset if self.default is None else value_words(self.default)


_SCHED, _SPEC = SchedulerConfig(), SpecConfig()
_FROM_PROFILE = "the calibration profile, else {}"

# In the order the flags' help, the settings screen and the README show them.
OPTIONS: tuple[Option, ...] = (
    Option("model", str, None, "checkpoint directory or a model fetched with `moechat pull`", "engine",
           unset="the embedded demo", metavar="DIR|OWNER/NAME"),
    Option("backend", str, None, "an OpenAI-compatible server to chat through instead of the embedded engine, e.g. "
           "http://host:8000/v1 (vLLM, SGLang, llama-server, `moechat serve`)", "backend", problem_of=url_problem,
           unset="the embedded engine", label="Remote backend (URL)", placeholder="none: the embedded engine",
           metavar="URL"),
    Option("backend_model", str, None, "the model to ask the remote backend for", "backend",
           unset="the first the server lists", label="Remote model", placeholder="the server's first", metavar="NAME"),
    Option("backend_key_env", str, "MOECHAT_API_KEY", "environment variable holding the remote backend's API key "
           "(the key itself is never stored)", "backend", label="API key variable", metavar="NAME",
           problem_of=_env_name_problem),
    Option("vram_budget_gib", float, None, "cap on everything moechat puts on the GPU; what does not fit is refused "
           "before loading", "engine", unit="GiB", low=0, high=GIB_MAX, low_open=True, unset="the free VRAM",
           label="VRAM budget (GiB)", placeholder="free VRAM", metavar="GIB"),
    Option("ram_budget_gib", float, None, "all the RAM moechat may use: the experts, and without a GPU the weights and KV "
           "cache, with 2 GiB (or 5%) left for the system; when the experts do not all fit, all are read in place from the "
           "mmap'd files (the OS page cache keeps what fits)", "engine",
           unit="GiB", low=0, high=GIB_MAX, low_open=True, unset="the available RAM",
           label="RAM budget (GiB)", placeholder="available RAM", metavar="GIB"),
    Option("quant", str, None, "routed experts' storage: none (the checkpoint's dtype), int8 or int4 (quantized once "
           "at first load, cached on disk); a pre-quantized checkpoint (GPTQ, compressed-tensors) runs as it is", "engine",
           choices=QUANTS,
           unset=_FROM_PROFILE.format("none"), label="Quantized experts", placeholder="from calibration", widget="select"),
    Option("expert_cache_ratio", float, None, "share of routed experts kept on the compute device, the fast tier",
           "engine", low=0, high=1, unset="the calibration profile on cuda, else what the free VRAM holds beside "
           "the weights, KV cache and margin on cuda, 0 on cpu",
           label="Expert cache ratio", placeholder="from calibration", metavar="R"),
    Option("expert_cache_gib", float, None, "the fast tier as a byte budget, overriding the ratio",
           "engine", unit="GiB", low=0, high=GIB_MAX, setting=False, metavar="GIB"),
    Option("utility_bound", int, None, "utility levels 0..K of spac's expert ranking", "engine", low=1, high=16,
           symbol="K", unset=_FROM_PROFILE.format(_SCHED.utility_bound), label="K (utility bound)",
           placeholder="from calibration", metavar="K"),
    Option("draft_len", int, None, "tokens the drafter proposes per step", "engine", unit="tokens", low=1, high=32,
           symbol="γ", unset=_FROM_PROFILE.format(_SPEC.draft_len), label="γ (draft length)",
           placeholder="from calibration", metavar="N"),
    Option("context_len", int, None, "context length, in tokens", "engine", unit="tokens", low=1, high=TOKENS_MAX,
           unset="the model's, cut to what fits beside the experts", label="Context length", placeholder="the model's",
           metavar="N"),
    Option("conversation_cache_gib", float, None, "KV caches of the most recent conversations kept in RAM, so a "
           "return to one prefills only its new message; the least recently used go first (the running chat's stays between "
           "its turns even when larger), 0 turns reuse off", "engine",
           unit="GiB", low=0, high=GIB_MAX, unset="a quarter of the RAM free after loading, at most 4",
           label="Chat KV cache (GiB)", placeholder="auto", metavar="GIB"),
    Option("policy", str, None, "fast-tier residency policy: lru (on demand), static (pinned by the first prompt), "
           "lfu (most used so far), specmoe (each layer's hottest of the last step), eam (this request's activations "
           "matched against past requests'), spac (MoE-SpAc), spmoe (lru plus draft-phase prefetch)", "engine",
           choices=POLICIES, unset=_FROM_PROFILE.format(_SCHED.policy), label="Policy",
           placeholder="from calibration", widget="select"),
    Option("draft", str, None, "drafter: none, self (the target with its resident experts), or the directory of a "
           "dense model with the same tokenizer", "engine", unset="the calibration profile, else the demo's draft for "
           "the demo on a GPU, none on a CPU and for other models", label="Drafter", placeholder="default", widget="drafter",
           metavar="none|self|DIR"),
    Option("expert_budget", int, None, "LOSSY: verification computes at most B experts per MoE layer, the ones the "
           "router weighs most; output then differs from the model's (off without a drafter)", "engine", low=1, setting=False,
           unset="off", metavar="B"),
    Option("device", str, None, "compute device: auto (CUDA when PyTorch can use an NVIDIA GPU, the one with the most "
           "free memory, else the CPU), cpu, cuda or cuda:N; an unusable CUDA runs on the CPU with a one-line notice",
           "engine", problem_of=_device_problem, unset="auto", label="Device", placeholder="auto",
           metavar="auto|cpu|cuda[:N]"),
    Option("dtype", str, None, "compute dtype: auto (the checkpoint's where the device computes it well: bfloat16 on "
           "a GPU that has it, else float16; on a CPU float32 for quantized, small or bf16 models, a bf16 one's "
           "weights kept bf16), float32, bfloat16 or "
           "float16", "engine", choices=("auto",) + DTYPES, unset="auto", label="Compute dtype", placeholder="auto",
           widget="select"),
    Option("lean_decode", bool, True, "decode, verification and draft-model steps skip transformers' module tree: "
           "moechat's own forward over the same weights (CPU, fp32: native, with every expert on the CPU, and for a "
           "dense draft, the whole layer stack in one call per step; CUDA: the dense path between MoE layers replayed "
           "as CUDA graphs), same greedy tokens",
           "engine", setting=False),
    Option("temperature", float, 0.7, "sampling temperature, 0 is greedy", "sampling", low=0, high=10,
           live=True, other_defaults="generate: 0", label="Temperature", metavar="T"),
    Option("top_p", float, 0.9, "nucleus sampling: draw among the likeliest tokens whose probabilities add up to P",
           "sampling", low=0, high=1, low_open=True, live=True, other_defaults="generate: 1", label="Top-p", metavar="P"),
    Option("max_new_tokens", int, 512, "longest reply, in tokens", "sampling", unit="tokens", low=1, high=TOKENS_MAX,
           live=True,
           other_defaults="generate: 128", label="Max new tokens", metavar="N"),
    Option("thinking", str, None, "models that reason before they answer (Qwen3; DeepSeek-R1's distills always do): "
           "on thinks first, off answers at once (far sooner on a CPU), auto keeps the chat template's default; the chat "
           "folds the reasoning above the answer", "template", choices=("auto", "on", "off"), unset="auto", live=True,
           label="Thinking", placeholder="auto", widget="select"),
    Option("top_k", int, 0, "sample from the K likeliest tokens, 0 turns it off", "sampling", low=0, setting=False,
           metavar="K"),
    Option("seed", int, None, "random seed of sampling", "sampling", setting=False, unset="random",
           metavar="N"),
    Option("stop", list, [], "stop string (repeatable)", "sampling", setting=False, metavar="TEXT"),
    Option("theme", str, "dark", "dark, light or a Textual theme name", "app", problem_of=_theme_problem, live=True,
           label="Theme", widget="select"),
    Option("keys", dict, {}, "remapped key bindings: action = \"key\", e.g. regenerate = \"ctrl+g\"", "app",
           problem_of=_keys_problem, live=True),
)
OPTION = {o.name: o for o in OPTIONS}
_FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def in_app_words(line: str, keys: bool = False) -> str:
    """An engine line shown in the app: each option's flag as its settings screen label (`lower --context-len to 4,096`
    -> `lower "Context length" to 4,096`), which is where a user of the app changes it; other flags stay. keys: as its
    settings.toml key instead (`lower settings' context_len to 4,096`), for a command that reads the settings file and
    takes no such flag (calibrate)."""
    names = {o.flag: f"settings' {o.name}" if keys else f'"{o.label}"' for o in OPTIONS
             if o.flag and (o.setting if keys else o.label)}
    return _FLAG.sub(lambda m: names.get(m.group(), m.group()), line)


BUDGETS = ("vram_budget_gib", "ram_budget_gib")  # the memory budgets (the wizard's fields)
HELD = (*BUDGETS, "conversation_cache_gib")  # the options whose value this machine's memory bounds


def machine_memory(gpus: bool = True) -> tuple[int | None, int | None]:
    """This machine's RAM and its largest GPU's memory (NVML; None where unknown, or not asked: `gpus` False)."""
    from ..engine import gpu_info, physical_ram_bytes

    return physical_ram_bytes(), max((g.total_bytes for g in gpu_info()[0]), default=None) if gpus else None


def budget_hint(name: str, value, ram: int | None, vram: int | None) -> str:
    """A budget above this machine's memory (ram, vram: machine_memory's), or a RAM budget the system's headroom takes
    whole, in one line, "" for any other value: said where it is typed, not refused, since a load holds it to the machine
    (and a settings file may move to a larger one)."""
    if name not in HELD or isinstance(value, bool) or not isinstance(value, (int, float)):
        return ""
    from ..engine import above_the_machine, within_the_headroom

    if name == "vram_budget_gib":
        return above_the_machine(value * 2**30, vram, vram=True)
    if name == "conversation_cache_gib":  # what moechat keeps, not what it may use: no headroom to leave
        return above_the_machine(value * 2**30, ram)
    return above_the_machine(value * 2**30, ram) or within_the_headroom(value * 2**30)


SETTINGS_SAMPLING = tuple(o.name for o in OPTIONS if o.group == "sampling" and o.setting)  # the chat's, from settings.toml


def winning_flags(args) -> dict[str, object]:
    """The engine's and the backend's flags typed on the command line: they win over settings.toml at every load of this run
    (a flag that is no setting, such as --expert-cache-gib over the settings' ratio, where it differs from its default; the
    sampling flags give way once their field is saved)."""
    return {o.name: value for o in OPTIONS if o.group in ("engine", "backend")
            and (value := getattr(args, o.name, None)) is not None and (o.setting or value != o.default)}


def add_flags(parser: argparse.ArgumentParser, group: str, **defaults) -> None:
    """The flags of one group; `defaults` overrides a default where this command's differs."""
    for o in OPTIONS:
        if o.group == group:
            o.add_flag(parser, defaults.get(o.name))


def markdown_table() -> str:
    """The README's options table."""
    rows = ["| flag | `settings.toml` key | unit | default | applies | what it does |",
            "| --- | --- | --- | --- | --- | --- |"]
    for o in OPTIONS:
        flag = f"`{o.flag}`" if o.flag else "-"
        if o.kind is bool and o.flag:
            flag += f", `--no-{o.flag[2:]}`"
        key = f"`{o.name}`" if o.setting else "-"
        default = (o.default_text() or "-") + (f" ({o.other_defaults})" if o.other_defaults else "")
        applies = ("live" if o.live else "reload model") if o.setting else "-"
        rows.append(f"| {flag} | {key} | {o.unit or '-'} | {default} | {applies} | {o.help} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m moechat.app.options --markdown")
    sys.stdout.write(markdown_table())
