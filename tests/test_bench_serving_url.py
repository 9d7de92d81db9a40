"""jaxspec-bench's serve mode against a URL: run against `jaxspec serve` on a tiny model over
loopback, its per-request token counts are the offline greedy outputs' and its concurrency limit
holds; the statistics over hand-made timelines; failures counted, not hidden; options checked."""
import json
import math
import socket

import numpy as np
import pytest

from serve_helpers import served, tiny_chat_dir, tiny_llm  # noqa: F401
from jaxspec import SamplingParams, bench_cli
from jaxspec.benchmark import prompts as P
from jaxspec.benchmark import url_serving
from jaxspec.serve.app import build_app


def test_url_mode_against_jaxspec_serve(tiny_llm, tmp_path):
    chats = [p["chat"] for p in P.load_prompts("mt-bench", 5)]
    sp = SamplingParams(max_tokens=6)
    want_chat = [len(o.token_ids) for o in tiny_llm.chat(chats, sp)]
    texts = [c[-1]["content"] for c in chats]
    want_text = [len(o.token_ids) for o in tiny_llm.generate(texts, sp)]
    with served(build_app(tiny_llm, served_model_name="tiny")) as url:
        out = tmp_path / "r.json"
        assert bench_cli.main(["--url", url, "--num-prompts", "5", "--max-tokens", "6",
                               "--max-concurrency", "2", "--json", str(out), "--quiet"]) == 0
        res = json.loads(out.read_text())
        completions = url_serving.run(url, chats, endpoint="completions", max_tokens=6,
                                      request_rate=50.0)
    assert res["mode"] == "serve" and res["partial"] is False
    row = res["serving"][0]
    assert (row["mode"], row["model"], row["endpoint"]) == ("url", "tiny", "chat")
    assert row["completed"] == 5 and row["failed"] == 0 and row["errors"] == []
    assert [r["tokens"] for r in row["per_request"]] == want_chat
    assert row["output_tokens"] == sum(want_chat)
    assert row["peak_concurrency"] == 2            # at most --max-concurrency in flight
    for r in row["per_request"]:
        assert r["start"] <= r["first"] <= r["finish"] and r["reason"] == "length"
    assert 0 < row["p50_ttft_s"] <= row["p99_ttft_s"] <= row["p99_e2e_s"]
    assert row["output_throughput"] == pytest.approx(sum(want_chat) / row["duration_s"])
    assert completions["completed"] == 5 and completions["request_rate"] == 50.0
    assert [r["tokens"] for r in completions["per_request"]] == want_text


def test_statistics_over_hand_made_timelines():
    recs = [  # start, first, finish, tokens, gaps between chunks
        dict(start=0.0, first=0.5, finish=1.5, tokens=3, itl=[0.5, 0.5]),
        dict(start=1.0, first=1.2, finish=2.0, tokens=5, itl=[0.2, 0.2, 0.2, 0.2]),
        dict(start=1.0, first=None, finish=None, tokens=0, itl=[], error="HTTP 503: full"),
    ]
    for r in recs:
        r.update(arrival=r["start"], reason="length", error=r.get("error"))
    res = url_serving.summarize(recs, math.inf)
    assert (res["requests"], res["completed"], res["failed"]) == (3, 2, 1)
    assert res["errors"] == ["HTTP 503: full"]
    np.testing.assert_allclose([res["mean_ttft_s"], res["p50_ttft_s"]], [0.35, 0.35])
    np.testing.assert_allclose(res["p50_itl_s"], np.percentile([0.5, 0.5, .2, .2, .2, .2], 50))
    np.testing.assert_allclose(res["mean_itl_s"], 1.8 / 6)
    np.testing.assert_allclose([res["mean_e2e_s"], res["p90_e2e_s"]],
                               [1.25, np.percentile([1.5, 1.0], 90)])
    np.testing.assert_allclose(res["mean_tpot_s"], np.mean([1.0 / 2, 0.8 / 4]))
    assert res["output_tokens"] == 8 and res["duration_s"] == 2.0
    assert res["output_throughput"] == 4.0 and res["peak_concurrency"] == 2


def test_an_unreachable_server_fails_every_request():
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = url_serving.run(f"http://127.0.0.1:{port}", [[{"role": "user", "content": "hi"}]] * 3,
                          model="m", max_tokens=4, timeout=5)
    assert res["completed"] == 0 and res["failed"] == 3
    assert res["errors"] and "ConnectError" in res["errors"][0]


@pytest.mark.parametrize("argv, needle", [
    (["--max-concurrency", "4"], "--max-concurrency is for a server at --url"),
    (["--url", "localhost:8000"], "a base URL"),
    (["--url", "http://127.0.0.1:8000", "--mode", "sweep"], "serve mode"),
    (["--url", "http://127.0.0.1:8000", "--max-concurrency", "0"], "must be >= 1"),
    (["--url", "http://127.0.0.1:8000", "--endpoint", "embeddings"], "invalid choice"),
])
def test_url_options_are_checked(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        bench_cli.parse_args(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err
