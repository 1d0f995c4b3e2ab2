"""`moechat bench chat`: the same conversations with and without prefix reuse, in one run."""
import json
import os

from moechat.app.cli import main


def shared_prefix_of_first_two_turns() -> int:
    """Tokens the chats of the bench's first two user turns (the first two short held-out prompts) share."""
    from transformers import AutoTokenizer

    from moechat.app.bench.chat import MESSAGE_TOKENS
    from moechat.app.demo import DEMO_MODEL, eval_prompts

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    prompts = [p for p in eval_prompts() if len(tok(p)["input_ids"]) <= MESSAGE_TOKENS][:2]
    a, b = (tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True) for p in prompts)
    a, b = (x["input_ids"] if hasattr(x, "keys") else x for x in (a, b))
    return len(os.path.commonprefix([a, b]))  # works on lists


def test_bench_chat_reuses_each_conversation(capsys):
    assert main(["bench", "chat", "--turns", "2", "--conversations", "2", "--max-new-tokens", "4", "--draft", "none",
                 "--repeats", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    turns = out["turns"]
    assert [(t["conversation"], t["turn"]) for t in turns] == [(1, 1), (2, 1), (1, 2), (2, 2)]
    assert all(t["same_tokens"] for t in turns)
    for t in turns:
        assert t["full"]["prefilled_tokens"] == t["prompt_tokens"]
    first, second = turns[0], turns[1]
    assert first["reuse"]["prefilled_tokens"] == first["prompt_tokens"]  # nothing kept yet
    # another conversation's first turn may reuse only what its chat shares with the first one's
    assert first["prompt_tokens"] - second["reuse"]["prefilled_tokens"] <= shared_prefix_of_first_two_turns()
    for later, first in zip(turns[2:], turns[:2]):  # a return after the other conversation: only the new message
        assert later["reuse"]["prefilled_tokens"] < later["prompt_tokens"] - first["prompt_tokens"]
        # the message, the template around it, and the end of the last reply where its text re-tokenizes otherwise
        assert later["message_tokens"] <= later["reuse"]["prefilled_tokens"] <= later["message_tokens"] + 16
    memory = out["memory"]
    assert memory["kept_conversations"] == 2 and 0 < memory["kept_bytes"] <= memory["kept_budget"]
    assert memory["rss_after"] > 0 and memory["rss_loaded"] > 0
