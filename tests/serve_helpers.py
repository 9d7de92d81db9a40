"""What the server tests share: a tiny random Llama with SmolLM2's tokenizer and chat template,
and an app served by uvicorn on a free loopback port in a thread."""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest


def write_tiny_chat_model(d: Path, smollm2_gguf: Path, context: int = 512) -> Path:
    """config.json, model.safetensors (random weights) and SmolLM2's tokenizer files: a
    2-layer Llama whose greedy output is random text (EOS rarely), prompts encoded as the real
    model would encode them."""
    from draft_models import write_tiny_llama
    from jaxspec.tokenizer import Tokenizer

    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_gguf(smollm2_gguf)
    tok.hf.save_pretrained(d)
    return write_tiny_llama(d, tok.vocab_size, context, tok.bos_token_id,
                            tok.eos_token_ids[0], tie=True)


@contextlib.contextmanager
def served(app, timeout: float = 60.0):
    """Serves app on 127.0.0.1 at a free port in a thread; yields the base URL. On exit the
    server shuts down as on SIGTERM (in-flight requests finish, then the engine stops)."""
    from jaxspec.serve.server import ThreadedServer

    server = ThreadedServer(app, host="127.0.0.1", port=0, shutdown_timeout=timeout)
    server.start(timeout)
    try:
        yield server.url
    finally:
        server.stop(timeout)


def metric(url: str, name: str, **labels) -> float:
    """The value of one sample of the server's /metrics (0 when absent)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def wait_idle(url: str, llm, timeout: float = 30.0):
    """Waits until the running and waiting gauges read 0; then the engine holds no request
    and no slot (asserted)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        gauges = (metric(url, "jaxspec_num_requests_running"),
                  metric(url, "jaxspec_num_requests_waiting"))
        if gauges == (0.0, 0.0):
            break
        assert time.monotonic() < deadline, f"running/waiting stay at {gauges}"
        time.sleep(0.05)
    e = llm.engine
    assert not e.requests and not e.waiting and not e.scheduler.live.any()
    assert not e.finished_requests and not e.scheduler.runs


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory, smollm2_gguf):
    return write_tiny_chat_model(tmp_path_factory.mktemp("serve") / "tiny-chat", smollm2_gguf)


@pytest.fixture(scope="module")
def tiny_llm(tiny_chat_dir):
    """The tiny LLM a server test file serves (8 slots); each file that imports the fixture
    has its own."""
    from jaxspec import LLM

    return LLM(str(tiny_chat_dir), max_batch=8, max_model_len=256)
