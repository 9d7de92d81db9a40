"""LLM(data_parallel=2) and LLM(tensor_parallel=3) on the real SmolLM2 weights give the single
device's greedy outputs (plain and speculative). Run by tests/test_parallel.py in a subprocess
with 3 fake CPU devices (SmolLM2 has 3 KV heads, so tensor parallel needs a multiple of 3)."""
import sys
import jax, jax.numpy as jnp
from jaxspec import LLM, SamplingParams
from jaxspec.models.eagle import init_eagle_params
assert len(jax.devices()) == 3, jax.devices()
path = sys.argv[1]
prompts = [[1, 2, 3, 4], [9, 8, 7], [20, 21, 22, 23, 24, 25], [5]]
sp = SamplingParams(max_tokens=6, ignore_eos=True)
base = LLM(path, dtype=jnp.float32, max_batch=2, max_model_len=64)
ref = [o.token_ids for o in base.generate(prompts, sp)]
dp = LLM(path, dtype=jnp.float32, max_batch=1, max_model_len=64, data_parallel=2,
         data_parallel_impl="pmap")
assert dp.dp_runner is not None
assert [o.token_ids for o in dp.generate(prompts, sp)] == ref
draft = init_eagle_params(base.config, jax.random.PRNGKey(0))
dps = LLM(path, dtype=jnp.float32, max_batch=1, max_model_len=64, data_parallel=2, draft=draft,
          spec="chain", data_parallel_impl="pmap")
outs = dps.generate(prompts, sp)
assert [o.token_ids for o in outs] == ref and all(o.accept_lens for o in outs)
# The default: one continuous-batching engine over both replicas' slots: same outputs, and it
# streams.
dpe = LLM(path, dtype=jnp.float32, max_batch=1, max_model_len=64, data_parallel=2, draft=draft,
          spec="chain")
assert dpe.dp_runner is None and dpe.engine.backend.mesh is not None
assert [o.token_ids for o in dpe.generate(prompts, sp)] == ref
streamed = {}
for delta in dpe.stream(prompts, sp):
    streamed.setdefault(delta.request_id, []).extend(delta.token_ids)
assert sorted(streamed.values()) == sorted(ref)
tp = LLM(path, dtype=jnp.float32, max_batch=2, max_model_len=64, tensor_parallel=3, draft=draft, spec="chain")
assert [o.token_ids for o in tp.generate(prompts, sp)] == ref
print("LLM data/tensor parallel OK")
