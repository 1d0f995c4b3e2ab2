"""Slow tier: every routed expert's weights on the host, in RAM (pinned for CUDA) or mmap'd from disk,
in the compute dtype or quantized (int8/int4, engine/quant/: quantized once into a cache file)."""
from __future__ import annotations

import torch

from .. import huge_pages, pinned
from ..errors import CheckpointError
from ..events import LoadProgress
from ..model.checkpoint import Checkpoint
from ..model.families import Family
from ..model.memory_estimate import expert_bytes_for
from ..quant import formats
from ..quant.expert_file import QuantizedExperts, open_quantized
from ..quant.prequantized import PrequantSpec, check_weights_match, linear_keys
from . import cpu_ffn

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names of the weight types the expert store reads

QUANT_CHUNK = 8  # experts quantized at a time: bounds the fp32 working set while building the cache


def storage_dtype(ckpt: Checkpoint, family: Family, layers: list[int], dtype: torch.dtype, quant: str,
                  device: torch.device) -> torch.dtype:
    """The dtype the routed experts are kept in: the compute dtype, but a bf16 checkpoint's experts computed in fp32 on a
    CPU device by the native kernel stay bf16. Exact (bf16 widens to fp32 without rounding, and the kernel widens in
    registers: the same products), half the RAM and half the bytes each token reads."""
    if not layers or not cpu_ffn.keeps_bf16(device.type, dtype, quant):
        return dtype
    first = family.expert_key(layers[0], 0, 0)
    keys = [first] if first in ckpt else family.fused_keys(layers[0])
    return torch.bfloat16 if all(k in ckpt and ckpt.dtype_name(k) == "BF16" for k in keys) else dtype


class ExpertStore:
    """Routed experts of all sparse layers. `li` is the index into `layers` (sparse layers only).

    One expert is gate_up [2I, H] (gate rows then up rows, the layout `transformers` computes with)
    and down [H, I]: tensors in `dtype` (the compute dtype, or bf16 for fp32 compute: `storage_dtype`), or QuantMatrix
    when `quant` is int8/int4.
    """

    def __init__(self, ckpt: Checkpoint, family: Family, hf_config, layers: list[int], dtype: torch.dtype,
                 pin: bool, ram_budget_bytes: int | None, quant: str = "none", prequant: PrequantSpec | None = None,
                 progress: LoadProgress | None = None):
        assert prequant is None or quant == prequant.fmt, "a pre-quantized checkpoint's experts run in its own format"
        self.ckpt, self.family, self.layers, self.dtype, self.quant = ckpt, family, layers, dtype, quant
        self.prequant = prequant
        self.num_experts = family.num_experts(hf_config)
        self.hidden = int(hf_config.hidden_size)
        self.inter = family.expert_dim(hf_config)
        H, I = self.hidden, self.inter
        self.expert_bytes = expert_bytes_for(quant, str(dtype).removeprefix("torch."), H, I)
        self.total_bytes = self.expert_bytes * self.num_experts * len(layers)
        self.fused = prequant is None and bool(layers) and family.expert_key(layers[0], 0, 0) not in ckpt
        self.notices: list[str] = []  # one line each, for the user (a rebuilt quantized cache)
        if quant != "none" and (H % formats.ROWS or I % formats.ROWS):
            instead = "run it with --quant none" if prequant is None else "run its unquantized checkpoint"  # none: as is
            raise CheckpointError(f"{quant} experts need a hidden size and expert width in multiples of {formats.ROWS} "
                                  f"(this model: {H} and {I}): {instead}")
        self._check_present()
        self.mmap = ram_budget_bytes is not None and ram_budget_bytes < self.total_bytes
        # Page-locked RAM tier (CUDA): fast-tier copies become asynchronous DMA. Pinned once, at
        # allocation, inside the same RAM budget (the mmap tier is never pinned); optional: where
        # the system refuses to lock more pages, the rest stays pageable (copies then stage).
        self.pinned = pin and not self.mmap
        self.gate_up: list = []  # per sparse layer [E, 2I, H] (RAM tier; quantized: also the mapped file's views)
        self.down: list = []  # per sparse layer [E, H, I]
        self.qfile: QuantizedExperts | None = None
        self._pointers: dict[int, torch.Tensor | None] = {}  # disk tier: per layer, each expert's matrices' addresses
        self._spans: dict[int, tuple] = {}  # disk tier: per layer, the mapped files and each expert's byte ranges in them
        if quant != "none":
            self._open_quantized(progress)
        elif not self.mmap:
            for li in range(len(layers)):  # a large model's minutes: the bar moves, and a cancelling callback stops it
                self._load_layer(li)
                if progress is not None:
                    progress("reading experts into RAM", li + 1, len(layers))

    def _open_quantized(self, progress: LoadProgress | None) -> None:
        """Experts from the quantized cache file (built on first use), used in place as mapped views: the
        page cache is their RAM, so no second copy is made. For CUDA they are copied once into pinned
        memory (asynchronous copies need it) and the file's mapping is dropped."""
        source, label = self._quantize_layer, "quantizing experts"
        if self.prequant is not None:
            source, label = self._prequant_layer, "repacking pre-quantized experts"
        self.qfile = open_quantized(self.ckpt.dir, self.quant, len(self.layers), self.num_experts, self.hidden, self.inter,
                                    source, self.notices, label, progress)
        for li in range(len(self.layers)):
            gate_up, down = self.qfile.layer(li)
            if self.pinned:
                gate_up = self._host_matrix(2 * self.inter, self.hidden).copy_(gate_up)
                down = self._host_matrix(self.hidden, self.inter).copy_(down)
                if progress is not None:
                    progress("copying experts into pinned RAM", li + 1, len(self.layers))
            self.gate_up.append(gate_up)
            self.down.append(down)
        if self.pinned:
            self.qfile.release()

    def _prequant_layer(self, li: int):
        """(expert, gate_up, down) of a pre-quantized checkpoint, repacked into its format's layout one expert at a time."""
        layer = self.layers[li]
        for e in range(self.num_experts):
            mats = []
            for which in range(3):
                prefix = self.family.expert_key(layer, e, which).removesuffix(".weight")
                mat = self.prequant.to_matrix(self.ckpt.views(linear_keys(self.prequant, prefix, self.ckpt)), prefix)
                if not all(bool(torch.isfinite(t.float()).all()) for t in (mat.scale, mat.minimum) if t is not None):
                    raise CheckpointError(f"{prefix} has NaN or infinite scales: the checkpoint is corrupt; re-download the "
                                          "model")  # its codes would run as numbers: other tokens, no error
                mats.append(mat)
            gate, up, down = mats
            yield e, formats.QuantMatrix.cat([gate, up])[None], down[None]

    def _host_matrix(self, rows: int, k: int) -> formats.QuantMatrix:
        return self._host(lambda pin: formats.empty_matrix(self.quant, (self.num_experts,), rows, k, pin=pin))

    def _quantize_layer(self, li: int):
        """(first expert, gate_up, down) quantized chunk by chunk, read from the checkpoint's mapped file: each matrix
        straight from its mapped view into its rows of the chunk (gate and up each into their half of gate_up)."""
        I, H = self.inter, self.hidden
        for start in range(0, self.num_experts, QUANT_CHUNK):
            n = min(QUANT_CHUNK, self.num_experts - start)
            gate_up, down = formats.empty_matrix(self.quant, (n,), 2 * I, H), formats.empty_matrix(self.quant, (n,), H, I)
            for i in range(n):
                parts, dn = self._checkpoint_parts(li, start + i)
                row = 0
                try:
                    for w in parts:
                        cpu_ffn.quantize(w, self.quant, out=gate_up[i].rows_slice(row, row + w.shape[0]))
                        row += w.shape[0]
                    cpu_ffn.quantize(dn, self.quant, out=down[i])
                except formats.NonFiniteWeights:  # the unquantized path says so at the first reply: this one would not
                    raise CheckpointError(f"expert {start + i} of layer {self.layers[li]} holds NaN or infinite values in "
                                          f"{self.ckpt.dir}: the checkpoint is corrupt; re-download the model") from None
            yield start, gate_up, down

    @property
    def tier(self) -> str:
        return "mmap" if self.mmap else "ram"

    def checkpoint_keys(self, li: int) -> list[str]:
        layer = self.layers[li]
        if self.fused:
            return list(self.family.fused_keys(layer))
        keys = [self.family.expert_key(layer, e, w) for e in range(self.num_experts) for w in range(3)]
        if self.prequant is not None:  # each linear's quantized tensors (GPTQ: qweight, qzeros, scales, g_idx where present)
            keys = [k for key in keys for k in linear_keys(self.prequant, key.removesuffix(".weight"), self.ckpt)]
        return keys

    def _check_present(self) -> None:
        """Every expert tensor is in the checkpoint with the shape config.json gives (from the headers: nothing read)."""
        check_weights_match(self.prequant, self.ckpt.keys())  # first: a config.json that disagrees names no one tensor
        for li in range(len(self.layers)):
            for key in self.checkpoint_keys(li):
                if key not in self.ckpt:
                    raise CheckpointError(
                        f"expert weight {key} is not in the checkpoint: the files do not match config.json; re-download the model"
                    )
                if self.prequant is None and self.ckpt.dtype_name(key) not in FLOAT_DTYPES:
                    raise CheckpointError(f"expert weight {key} is stored as {self.ckpt.dtype_name(key)}, where moechat reads "
                                          "floating point (or GPTQ): the checkpoint is corrupt or in another format; "
                                          "re-download the model")
                want = self._expected_shape(key)
                if want is not None and tuple(self.ckpt.shape(key)) != want:
                    raise CheckpointError(f"expert weight {key} has shape {list(self.ckpt.shape(key))} where config.json "
                                          f"gives {list(want)}: the files do not match config.json; re-download the model")

    def _expected_shape(self, key: str) -> tuple[int, ...] | None:
        """An expert tensor as the store reads it: a float checkpoint's, a pre-quantized one's packed codes (None for its
        scales and zero points, which the repacking checks against the codes)."""
        E, H, I = self.num_experts, self.hidden, self.inter
        if self.prequant is not None:
            marker = f".{self.prequant.marker}"
            if not key.endswith(marker):
                return None
            return self.prequant.marker_shape(*((H, I) if self._parse(key[:-len(marker)] + ".weight")[1] == 2 else (I, H)))
        if self.fused:
            return (E, 2 * I, H) if key.endswith("gate_up_proj") else (E, H, I)
        return (H, I) if self._parse(key)[1] == 2 else (I, H)

    def _host_empty(self, *shape: int) -> torch.Tensor:
        return self._host(lambda pin: pinned.empty(shape, self.dtype) if pin else huge_pages.empty(*shape, dtype=self.dtype))

    def _host(self, alloc):
        """alloc(pin) in page-locked memory while the system grants it, pageable from the first refusal on
        (limits, fragmentation)."""
        if self.pinned:
            try:
                return alloc(True)
            except RuntimeError:
                self.pinned = False
        return alloc(False)

    def _load_layer(self, li: int) -> None:
        E, H, I = self.num_experts, self.hidden, self.inter
        gate_up = self._host_empty(E, 2 * I, H)
        down = self._host_empty(E, H, I)
        for key, t in self.ckpt.get_many(self.checkpoint_keys(li)):
            if self.fused:
                (gate_up if key.endswith("gate_up_proj") else down).copy_(t)
                continue
            e, which = self._parse(key)
            if which == 2:
                down[e].copy_(t)
            else:
                gate_up[e, which * I:(which + 1) * I].copy_(t)
        self.gate_up.append(gate_up)
        self.down.append(down)

    def _parse(self, key: str) -> tuple[int, int]:
        parts = key.split(".")  # model.layers.L.<block>.experts.E.<name>.weight
        return int(parts[-3]), self.family.weight_names.index(parts[-2])

    def weights(self, li: int, e: int):
        """(gate_up [2I, H], down [H, I]) of one expert, on the host in the compute dtype (or quantized)."""
        if not self.mmap or self.quant != "none":
            return self.gate_up[li][e], self.down[li][e]
        gate_up, down = self._checkpoint_weights(li, e)
        return gate_up.to(self.dtype), down.to(self.dtype)

    def _checkpoint_weights(self, li: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert read from the mapped checkpoint, in its stored dtype."""
        parts, down = self._checkpoint_parts(li, e)
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), down  # the one copy the disk tier pays per use

    def _checkpoint_parts(self, li: int, e: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One expert's gate_up as the mapped views whose rows stack into it ([gate_up] fused, else [gate, up]), and
        down: no copy."""
        if self.fused:
            gu_key, d_key = self.checkpoint_keys(li)
            return [self.ckpt.view(gu_key)[e]], self.ckpt.view(d_key)[e]
        gate, up, down = (self.ckpt.view(self.family.expert_key(self.layers[li], e, w)) for w in range(3))
        return [gate, up], down

    def layer_views(self, li: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """gate_up [E, 2I, H] and down [E, H, I] of one layer without a copy, in the compute dtype;
        None on the disk tier unless the checkpoint stores them stacked in that dtype (quantized: always)."""
        if not self.mmap or self.quant != "none":
            return self.gate_up[li], self.down[li]
        if self.fused:
            gu_key, d_key = self.checkpoint_keys(li)
            gate_up, down = self.ckpt.view(gu_key), self.ckpt.view(d_key)
            if gate_up.dtype == down.dtype == self.dtype and gate_up.is_contiguous() and down.is_contiguous():
                return gate_up, down
        return None

    def expert_pointers(self, li: int) -> torch.Tensor | None:
        """The disk tier's experts of one layer for the native kernel without a copy: [E, 3] int64, the addresses of each
        expert's gate, up and down in the mapped checkpoint (cpu_ffn.moe_ffn_native_ptrs); None where a matrix is not
        stored contiguous in the store's dtype (then converted per use) or the tier is another."""
        if not self.mmap or self.quant != "none":
            return None
        if li not in self._pointers:
            rows = [[*parts, down] for parts, down in (self._checkpoint_parts(li, e) for e in range(self.num_experts))]
            usable = all(len(r) == 3 and all(t.dtype == self.dtype and t.is_contiguous() for t in r) for r in rows)
            self._pointers[li] = torch.tensor([[t.data_ptr() for t in r] for r in rows]) if usable else None
        return self._pointers[li]  # the mappings live as long as the checkpoint: the addresses stay valid

    def will_need(self, li: int, experts: list[int]) -> None:
        """Disk tier: ask the OS to read these experts' bytes of sparse layer li not in the page cache, ahead of the
        kernels' page faults (each reading the device's read-around window, mostly other experts' bytes). One mincore
        per expert where its largest range is resident (read with the others each time it is routed); where it is
        not, each range is checked and asked for. Elsewhere nothing."""
        if not self.mmap:
            return
        if li not in self._spans:
            self._spans[li] = self._layer_spans(li)
        ckpt, spans = self._spans[li]
        for e in experts:
            largest, *others = spans[e]
            if ckpt.will_need(*largest):
                for span in others:
                    ckpt.will_need(*span)

    def _layer_spans(self, li: int) -> tuple[Checkpoint, list[list[tuple]]]:
        """The mapped files holding sparse layer li's experts and each expert's byte ranges in them, the largest first:
        a quantized expert's six (int8: four) ranges of its cache file and a fused checkpoint's two, each tensor stacked
        over the experts; a per-expert checkpoint's tensors, adjacent ones joined."""
        if self.quant != "none" or self.fused:
            ckpt, keys = self.qfile.stacked_keys(li) if self.quant != "none" else (self.ckpt, self.checkpoint_keys(li))
            self.layer_views(li)  # maps the files
            ranges = [(path, start, (end - start) // self.num_experts) for path, start, end in map(ckpt.byte_range, keys)]
            spans = [[(path, start + e * size, start + (e + 1) * size) for path, start, size in ranges]
                     for e in range(self.num_experts)]
        else:
            ckpt, spans = self.ckpt, [self._expert_spans(li, e) for e in range(self.num_experts)]
            self.expert_pointers(li)  # maps the files
        return ckpt, [sorted(s, key=lambda span: span[1] - span[2]) for s in spans]  # the largest first

    def _expert_spans(self, li: int, e: int) -> list[tuple]:
        """One expert's byte ranges in the checkpoint's files, adjacent ones joined."""
        spans: list[list] = []
        for path, start, end in sorted(self.ckpt.byte_range(self.family.expert_key(self.layers[li], e, w)) for w in range(3)):
            if spans and spans[-1][0] == path and spans[-1][2] == start:
                spans[-1][2] = end
            else:
                spans.append([path, start, end])
        return [tuple(s) for s in spans]

    def layer_tensors(self, li: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts of one layer: gate_up [E, 2I, H], down [E, H, I] (a copy on the disk tier)."""
        if not self.mmap or self.quant != "none":
            return self.gate_up[li], self.down[li]
        pairs = [self.weights(li, e) for e in range(self.num_experts)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
