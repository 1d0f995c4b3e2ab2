"""The README and docs/ as a user follows them: links, anchors, the design map's paths, and what they quote of the code."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from moechat.engine import native
from moechat.engine.errors import MoechatError

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "assets" / "demo" / "README.md"]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    text = re.sub(r"^```.*?^```", "", doc.read_text(encoding="utf-8"), flags=re.M | re.S)  # no headings in code
    for heading in re.findall(r"^#{1,6}\s+(.*)$", text, flags=re.M):
        slug = _slug(heading)
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if not seen[slug] else f"{slug}-{seen[slug]}"


@pytest.mark.notorch
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_anchor_resolves(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path) if path else doc
        if not dest.exists() or anchor and dest.suffix == ".md" and anchor not in set(_anchors(dest)):
            broken.append(target)
    assert not broken


@pytest.mark.notorch
def test_the_design_maps_paths_exist():
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    table = text[text.index("## Map"):text.index("## As built")]
    files = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if ".git" not in p.parts}
    missing = []
    for token in set(re.findall(r"`([\w./-]+\.(?:py|cpp|h|md|jsonl|svg)|[\w./-]+/)`", table)):
        if not any(f == token.rstrip("/") or f.endswith("/" + token.rstrip("/")) for f in files):
            missing.append(token)
    assert not missing


def _native_section() -> str:
    text = README.read_text(encoding="utf-8")
    return text[text.index("## Native kernels"):text.index("## How it works")]


@pytest.mark.notorch
def test_the_readme_names_every_native_source():
    sources = [p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*.cpp") if p.parent.name != "probes"]
    assert [s for s in sources if f"`{s}`" not in _native_section()] == []


@pytest.mark.notorch
def test_the_readme_lists_every_forced_cpu_path():
    listed = re.search(r"`MOECHAT_CPU_ISA=([\w|]+)`", _native_section()).group(1).split("|")
    assert sorted(listed) == sorted(name for name in native.CPU_ISA if name != "auto")


def _troubleshooting_message(starts: str) -> str:
    text = README.read_text(encoding="utf-8")
    row = next(line for line in text[text.index("## Troubleshooting"):].splitlines() if starts in line)
    return row.split("`")[1].split("...")[0].strip()


def test_the_troubleshooting_table_quotes_the_prequantized_refusals():
    from moechat.engine.quant.compressed import read_compressed_config
    from moechat.engine.quant.gptq import GptqSpec

    with pytest.raises(MoechatError) as gptq:
        GptqSpec(bits=8)
    assert str(gptq.value).startswith(_troubleshooting_message("GPTQ"))
    fp8 = {"format": "float-quantized", "config_groups": {"group_0": {"targets": ["Linear"],
           "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}}
    with pytest.raises(MoechatError) as compressed:
        read_compressed_config(fp8)
    assert str(compressed.value).startswith(_troubleshooting_message("compressed-tensors"))
    from moechat.engine.quant.prequantized import check_weights_match

    for spec, keys, starts in ((GptqSpec(), ["x.weight"], "config.json says"), (None, ["x.qweight"], "the checkpoint's weights")):
        with pytest.raises(MoechatError) as mismatch:
            check_weights_match(spec, keys)
        assert str(mismatch.value).split("(")[0] == _troubleshooting_message(starts).split("(")[0]


@pytest.mark.notorch
def test_the_readme_names_every_event_generate_yields():
    import ast

    tree = ast.parse((ROOT / "engine" / "generate.py").read_text(encoding="utf-8"))
    events = {"TokenDelta", "PrefillProgress", "StepStats", "Finished", "Error"}
    yielded = {n.value.func.id for n in ast.walk(tree) if isinstance(n, ast.Yield) and isinstance(n.value, ast.Call)
               and isinstance(n.value.func, ast.Name) and n.value.func.id in events}
    section = README.read_text(encoding="utf-8").split("- `generate.py`: ")[1].split("\n- ")[0]
    assert yielded and [e for e in sorted(yielded) if f"`{e}`" not in section] == []


@pytest.mark.notorch
def test_the_readme_names_every_command_that_takes_the_engine_flags():
    from moechat.app.cli import build_parser

    def commands(parser, words=()):
        for name, sub in (parser._subparsers._group_actions[0].choices.items() if parser._subparsers else ()):
            yield from commands(sub, (*words, name))
        if words and not parser._subparsers:
            yield " ".join(words), parser

    takers = {name for name, parser in commands(build_parser()) if "--conversation-cache-gib" in parser._option_string_actions}
    text = README.read_text(encoding="utf-8")
    sentence = text[text.index("Engine flags apply to"):].split(";")[0]
    assert set(re.findall(r"`([a-z -]+)`", sentence)) == takers
