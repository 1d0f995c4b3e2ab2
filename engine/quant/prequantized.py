"""Checkpoints that arrive quantized, behind one small interface the loader, the expert store and the estimate use:
GPTQ (gptq.py) and compressed-tensors pack-quantized (compressed.py). A spec says which moechat format its linears
map onto (`fmt`), which key suffix marks a quantized linear (`marker`), which tensors make one (`suffixes()`, and the
`optional` ones read where present), and turns a linear's tensors into a QuantMatrix (`to_matrix`, the experts) or a
dense weight (`dequantize`, the rest)."""
from __future__ import annotations

from collections.abc import Callable

from ..errors import CheckpointError
from .compressed import CompressedSpec, read_compressed_config
from .formats import PREQUANTIZED_ADVICE as ADVICE
from .gptq import GptqSpec, read_gptq_config

PrequantSpec = GptqSpec | CompressedSpec


def read_quantization_config(raw: dict) -> PrequantSpec | None:
    """The spec of config.json (as a dict); None when it has no quantization_config. Any other quantization method,
    or a variant of these two that cannot be read, raises CheckpointError."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError("config.json: quantization_config is not an object: re-download the model")
    method = str(qc.get("quant_method", "unknown")).lower()
    if method == "gptq":
        return read_gptq_config(qc)
    if method == "compressed-tensors":
        return read_compressed_config(qc)
    raise CheckpointError(f"this checkpoint is quantized with {method}, which moechat cannot load: {ADVICE}")


def expert_format(spec: PrequantSpec | None, requested: str) -> str:
    """The format a checkpoint's routed experts run in: a pre-quantized one's own whatever was asked (it runs as it
    is), else the request."""
    return spec.fmt if spec is not None else requested


def format_notice(fmt: str | None, requested: str, asked: str = "quant") -> str:
    """A line for the user when another format (`asked` names the flag or setting) was asked of a checkpoint that arrives
    quantized in `fmt` (it runs in its own); "" for a plain checkpoint (fmt None) or nothing else asked."""
    if fmt is None or requested in ("none", fmt):
        return ""
    return f"{asked} {requested} does not apply: the checkpoint is quantized in {fmt} and runs as it is"


MARKERS = {spec.marker: spec.label for spec in (GptqSpec, CompressedSpec)}  # a quantized linear's key suffix -> method


def check_weights_match(spec: PrequantSpec | None, keys) -> None:
    """CheckpointError where config.json and the weights disagree: a quantization_config over unquantized weights, or
    quantized weights under a config.json without one (an edited or mixed-up config.json)."""
    keys = list(keys)
    if spec is not None and not any(key.endswith(f".{spec.marker}") for key in keys):
        raise CheckpointError(f"config.json says the checkpoint is {spec.label} {spec.fmt} (quantization_config), but no "
                              f"weight in its files is (none ends in .{spec.marker}): remove quantization_config from "
                              "config.json if the weights are unquantized, or re-download the model")
    found = next((key for key in keys if key.rsplit(".", 1)[-1] in MARKERS), None) if spec is None else None
    if found is not None:
        raise CheckpointError(f"the checkpoint's weights are {MARKERS[found.rsplit('.', 1)[-1]]}-quantized ({found}), but "
                              "config.json has no quantization_config: restore config.json from the model's repository "
                              "(re-download the model)")


def quantized_prefixes(spec: PrequantSpec, keys) -> set[str]:
    """The quantized linears' prefixes in a checkpoint's key set (each key ending in .<marker>)."""
    end = f".{spec.marker}"
    return {key[:-len(end)] for key in keys if key.endswith(end)}


def own_linears(spec: PrequantSpec, keys, module_key: Callable[[str], str]) -> dict[str, str]:
    """{module name: format} of the linears a pre-quantized checkpoint holds quantized (`keys`: its tensors'; module_key:
    the family's), which a CPU load runs as the checkpoint's own codes (loader._load_dense_weights' `given`), not in
    dense.layer_format's."""
    return {module_key(f"{prefix}.weight").removesuffix(".weight"): spec.fmt for prefix in quantized_prefixes(spec, keys)}


def linear_keys(spec: PrequantSpec, prefix: str, present) -> list[str]:
    """The checkpoint keys of one quantized linear: the required ones (CheckpointError where `present` lacks one), and the
    optional ones `present` holds."""
    required = [f"{prefix}.{s}" for s in spec.suffixes()]
    missing = [k for k in required if k not in present]
    if missing:
        raise CheckpointError(f"quantized weight {missing[0]} is not in the checkpoint: the files do not match config.json; "
                              "re-download the model")
    return required + [k for k in (f"{prefix}.{s}" for s in spec.optional) if k in present]
