"""LLM(data_parallel=2) through shard_map (the default) and through jax.pmap, and
LLM(tensor_parallel=3), on the real SmolLM2 weights give the single device's greedy outputs,
plain and speculative; the data-parallel engines stream, and a streaming request aborted part
way ends with 'abort' while the others finish as on one device. Run by tests/test_parallel.py in
a subprocess with 3 fake CPU devices (SmolLM2 has 3 KV heads, so tensor parallel needs a
multiple of 3)."""
import sys

import jax
import jax.numpy as jnp

from jaxspec import LLM, SamplingParams
from jaxspec.models.eagle import init_eagle_params
from jaxspec.parallel import DataParallel, TensorParallel

assert len(jax.devices()) == 3, jax.devices()
path = sys.argv[1]
prompts = [[1, 2, 3, 4], [9, 8, 7], [20, 21, 22, 23, 24, 25], [5]]
sp = SamplingParams(max_tokens=6, ignore_eos=True)
base = LLM(path, dtype=jnp.float32, max_batch=2, max_model_len=64)
ref = [o.token_ids for o in base.generate(prompts, sp)]
draft = init_eagle_params(base.config, jax.random.PRNGKey(0))


def placement(llm):
    return llm.engine.backend.placement


def check_stream_abort(llm):
    """Streams all prompts, aborting request 'b' after its first delta: its tokens are a
    prefix of its reference, every other stream is its reference."""
    ids = ["a", "b", "c", "d"]
    streamed, reasons = {}, {}
    for delta in llm.stream(prompts, sp, request_ids=ids):
        streamed.setdefault(delta.request_id, []).extend(delta.token_ids)
        if delta.request_id == "b" and not delta.finished:
            llm.abort("b")
        if delta.finished:
            reasons[delta.request_id] = delta.finish_reason
    assert reasons == {"a": "length", "b": "abort", "c": "length", "d": "length"}, reasons
    assert [streamed[i] for i in "acd"] == [ref[0], ref[2], ref[3]]
    assert streamed["b"] == ref[1][:len(streamed["b"])]


for impl in ("pmap", None):        # None: LLM's default, shard_map
    kw = {} if impl is None else dict(data_parallel_impl=impl)
    dp = LLM(path, dtype=jnp.float32, max_batch=1, max_model_len=64, data_parallel=2, **kw)
    pl = placement(dp)
    assert isinstance(pl, DataParallel) and pl.impl == (impl or "shard_map"), pl
    assert pl.replicas == 2 and dp.engine.slots == 2
    assert [o.token_ids for o in dp.generate(prompts, sp)] == ref, impl
    dps = LLM(path, dtype=jnp.float32, max_batch=1, max_model_len=64, data_parallel=2,
              draft=draft, spec="chain", **kw)
    assert isinstance(placement(dps), DataParallel) and placement(dps).impl == pl.impl
    outs = dps.generate(prompts, sp)
    assert [o.token_ids for o in outs] == ref and all(o.accept_lens for o in outs), impl
    streamed = {}
    for delta in dps.stream(prompts, sp):
        streamed.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert sorted(streamed.values()) == sorted(ref), impl
    check_stream_abort(dps)
    print(f"ok LLM data_parallel=2 {pl.impl}", flush=True)
    del dp, dps

tp = LLM(path, dtype=jnp.float32, max_batch=2, max_model_len=64, tensor_parallel=3, draft=draft,
         spec="chain")
assert isinstance(placement(tp), TensorParallel)
assert [o.token_ids for o in tp.generate(prompts, sp)] == ref
print("LLM data/tensor parallel OK")
