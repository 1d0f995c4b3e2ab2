"""Routing traces recorded by `moechat generate --trace FILE`.

Format: JSON Lines, one object per (forward pass, MoE layer) of the target model, in order:
  {"step": 0, "phase": "prefill", "layer": 3, "positions": [0, 1, 2],
   "experts": [[5, 1], [2, 7], [5, 0]], "weights": [[0.61, 0.22], ...]}
- step: 0 for the prefill, then one per decoding step (draft γ, verify γ+1);
- phase: "prefill" or "verify" (draft passes are not recorded: they use substituted experts);
- layer: the decoder layer index in the checkpoint (dense layers never appear);
- positions: absolute token positions of the rows (a verification includes drafts that were
  later rejected; StepStats.accepted says how many were kept);
- experts / weights: per row the router's top-k expert ids and routing weights, in router order.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


class TraceRecorder:
    def __init__(self, layers: list[int]):
        self.layers = layers  # sparse-layer index -> decoder layer index
        self.records: list[dict] = []
        self._step, self._phase, self._start = 0, "prefill", 0
        self._forward_start = 0  # the records of the forward in progress begin here

    def begin_forward(self, step: int, phase: str, start_pos: int) -> None:
        self._step, self._phase, self._start = step, phase, start_pos
        self._forward_start = len(self.records)

    def drop_unfinished(self) -> None:
        """A forward stopped before its last MoE layer (Ctrl-C) goes: its positions lack layers, and a replay refuses that."""
        if len(self.records) - self._forward_start < len(self.layers):
            del self.records[self._forward_start:]

    def __call__(self, li: int, idx: torch.Tensor, weights: torch.Tensor) -> None:
        n = idx.shape[0]
        self.records.append({
            "step": self._step, "phase": self._phase, "layer": self.layers[li],
            "positions": list(range(self._start, self._start + n)),
            "experts": idx.tolist(), "weights": [[round(w, 6) for w in row] for row in weights.float().tolist()],
        })

    def write(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for rec in self.records:
                f.write(json.dumps(rec) + "\n")


def load_trace(path: str | Path) -> list[dict]:
    """Every record of a `--trace` file (docs/trace-format.md), for users reading their traces."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def expert_counts(records: list[dict], num_experts: int) -> dict[int, list[int]]:
    """Activations per expert for every MoE layer of a trace: {layer: [count of expert 0, ...]}."""
    counts: dict[int, list[int]] = {}
    for rec in records:
        row = counts.setdefault(rec["layer"], [0] * num_experts)
        for experts in rec["experts"]:
            for e in experts:
                row[e] += 1
    return counts


def routing_skew(counts: list[int]) -> float:
    """Share of a layer's activations that land on its most used quarter of experts (uniform: 0.25)."""
    top = max(1, round(len(counts) / 4))
    total = sum(counts)
    return sum(sorted(counts, reverse=True)[:top]) / total if total else 0.0


def routing_reuse(records: list[dict]) -> float:
    """Mean share of a token's experts that the previous token used in the same layer (uniform: k/E).

    Only verified positions in order count; a record starting at position 0 begins a new request.
    """
    prev: dict[int, set[int]] = {}
    shared = total = 0
    for rec in records:
        if rec["positions"][0] == 0:
            prev.pop(rec["layer"], None)
        for experts in rec["experts"]:
            cur = set(experts)
            if rec["layer"] in prev:
                shared += len(cur & prev[rec["layer"]])
                total += len(cur)
            prev[rec["layer"]] = cur
    return shared / total if total else 0.0


class Routing:
    """One request's routing in commit order: experts[t][j] = top-k expert ids of token t in MoE layer j."""

    def __init__(self, name: str, layer_ids: list[int], experts: torch.Tensor, num_experts: int):
        self.name, self.layer_ids, self.num_experts = name, layer_ids, num_experts
        self.experts = experts  # [T, L, k] int64

    @property
    def tokens(self) -> int:
        return self.experts.shape[0]


def load_routing(path: str | Path, num_experts: int | None = None) -> Routing:
    """A routing trace: the shared DeepSeek CSV(.gz) format or moechat's own JSON Lines (`--trace`).
    A damaged or cut-short file raises ValueError in one line (callers print it)."""
    import gzip
    import zlib

    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            first = f.readline()
            if first.lstrip().startswith("{"):
                layer_ids, experts = _jsonl_rows(path, first, f)
            elif first.startswith("Layer ID"):
                layer_ids, experts = _csv_rows(path, f)
            else:
                raise ValueError(f"{path} is neither a moechat trace (JSON Lines) nor a routing CSV with a 'Layer ID' header")
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:  # a download or copy cut short: not a bug to report
        raise ValueError(f"{path} is cut short or corrupt ({err}): copy or record the trace again") from None
    x = _routing_tensor(path, experts)  # [T, L, k]
    n = num_experts or int(x.max()) + 1
    if int(x.min()) < 0:  # ids past the model's experts are the replay's to refuse, with the count
        raise ValueError(f"{path}: expert id {int(x.min())} is negative: the trace is damaged")
    return Routing(path.name.split(".")[0], layer_ids, x, n)


def _jsonl_rows(path: Path, first: str, f) -> tuple[list[int], list]:
    """(MoE layer ids, experts [T][L][k]) of a moechat --trace file whose first line is `first`."""
    records = []
    for line, text in enumerate([first, *f], start=1):
        try:
            records += [json.loads(text)] if text.strip() else []
        except ValueError as err:  # json.loads numbers lines within its one line: say which line of the file
            raise ValueError(f"{path}: line {line} is not a JSON record ({err}): the trace is damaged or cut short") from None
    try:
        by_pos = _committed_rows(records)
    except (KeyError, TypeError, AttributeError) as err:  # a record that is not the format's object
        raise ValueError(f"{path}: a record lacks or mangles {err}: the trace is damaged (docs/trace-format.md)") from None
    layer_ids = sorted({layer for rows in by_pos.values() for layer in rows})
    for p in sorted(by_pos):
        missing = [layer for layer in layer_ids if layer not in by_pos[p]]
        if missing:
            raise ValueError(f"{path}: position {p} has no routing for layer {missing[0]}: the trace is damaged or cut short")
    return layer_ids, [[by_pos[p][layer] for layer in layer_ids] for p in sorted(by_pos)]


def _csv_rows(path: Path, f) -> tuple[list[int], list]:
    """(MoE layer ids, experts [T][L][k]) of the shared DeepSeek CSV layout, after its header."""
    import csv

    per_layer: dict[int, list[list[int]]] = {}
    for line, row in enumerate(csv.reader(f), start=2):
        if len(row) != 4:
            raise ValueError(f"{path}: line {line} has {len(row)} fields, not the 4 of "
                             "'Layer ID,Batch Number,Token,Activated Expert IDs': the trace is damaged")
        try:
            per_layer.setdefault(int(row[0]), []).append(json.loads(row[3]))
        except ValueError as err:
            raise ValueError(f"{path}: line {line} is not a routing row ({err}): the trace is damaged or cut short") from None
    layer_ids = sorted(per_layer)
    lengths = {len(v) for v in per_layer.values()}
    if len(lengths) > 1:
        raise ValueError(f"{path}: layers have different token counts {sorted(lengths)}: the trace is damaged or cut short")
    return layer_ids, [list(rows) for rows in zip(*(per_layer[layer] for layer in layer_ids))]


def _routing_tensor(path: Path, experts: list) -> torch.Tensor:
    """experts [T][L][k] as an int64 tensor; every token's k ids whole numbers, the same k throughout."""
    if not experts:
        raise ValueError(f"{path} holds no routing rows: record the trace again")
    tops = {len(ids) if isinstance(ids, list) else -1 for token in experts for ids in token}
    if len(tops) != 1 or min(tops) < 1:
        raise ValueError(f"{path}: tokens route to {sorted(t for t in tops if t >= 0) or 'no'} experts each, where a "
                         "trace gives every token the same top-k: the trace is damaged")
    if any(type(e) is not int for token in experts for ids in token for e in ids):
        raise ValueError(f"{path}: an expert id is not a whole number: the trace is damaged")
    try:
        return torch.tensor(experts, dtype=torch.long)
    except (RuntimeError, ValueError, OverflowError) as err:  # an id past int64
        raise ValueError(f"{path}: an expert id is out of range ({err}): the trace is damaged") from None


def _committed_rows(records: list[dict]) -> dict[int, dict[int, list[int]]]:
    """position -> layer -> experts, keeping the last verification of each position (drafts rejected
    earlier are verified again at the same position later and overwrite)."""
    by_pos: dict[int, dict[int, list[int]]] = {}
    prefilled, decoding = set(), False  # a prefill writes one record per layer, all starting at position 0
    for rec in records:
        if rec.get("phase", "prefill") == "prefill":
            if decoding or rec["layer"] in prefilled:
                break  # a second request starts: one trace file, one request
            prefilled.add(rec["layer"])
        else:
            decoding = True
        for pos, experts in zip(rec["positions"], rec["experts"]):
            by_pos.setdefault(pos, {})[rec["layer"]] = experts
    return by_pos
