"""One file per Hugging Face `model_type`; `get_family` picks the record for a config."""
from __future__ import annotations

from ...errors import CheckpointError
from . import deepseek_v2, mixtral, olmoe, qwen2_moe, qwen3_moe
from .base import Family

FAMILIES: dict[str, Family] = {
    m.FAMILY.model_type: m.FAMILY for m in (qwen3_moe, qwen2_moe, olmoe, mixtral, deepseek_v2)
}


def get_family(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise CheckpointError(
            f"unsupported architecture model_type={model_type!r}: moechat runs {', '.join(sorted(FAMILIES))}; "
            "pick a checkpoint of one of these families"
        ) from None


__all__ = ["FAMILIES", "Family", "get_family"]
