"""What the server tests share: a tiny random Llama with SmolLM2's tokenizer and chat template,
and an app served by uvicorn on a free loopback port in a thread."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest


def write_tiny_chat_model(d: Path, smollm2_gguf: Path, context: int = 512) -> Path:
    """config.json, model.safetensors (random weights) and SmolLM2's tokenizer files: a
    2-layer Llama whose greedy output is random text (EOS rarely), prompts encoded as the real
    model would encode them."""
    from safetensors.numpy import save_file

    from jaxspec.config import ModelConfig
    from jaxspec.loading.common import expected_shapes
    from jaxspec.tokenizer import Tokenizer

    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_gguf(smollm2_gguf)
    tok.hf.save_pretrained(d)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama",
                  vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=context, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_ids[0])
    (d / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    shapes = expected_shapes(ModelConfig.from_hf(config))
    save_file({n: (rng.standard_normal(s) * (1.0 if len(s) == 1 else 0.3)).astype(np.float32)
               for n, s in shapes.items()}, str(d / "model.safetensors"))
    return d


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
