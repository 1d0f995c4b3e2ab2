"""A reply's reasoning and answer (app/reasoning.py), as the chat shows them while they stream and once stored."""
from __future__ import annotations

import pytest

from moechat.app.reasoning import reasoning_title, split_reasoning

pytestmark = pytest.mark.notorch


@pytest.mark.parametrize("text, expected", [
    ("Paris.", ("", "Paris.", False)),  # a model that does not think
    ("<think>\nThe capital.\n</think>\n\nParis.", ("The capital.", "Paris.", False)),  # Qwen3
    ("<think>\n\n</think>\n\nParis.", ("", "Paris.", False)),  # Qwen3 told not to think: an empty block
    ("The capital.\n</think>\n\nParis.", ("The capital.", "Paris.", False)),  # the template opened it (DeepSeek-R1)
    ("<think>\nThe capi", ("The capi", "", True)),  # still thinking
    ("<th", ("", "", False)),  # maybe a tag: nothing shown yet
    ("<b>bold</b> answer", ("", "<b>bold</b> answer", False)),  # a tag that is not one
])
def test_split_reasoning(text, expected):
    assert split_reasoning(text) == expected


def test_streamed_answer_only_grows_once_the_block_has_closed():
    """The chat streams the answer part down an append-only Markdown stream: fed token by token, the answer of each
    prefix extends the previous one while the reply carries its own open tag."""
    reply = "<think>\nWhich city? France's capital.\n</think>\n\nParis is the capital."
    answers = [split_reasoning(reply[:n])[1] for n in range(len(reply) + 1)]
    assert all(b.startswith(a) for a, b in zip(answers, answers[1:], strict=False))
    assert answers[-1] == "Paris is the capital." and split_reasoning(reply[:20])[2] is True


def test_reasoning_title():
    assert reasoning_title("a b c", True) == "thinking… 3 words" and reasoning_title("a b", False) == "thought: 2 words"
