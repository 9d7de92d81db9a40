"""A one-slot speculative engine runs the cycles per call it was built with (batch 1 with
several cycles a call), and its tokens equal the one-cycle engine's: requests that end by
max_tokens or EOS inside a call keep only their own tokens."""
import numpy as np

from draft_models import agreeing_pair
from jaxspec.config import ModelConfig
from jaxspec.engine import Engine, EngineConfig, SpecBackend
from jaxspec.sampling import SamplingParams
from jaxspec.spec import SpecConfig

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=96,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
SPEC = SpecConfig(3, 1, 4)
MAX_MODEL_LEN = 48


def serve(k: int, prompts, sps, eos):
    """Runs the requests one after another on a one-slot engine of k cycles per call: (each
    request's tokens and finish reason, the engine's call sizes)."""
    params, head = agreeing_pair(CFG, scale=0.02, lm_head_scale=0.5)
    backend = SpecBackend(CFG, params, head, SPEC, 1, MAX_MODEL_LEN + 2 * SPEC.max_emit * k,
                          cycles_per_call=k)
    engine = Engine(backend, EngineConfig(max_batch=1, max_model_len=MAX_MODEL_LEN),
                    vocab_size=CFG.vocab_size, eos_ids=eos)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, sps)]
    toks, reasons = {}, {}
    for _ in range(2000):
        if not engine.has_work():
            break
        for d in engine.step():
            toks.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                reasons[d.request_id] = d.finish_reason
    assert not engine.has_work()
    return [(toks[i], reasons[i]) for i in ids], dict(engine.stats.call_sizes)


def test_one_slot_runs_its_cycles_per_call_with_one_cycle_outputs():
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, CFG.vocab_size, rng.integers(1, 20))]
               for _ in range(6)]
    sps = [SamplingParams(max_tokens=int(m), ignore_eos=bool(i % 2))
           for i, m in enumerate(rng.integers(1, 25, len(prompts)))]
    one, sizes_one = serve(1, prompts, sps, eos=())
    # the commonest token of the one-cycle outputs serves as EOS: some requests stop early
    eos = (int(np.bincount([t for o, _ in one for t in o], minlength=CFG.vocab_size).argmax()),)
    one, sizes_one = serve(1, prompts, sps, eos)
    two, sizes_two = serve(2, prompts, sps, eos)
    assert two == one
    assert {r for _, r in one} == {"stop", "length"}
    assert all(len(o) == sp.max_tokens for (o, r), sp in zip(one, sps) if r == "length")
    assert set(sizes_one) == {1} and set(sizes_two) == {2}
    assert sum(sizes_two.values()) < sum(sizes_one.values())
