"""What a reply is asked for: torch-free, so a remote backend's chat (app/remote.py) runs without PyTorch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Request:
    """Chat messages (rendered with the tokenizer's chat template), plain text, or token ids."""

    messages: list[dict] | None = None
    prompt: str | None = None
    token_ids: list[int] | None = None
    thinking: bool | None = None  # `enable_thinking` for templates that read it (Qwen3); None: the template's default
    tools: list[dict] | None = None  # function tools (OpenAI's shape) for the chat template to offer; None: no tools
