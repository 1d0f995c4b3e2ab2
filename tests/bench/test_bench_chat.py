"""`moechat bench chat`: the same conversation with and without prefix reuse, in one run."""
import json

from moechat.app.cli import main


def test_bench_chat_reuses_the_conversation(capsys):
    assert main(["bench", "chat", "--turns", "3", "--max-new-tokens", "4", "--draft", "none", "--json"]) == 0
    turns = json.loads(capsys.readouterr().out)["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and all(t["same_tokens"] for t in turns)
    first, later = turns[0], turns[1:]
    assert first["reuse"]["prefilled_tokens"] == first["full"]["prefilled_tokens"] == first["prompt_tokens"]
    for t in later:  # only the new message (and the template around it) is prefilled
        assert t["full"]["prefilled_tokens"] == t["prompt_tokens"]
        assert t["reuse"]["prefilled_tokens"] < t["prompt_tokens"] - turns[0]["prompt_tokens"]
