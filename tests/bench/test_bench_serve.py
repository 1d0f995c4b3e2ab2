"""`moechat bench serve`: concurrent clients through the in-process server all complete, served in arrival order."""
import json

from moechat.app.cli import main


def test_bench_serve_completes_every_request_in_arrival_order(capsys, checkpoint):
    model = checkpoint("qwen3_moe", max_position_embeddings=4096)
    assert main(["bench", "serve", "--model", str(model), "--clients", "3", "--requests", "2", "--max-tokens", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completed"] == 6 and out["failed"] == [] and out["served_in_arrival_order"] is True
    per = out["seconds_per_request"]
    assert 0 < per["median"] <= per["max"] and per["mean"] > 0 and out["requests_per_s"] > 0
    assert out["rss_before"] > 0 and out["rss_after"] > 0
