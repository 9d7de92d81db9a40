"""`jaxspec serve` on a tiny random model over loopback: bad requests get a 400 in OpenAI's
error shape naming the field while a running request carries on to its offline output; a full
queue answers 503 with Retry-After; a client that leaves frees its slot; shutdown lets what is in
flight finish (or aborts it past the timeout) and stops the engine thread; the command line
checks its options as it parses them and serves until SIGTERM."""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serve_helpers import metric, served, tiny_chat_dir, tiny_llm, wait_idle  # noqa: F401
from jaxspec import SamplingParams
from jaxspec.serve.app import build_app
from jaxspec.serve.server import ThreadedServer

NAME = "tiny"
LONG = dict(max_tokens=240, ignore_eos=True, temperature=0)     # runs ~15 engine calls


def _post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=kw.pop("timeout", 60), **kw)


def _stream_text(url, body, tokens: list, started: threading.Event = None):
    """Reads one streamed completion to its end: its text and finish reason; token ids into
    tokens; sets started at the first chunk."""
    text, reason = "", None
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"][0]
            text += ch["text"]
            tokens += ch.get("token_ids", [])
            reason = ch["finish_reason"] or reason
            if started is not None:
                started.set()
    return text, reason


BAD = [   # (endpoint, fields, param, words of the message)
    ("completions", {"n": 2}, "n", "n=1"),
    ("completions", {"best_of": 3}, "best_of", "best_of"),
    ("completions", {"echo": True}, "echo", "echo"),
    ("completions", {"suffix": "x"}, "suffix", "suffix"),
    ("completions", {"logit_bias": {"5": 1.0}}, "logit_bias", "not supported"),
    ("completions", {"temperature": -1}, "temperature", ">= 0"),
    ("completions", {"temperature": "hot"}, "temperature", "number"),
    ("completions", {"top_p": 0}, "top_p", "(0, 1]"),
    ("completions", {"top_k": -5}, "top_k", "top_k"),
    ("completions", {"min_p": 2}, "min_p", "[0, 1]"),
    ("completions", {"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ("completions", {"seed": -1}, "seed", "seed"),
    ("completions", {"logprobs": 50}, "logprobs", "[0, 20]"),
    ("completions", {"max_tokens": 0}, "max_tokens", "positive"),
    ("completions", {"max_tokens": 10_000}, "max_tokens", "10000"),
    ("completions", {"stop": 5}, "stop", "a string or a list of strings"),
    ("completions", {"stop": [""]}, "stop", "non-empty"),
    ("completions", {"stop_token_ids": [-1]}, "stop_token_ids", "non-negative"),
    ("completions", {"prompt": []}, "prompt", "no prompt"),
    ("completions", {"prompt": ""}, "prompt", "empty prompt"),
    ("completions", {"prompt": [10 ** 9]}, "prompt", "out of range"),
    ("completions", {"prompt": [1, "a"]}, "prompt", "list of token ids"),
    ("completions", {"bogus": 1}, "bogus", "Unrecognized request argument"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ("completions", {"model": None}, "model", "string"),
    ("chat", {"messages": []}, "messages", "at least one message"),
    ("chat", {"messages": [{"content": "hi"}]}, "messages.0.role", "required"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0", "text parts"),
    ("chat", {"tools": [{"type": "function"}]}, "tools", "tool"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format", "structured"),
    ("chat", {"top_logprobs": 3}, "top_logprobs", "logprobs is true"),
    ("chat", {"logprobs": True, "top_logprobs": 30}, "top_logprobs", "[0, 20]"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens", "positive"),
    ("chat", {"max_tokens": 4, "max_completion_tokens": 4}, "max_completion_tokens", "one of"),
]


def test_bad_requests_get_400_naming_the_field_and_running_ones_carry_on(tiny_llm):
    ref = tiny_llm.generate("Tell me a story", SamplingParams(max_tokens=200, ignore_eos=True))[0]
    with served(build_app(tiny_llm, served_model_name=NAME)) as url:
        tokens, got, started = [], {}, threading.Event()
        body = {"model": NAME, "prompt": "Tell me a story", "max_tokens": 200,
                "ignore_eos": True, "temperature": 0, "return_token_ids": True}
        t = threading.Thread(target=lambda: got.update(out=_stream_text(url, body, tokens,
                                                                        started)))
        t.start()
        assert started.wait(60)
        for endpoint, fields, param, words in BAD:
            base = ({"model": NAME, "prompt": "hi", "max_tokens": 4} if endpoint == "completions"
                    else {"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
            path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
            r = _post(url, path, {**base, **fields})
            assert r.status_code == 400, (fields, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "invalid_request_error" and err["param"] == param, (fields, err)
            assert words in err["message"], (fields, err)
        r = httpx.post(url + "/v1/completions", content=b"{not json",
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = _post(url, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found" and "tiny" in r.text
        r = httpx.get(url + "/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"
        t.join(60)
        assert got["out"] == (ref.text, "length") and tokens == ref.token_ids
        assert metric(url, "jaxspec_requests_rejected_total", reason="invalid") == len(BAD) + 2
        assert metric(url, "jaxspec_request_success_total", finish_reason="length") == 1
        wait_idle(url, tiny_llm)


def test_models_health_and_metrics(tiny_llm):
    with served(build_app(tiny_llm, served_model_name=NAME)) as url:
        models = httpx.get(url + "/v1/models").json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [NAME]
        assert models["data"][0]["max_model_len"] == tiny_llm.max_model_len
        r = httpx.get(url + "/health")
        assert r.status_code == 200
        r = _post(url, "/v1/completions", {"model": NAME, "prompt": "One two", "max_tokens": 5,
                                           "temperature": 0, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 5
        m = httpx.get(url + "/metrics")
        assert m.headers["content-type"].startswith("text/plain")
        prompt = r.json()["usage"]["prompt_tokens"]
        assert metric(url, "jaxspec_prompt_tokens_total") == prompt
        assert metric(url, "jaxspec_generation_tokens_total") == 5
        assert metric(url, "jaxspec_time_to_first_token_seconds_count") == 1
        assert metric(url, "jaxspec_e2e_request_latency_seconds_count") == 1
        assert metric(url, "jaxspec_spec_decode_cycles_total") == 0     # plain decoding


def test_several_prompts_are_several_choices(tiny_llm):
    prompts = ["Hello there", "A much longer prompt than the first one"]
    refs = tiny_llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    with served(build_app(tiny_llm, served_model_name=NAME)) as url:
        body = {"model": NAME, "prompt": prompts, "max_tokens": 20, "temperature": 0,
                "ignore_eos": True}
        r = _post(url, "/v1/completions", body).json()
        assert [c["text"] for c in r["choices"]] == [ref.text for ref in refs]
        assert [c["index"] for c in r["choices"]] == [0, 1]
        assert r["usage"]["completion_tokens"] == 40
        texts = ["", ""]
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        texts[c["index"]] += c["text"]
        assert texts == [ref.text for ref in refs]


def test_an_engine_failure_fails_its_requests_and_health(tiny_llm, monkeypatch):
    def fail(*a, **k):
        raise RuntimeError("device lost")

    monkeypatch.setattr(tiny_llm.engine, "step", fail)
    try:
        with served(build_app(tiny_llm, served_model_name=NAME)) as url:
            r = _post(url, "/v1/completions", {"model": NAME, "prompt": "hi"})
            assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
            assert httpx.get(url + "/health").status_code == 503
            r = _post(url, "/v1/completions", {"model": NAME, "prompt": "hi"})
            assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
    finally:
        tiny_llm.engine.drop(list(tiny_llm.engine.requests))    # what the failure left


def test_full_queue_answers_503_with_retry_after_and_leaving_clients_free_slots(tiny_llm):
    with served(build_app(tiny_llm, served_model_name=NAME, max_queue=1)) as url:
        body = {"model": NAME, "prompt": "hi", "stream": True, **LONG}
        with httpx.Client(timeout=60) as client:
            streams = []
            for _ in range(tiny_llm.max_batch + 1):   # the slots and the queue's one place
                cm = client.stream("POST", url + "/v1/completions", json=body)
                streams.append(cm)
                assert cm.__enter__().status_code == 200     # headers: accepted
            r = _post(url, "/v1/completions", {**body, "stream": False})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            assert metric(url, "jaxspec_requests_rejected_total", reason="queue_full") == 1
            assert metric(url, "jaxspec_num_requests_waiting") + metric(
                url, "jaxspec_num_requests_running") == tiny_llm.max_batch + 1
            for cm in streams:          # the clients leave mid-stream
                cm.__exit__(None, None, None)
        wait_idle(url, tiny_llm)
        assert metric(url, "jaxspec_request_success_total", finish_reason="abort") == 9
        r = _post(url, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200


def test_a_whole_response_whose_client_left_is_aborted(tiny_llm):
    with served(build_app(tiny_llm, served_model_name=NAME)) as url:
        with pytest.raises(httpx.ReadTimeout):      # the client gives up, closing the socket
            _post(url, "/v1/completions", {"model": NAME, "prompt": "hi", **LONG},
                  timeout=httpx.Timeout(60, read=0.05))
        wait_idle(url, tiny_llm)
        assert metric(url, "jaxspec_request_success_total", finish_reason="abort") == 1
        assert metric(url, "jaxspec_request_success_total", finish_reason="length") == 0


def test_shutdown_lets_requests_in_flight_finish(tiny_llm):
    ref = tiny_llm.generate("Once", SamplingParams(max_tokens=200, ignore_eos=True))[0]
    app = build_app(tiny_llm, served_model_name=NAME)
    server = ThreadedServer(app, shutdown_timeout=60).start()
    tokens, got, started = [], {}, threading.Event()
    body = {"model": NAME, "prompt": "Once", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}
    t = threading.Thread(target=lambda: got.update(out=_stream_text(server.url, body, tokens,
                                                                    started)))
    t.start()
    assert started.wait(60)
    server.stop(60)                     # as on SIGTERM
    t.join(60)
    assert got["out"] == (ref.text, "length") and tokens == ref.token_ids
    assert not app.state.service.engine._thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")


def test_shutdown_past_its_timeout_aborts_what_is_left(tiny_llm):
    app = build_app(tiny_llm, served_model_name=NAME)
    server = ThreadedServer(app, shutdown_timeout=0.1).start()
    body = {"model": NAME, "prompt": "hi", **LONG}
    n = 4 * tiny_llm.max_batch              # ~60 engine calls of work: far past 0.1 s
    results = []

    def client():
        try:
            results.append(_post(server.url, "/v1/completions", body).status_code)
        except httpx.HTTPError as e:        # cut off by the shutdown
            results.append(type(e).__name__)

    threads = [threading.Thread(target=client) for _ in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while metric(server.url, "jaxspec_num_requests_running") < tiny_llm.max_batch:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    t0 = time.monotonic()
    server.stop(60)
    assert time.monotonic() - t0 < 10
    for t in threads:
        t.join(60)
    assert len(results) == n and results.count(200) < n
    e = tiny_llm.engine
    assert not e.requests and not e.scheduler.live.any() and not e.finished_requests
    assert not app.state.service.engine._thread.is_alive()


def _parser():
    from jaxspec.serve.cli import add_arguments
    ap = argparse.ArgumentParser(prog="jaxspec serve")
    add_arguments(ap)
    return ap


@pytest.mark.parametrize("argv, needle", [
    (["--port", "70000"], "--port"), (["--max-batch", "0"], "--max-batch"),
    (["--spec", "bogus"], "--spec"), (["--model", "/no/such/model"], "--model"),
    (["--draft", "/no/such/head"], "--draft"), (["--max-queue", "-1"], "--max-queue"),
    (["--prefill-chunk", "3"], "--prefill-chunk"), (["--shutdown-timeout", "-1"],
                                                   "--shutdown-timeout"),
    (["--dtype", "float13"], "--dtype"),
])
def test_cli_options_are_checked_as_they_are_parsed(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(argv)
    assert e.value.code == 2 and f"argument {needle}" in capsys.readouterr().err


def test_cli_defaults():
    from jaxspec.serve.cli import served_name
    a = _parser().parse_args([])
    assert (a.host, a.port, a.max_batch, a.max_queue, a.draft, a.spec) == (
        "127.0.0.1", 8000, 8, 256, None, None)
    assert served_name(a) == "SmolLM2-135M-Instruct"
    a = _parser().parse_args(["--model", "/tmp", "--served-model-name", "m", "--seed", "3"])
    assert served_name(a) == "m" and a.seed == 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serves_until_sigterm_and_exits_0(tiny_chat_dir, tiny_llm):
    ref = tiny_llm.generate("Hello", SamplingParams(max_tokens=8, ignore_eos=True))[0]
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxspec.serve.cli", "--model", str(tiny_chat_dir), "--port",
         str(port), "--max-model-len", "256", "--no-warmup", "--log-level", "warning"],
        env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        r = _post(url, "/v1/completions", {"model": "tiny-chat", "prompt": "Hello",
                                           "max_tokens": 8, "temperature": 0,
                                           "ignore_eos": True})
        assert r.json()["choices"][0]["text"] == ref.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
