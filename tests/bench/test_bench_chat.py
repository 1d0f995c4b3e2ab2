"""`moechat bench chat`: the same conversations with and without prefix reuse, in one run."""
import json

from moechat.app.cli import main


def test_bench_chat_reuses_each_conversation(capsys):
    assert main(["bench", "chat", "--turns", "2", "--conversations", "2", "--max-new-tokens", "4", "--draft", "none",
                 "--repeats", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    turns = out["turns"]
    assert [(t["conversation"], t["turn"]) for t in turns] == [(1, 1), (2, 1), (1, 2), (2, 2)]
    assert all(t["same_tokens"] for t in turns)
    for t in turns:
        assert t["full"]["prefilled_tokens"] == t["prompt_tokens"]
        if t["turn"] == 1:
            assert t["reuse"]["prefilled_tokens"] >= t["prompt_tokens"] - 4  # at most the template's start is shared
    for later, first in zip(turns[2:], turns[:2]):  # a return after the other conversation: only the new message
        assert later["reuse"]["prefilled_tokens"] < later["prompt_tokens"] - first["prompt_tokens"]
        # the message, the template around it, and the end of the last reply where its text re-tokenizes otherwise
        assert later["message_tokens"] <= later["reuse"]["prefilled_tokens"] <= later["message_tokens"] + 16
    memory = out["memory"]
    assert memory["kept_conversations"] == 2 and 0 < memory["kept_bytes"] <= memory["kept_budget"]
    assert memory["rss_after"] > 0 and memory["rss_loaded"] > 0
