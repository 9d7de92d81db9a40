"""Target model families: Llama 3.x (llama3 RoPE scaling, tied embeddings), Qwen3, Gemma 2 and
Gemma 3 (text). Each is a tiny random model built with transformers' own config and model
classes and saved as an HF directory (and, where llama.cpp converts the family, as the GGUF its
converter writes): jaxspec's logits against transformers' (whole prompts, and a prompt's second
chunk over its cached first one), plain greedy against transformers' greedy, greedy speculative
decoding (chain and tree) against plain greedy with a random EAGLE-1 head of the target's shape,
and unsupported configurations refused by name."""
from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from draft_models import agreeing_pair
from jaxspec.config import ConfigError, ModelConfig
from jaxspec.kv import init_cache
from jaxspec.loading import common
from jaxspec.models import eagle, llama
from jaxspec.spec import SpecConfig
from jaxspec.weights import load_params
from pallas_kernels.kv_compact import kv_compact
from reference_runner import SpecRunner, plain_greedy

torch = pytest.importorskip("torch")

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, rms_norm_eps=1e-6,
               max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# kind -> (transformers config class name, its arguments). Head dims 16 to 256; GQA 2 and 4;
# sliding windows of 8 (the prompts and outputs run past them); Gemma 3 has its five sliding
# layers to one global, linear RoPE scaling on the global ones only and its own query scale.
FAMILIES = {
    "llama3": ("LlamaConfig", dict(
        _COMMON, max_position_embeddings=8192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3": ("Qwen3Config", dict(
        _COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=128, tie_word_embeddings=True, rope_theta=1e6)),
    "gemma2": ("Gemma2Config", dict(
        _COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=30.0)),
    "gemma3": ("Gemma3TextConfig", dict(
        _COMMON, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, sliding_window=8, query_pre_attn_scalar=48,
        final_logit_softcapping=30.0, rope_scaling={"rope_type": "linear", "factor": 2.0})),
}
ARCH = {"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
PROMPTS = [[5, 17, 42, 8, 99, 3, 11], list(range(60, 80)),
           [int(t) for t in np.random.default_rng(1).integers(3, 256, 33)]]
NEW = 24
MAX_LEN = 128


def _hf_model(kind: str):
    """transformers' own model of the family, weights drawn so that logits are spread (greedy
    has no near-ties) and attention matters: Linear weights of variance 1 / fan-in, unit
    embeddings, norm weights 0.1 from their neutral value (1, or 0 for Gemma's 1 + w)."""
    import transformers

    cls_name, kw = FAMILIES[kind]
    cfg = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(sorted(FAMILIES).index(kind))
    # eager: the only attention transformers soft-caps scores in (Gemma 2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                          attn_implementation="eager")
    neutral = 0.0 if kind.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(neutral + 0.1 * torch.randn_like(p))
            elif "embed" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.eval()
    model.generation_config.eos_token_id = None   # greedy runs the full length
    return model


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """kind -> (HF directory, transformers model, jaxspec config, params), built once."""
    root = tmp_path_factory.mktemp("families")
    built = {}

    def get(kind):
        if kind not in built:
            model = _hf_model(kind)
            model.save_pretrained(root / kind)
            cfg, params = load_params(root / kind, dtype=jnp.float32, use_cache=False)
            built[kind] = (root / kind, model, cfg, params)
        return built[kind]

    return get


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@functools.partial(jax.jit, static_argnames="cfg")
def _forward_logits(params, cfg, k, v, lens, ids, start):
    """ids [1, N] at positions start.. over the cache (k, v) holding `lens` rows -> (k, v with
    the N rows written, logits [N, V])."""
    n = ids.shape[1]
    pos = start + jnp.arange(n, dtype=jnp.int32)[None]
    h, kn, vn, _ = llama.forward(params, cfg, ids, pos, k, v, lens, llama.causal_mask(1, n))
    k, v = kv_compact(k, v, kn, vn, lens, jnp.arange(n, dtype=jnp.int32)[None],
                      jnp.full((1,), n, jnp.int32))
    return k, v, llama.lm_head(params, cfg, h)[0]


def our_logits(cfg, params, ids, split=None):
    """Logits [N, V] of ids: in one forward from an empty cache, or (split) the ids from `split`
    on in a second forward over the first ones' cached rows."""
    cache = init_cache(cfg, 1, 64, jnp.float32)
    k, v, lens = cache.k, cache.v, cache.lens
    out = []
    for lo, hi in ((0, split), (split, len(ids))) if split else ((0, len(ids)),):
        k, v, logits = _forward_logits(params, cfg, k, v, lens,
                                       jnp.asarray([ids[lo:hi]], jnp.int32), jnp.int32(lo))
        lens = lens + (hi - lo)
        out.append(np.asarray(logits))
    return np.concatenate(out)


def assert_close(got, ref):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_config_read_from_the_hf_directory(family, kind):
    _, model, cfg, params = family(kind)
    hc = model.config
    assert cfg.arch == ARCH[kind] and cfg.head_dim == hc.head_dim
    assert cfg.tie_word_embeddings == ("lm_head" not in params) == hc.tie_word_embeddings
    assert cfg.qk_norm == (kind in ("qwen3", "gemma3")) == ("q_norm" in params["layers"])
    assert cfg.sandwich_norms == kind.startswith("gemma") == ("post_mlp_norm" in params["layers"])
    types = getattr(hc, "layer_types", None) or ["full_attention"] * hc.num_hidden_layers
    assert cfg.window_layers == tuple(t == "sliding_attention" for t in types)
    if kind == "gemma3":
        assert cfg.window_layers == (True,) * 5 + (False,) and cfg.sliding_window == 8
        assert cfg.rope_local_theta == 10000.0 and cfg.rope_theta == 1e6
        assert cfg.rope_scaling.kind == "linear" and cfg.rope_scaling.factor == 2.0
        assert cfg.attn_scale == 48 ** -0.5 and cfg.embed_scale == 8.0
    if kind == "gemma2":
        assert cfg.attn_logit_softcap == 2.0 and cfg.final_logit_softcap == 30.0
    if kind == "llama3":
        assert cfg.rope_scaling.kind == "llama3" and cfg.rope_scaling.factor == 8.0


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_logits_match_transformers(family, kind):
    _, model, cfg, params = family(kind)
    for ids in PROMPTS:
        ref = hf_logits(model, ids)
        assert_close(our_logits(cfg, params, ids), ref)
    # A second chunk over the first one's cached rows: its queries' windows start inside them.
    ids = PROMPTS[2]
    assert_close(our_logits(cfg, params, ids, split=13), hf_logits(model, ids))


@pytest.mark.parametrize("feature", ["window", "local_rope", "llama3_rope", "qk_norm",
                                     "attn_softcap", "final_softcap", "query_scale"])
def test_each_family_feature_changes_the_logits(family, feature):
    """The parity above can fail: with any one family feature switched off, jaxspec's logits
    leave transformers'."""
    kind, change = {
        "window": ("gemma3", dict(sliding_window=None, sliding_layers=None)),
        "local_rope": ("gemma3", dict(rope_local_theta=None)),
        "llama3_rope": ("llama3", dict(rope_scaling=None)),
        "qk_norm": ("qwen3", {}),
        "attn_softcap": ("gemma2", dict(attn_logit_softcap=None)),
        "final_softcap": ("gemma2", dict(final_logit_softcap=None)),
        "query_scale": ("gemma3", dict(query_pre_attn_scalar=None)),
    }[feature]
    _, model, cfg, params = family(kind)
    if feature == "qk_norm":   # the forward applies q/k norms where the layer has them
        params = dict(params, layers={k: v for k, v in params["layers"].items()
                                      if k not in ("q_norm", "k_norm")})
    ids = PROMPTS[2]
    ref = hf_logits(model, ids)
    got = our_logits(dataclasses.replace(cfg, **change), params, ids)
    assert np.abs(got - ref).max() > 1e-2 * np.abs(ref).max()


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_plain_greedy_equals_transformers_greedy(family, kind):
    _, model, cfg, params = family(kind)
    for ids in PROMPTS[:2]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
        ref = out[0, len(ids):].tolist()
        assert len(ref) == NEW
        assert plain_greedy(params, cfg, ids, NEW, MAX_LEN) == ref


_PLAIN = {}


def _plain(kind, cfg, params):
    """Plain greedy outputs of every prompt (one token at a time through the forward)."""
    if kind not in _PLAIN:
        _PLAIN[kind] = [plain_greedy(params, cfg, p, NEW, MAX_LEN) for p in PROMPTS]
    return _PLAIN[kind]


SHAPES = {"chain": SpecConfig(4, 1, 5), "tree": SpecConfig(4, 4, 12)}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_greedy_speculative_equals_plain_with_a_random_head(family, kind, shape):
    _, _, cfg, params = family(kind)
    head = eagle.init_eagle_params(cfg, jax.random.PRNGKey(1), scale=0.2)
    runner = SpecRunner(cfg, params, head, SHAPES[shape], max_slots=4, max_len=MAX_LEN)
    res = runner.generate(PROMPTS, [NEW] * len(PROMPTS), eos_ids=())
    for r, ref in zip(res, _plain(kind, cfg, params)):
        assert r.token_ids == ref and r.finish_reason == "length"


def _agreeing_gemma3(window: int):
    """A Gemma 3 config with a window shorter than the tree's deepest paths, and a target and
    EAGLE-1 head built to agree (`draft_models.agreeing_pair`) with attention that matters:
    random q/k/v projections and q/k norms, the sandwich norms scaling each layer's outputs to
    0.2 of unit RMS beside the embedding's 8. Accepted paths are long, a tree node's window
    leaves out its own early ancestors, and the window changes the greedy output."""
    cfg = ModelConfig(arch="Gemma3ForCausalLM", vocab_size=331, hidden_size=64,
                      intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=1,
                      head_dim=64, sliding_window=window, sliding_layers=(True, False),
                      qk_norm=True, norm_weight_offset=1.0, sandwich_norms=True,
                      embed_scale=8.0, hidden_act="gelu_tanh", query_pre_attn_scalar=48.0,
                      rope_theta=1e6, rope_local_theta=10000.0, final_logit_softcap=30.0)
    params, head = agreeing_pair(dataclasses.replace(cfg, qk_norm=False, sandwich_norms=False),
                                 scale=0.02, lm_head_scale=0.5)
    quiet = jnp.full((cfg.num_layers, cfg.hidden_size), 0.2 - cfg.norm_weight_offset)
    extra = llama.init_random_params(cfg, jax.random.PRNGKey(9), scale=0.5)["layers"]
    layers = dict(params["layers"], wqkv=extra["wqkv"], q_norm=extra["q_norm"],
                  k_norm=extra["k_norm"], post_attn_norm=quiet, post_mlp_norm=quiet)
    return cfg, dict(params, layers=layers), head


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_windows_inside_the_tree_with_long_accepts(shape):
    cfg, params, head = _agreeing_gemma3(window=3)
    spec = SHAPES[shape]
    runner = SpecRunner(cfg, params, head, spec, max_slots=4, max_len=MAX_LEN)
    res = runner.generate(PROMPTS, [NEW] * len(PROMPTS), eos_ids=())
    for r, p in zip(res, PROMPTS):
        assert r.token_ids == plain_greedy(params, cfg, p, NEW, MAX_LEN)
    accepts = [a for r in res for a in r.accept_lens]
    assert max(accepts) == spec.num_steps and np.mean(accepts) >= 2.5, accepts
    # ... where the window changes the output: without it the plain tokens differ.
    wide = dataclasses.replace(cfg, sliding_window=None, sliding_layers=None)
    assert any(plain_greedy(params, wide, p, NEW, MAX_LEN) != r.token_ids
               for r, p in zip(res, PROMPTS))


# ------------------------------------------------------------------------------------- GGUF

# HF -> GGUF tensor names as llama.cpp's converter writes them (gguf's TensorNameMap).
_GGUF_LAYER = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
}
_GGUF_NORMS = {
    False: {"post_attention_layernorm.weight": "ffn_norm.weight"},
    True: {"post_attention_layernorm.weight": "post_attention_norm.weight",
           "pre_feedforward_layernorm.weight": "ffn_norm.weight",
           "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
}


def sentencepiece_vocab(n: int):
    """A SentencePiece vocabulary of n pieces laid out as GGUF stores Gemma's: pad, eos, bos, unk,
    then the letters and every prefix of a few words, longer pieces scored higher (BPE merges
    are recovered from them), filler to n (no byte pieces: n is a tiny model's).
    -> (tokens, scores, types, merges)."""
    gguf = pytest.importorskip("gguf")
    T = gguf.TokenType
    words = ["Hello", "\u2581world", "\u2581the", "\u2581cat", "\u2581sat", "\u2581on",
             "\u2581a", "\u2581mat"]
    pieces = sorted({w[:i] for w in words for i in range(1, len(w) + 1)} | set("".join(words)),
                    key=lambda p: (len(p), p))
    pieces += [f"x{i}" for i in range(n)]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + pieces[:n - 4]
    types = [T.CONTROL, T.CONTROL, T.CONTROL, T.UNKNOWN] + [T.NORMAL] * (n - 4)
    scores = [0.0] * 4 + [float(len(t)) for t in tokens[4:]]
    merges = list(dict.fromkeys(f"{w[:i]} {w[i]}" for w in words for i in range(1, len(w))))
    return tokens, scores, types, merges


def write_family_gguf(path, kind, model, vocab=None):
    """The GGUF llama.cpp's converter writes for this family: Gemma's norm weights stored plus
    one, its sliding window and soft-caps and the global RoPE's linear scaling as metadata;
    vocab: (tokens, scores, types, merges) of a SentencePiece tokenizer to store beside them."""
    gguf = pytest.importorskip("gguf")
    arch = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3"}[kind]
    hc = model.config
    gemma = kind.startswith("gemma")
    w = gguf.GGUFWriter(str(path), arch)
    if vocab is not None:
        tokens, scores, types, merges = vocab
        w.add_tokenizer_model("llama")
        w.add_token_merges(merges)
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
    w.add_block_count(hc.num_hidden_layers)
    w.add_context_length(hc.max_position_embeddings)
    w.add_embedding_length(hc.hidden_size)
    w.add_feed_forward_length(hc.intermediate_size)
    w.add_head_count(hc.num_attention_heads)
    w.add_head_count_kv(hc.num_key_value_heads)
    w.add_key_length(hc.head_dim)
    w.add_value_length(hc.head_dim)
    w.add_layer_norm_rms_eps(hc.rms_norm_eps)
    rope = hc.rope_parameters.get("full_attention", hc.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if gemma:
        w.add_sliding_window(hc.sliding_window)
        if hc.final_logit_softcapping:
            w.add_final_logit_softcapping(hc.final_logit_softcapping)
        if hc.attn_logit_softcapping:
            w.add_attn_logit_softcapping(hc.attn_logit_softcapping)
    names = {**_GGUF_LAYER, **_GGUF_NORMS[gemma]}
    for name, t in model.state_dict().items():
        arr = t.float().numpy()
        if name == "lm_head.weight":
            continue   # tied
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            i, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{i}.{names[rest]}"
        if gemma and name.endswith("norm.weight"):
            arr = arr + 1.0
        w.add_tensor(gname, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3"])
def test_gguf_of_the_family_matches_transformers(family, kind, tmp_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    d, model, cfg_h, params_h = family(kind)
    path = write_family_gguf(tmp_path / f"{kind}.gguf", kind, model)
    # transformers' own GGUF reader takes the file back to the model's tensors (the writer
    # follows the converter's conventions, the +1 on Gemma's norms included).
    back = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    for name, t in model.state_dict().items():
        if name != "lm_head.weight":
            np.testing.assert_allclose(np.asarray(back[name]), t.numpy(), atol=1e-6, err_msg=name)
    cfg, params = load_params(path, dtype=jnp.float32, use_cache=False)
    # GGUF keeps no query_pre_attn_scalar: llama.cpp scales queries by head_dim ** -0.5 (27B
    # aside), as the loaded config does; no tokenizer here, so no bos or eos.
    gemma = kind.startswith("gemma")
    assert cfg == dataclasses.replace(
        cfg_h, bos_token_id=None, eos_token_ids=(),
        query_pre_attn_scalar=float(cfg_h.head_dim) if gemma else None)
    for name, a in common.flatten(params).items():   # Gemma's norms: the +1 taken off
        np.testing.assert_allclose(np.asarray(a), np.asarray(common.flatten(params_h)[name]),
                                   atol=1e-6, err_msg=name)
    if not gemma:
        assert_close(our_logits(cfg, params, PROMPTS[2]), hf_logits(model, PROMPTS[2]))


# ----------------------------------------------------------------------------- refused input


def _hf_config(kind, **over):
    _, kw = FAMILIES[kind]
    d = {k: v for k, v in kw.items() if k != "rope_scaling"}
    d["architectures"] = [ARCH[kind]]
    d.update(over)
    return d


@pytest.mark.parametrize("config, message", [
    (dict(architectures=["Qwen3MoeForCausalLM"]), "unsupported architecture 'Qwen3MoeForCausalLM'"),
    (dict(architectures=["LlavaForConditionalGeneration"]),
     "unsupported architecture 'LlavaForConditionalGeneration'"),
    (dict(architectures=["PhiForCausalLM"]), "supported: LlamaForCausalLM, MistralForCausalLM"),
    (dict(layer_types=["sliding_attention"] * 5 + ["chunked_attention"]),
     r"unsupported layer type\(s\) \['chunked_attention'\]"),
    (dict(layer_types=["full_attention"]), "layer_types has 1 entries for 6 layers"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping is set in a Gemma 3 config"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "unsupported MLP activation 'gelu'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported rope_scaling type 'yarn'"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "unsupported RoPE type 'linear' on sliding layers"),
])
def test_unsupported_configs_are_named(config, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_hf_config("gemma3", **config))


def test_unsupported_gguf_architecture_is_named(tmp_path):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gemma")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gemma'; supported: "
                                          "llama, qwen2, qwen3, gemma2, gemma3"):
        load_params(tmp_path / "m.gguf", use_cache=False)


def test_older_gemma3_config_reads_as_the_saved_one(family):
    """A Gemma 3 config.json as released (rope_theta, rope_local_base_freq, rope_scaling and
    sliding_window_pattern; no layer_types or rope_parameters) reads as transformers' own."""
    d, _, cfg, _ = family("gemma3")
    old = json.loads((d / "config.json").read_text())
    for k in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        old.pop(k, None)
    old.update(rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window_pattern=6,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert ModelConfig.from_hf(old) == cfg


def test_gemma3_multimodal_checkpoint_runs_its_language_model(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: its language model (tensors
    under language_model.model.*) loads as a Gemma3ForCausalLM and its text logits are
    transformers'; the vision tower and projector are left out. A text_config that gives only
    what differs from transformers' defaults (as released) reads the same."""
    import transformers

    _, kw = FAMILIES["gemma3"]
    # no final soft-cap: released Gemma 3 configs have none, and transformers' multimodal class
    # would not apply one
    text = transformers.Gemma3TextConfig(**dict(kw, num_hidden_layers=2, sliding_window_pattern=2,
                                                final_logit_softcapping=None))
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    torch.manual_seed(5)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=255,
        boi_token_index=253, eoi_token_index=254, eos_token_id=[2, 106]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 1.0 if "embed" in name else 0.1 if "norm" in name else 0.2)
    model.eval()
    model.save_pretrained(tmp_path / "mm")
    cfg, params = load_params(tmp_path / "mm", dtype=jnp.float32, use_cache=False)
    assert cfg.arch == "Gemma3ForCausalLM" and cfg.window_layers == (True, False)
    assert cfg.eos_token_ids == (2, 106) and cfg.sliding_window == 8
    assert not any("vision" in k for k in common.flatten(params))
    for ids in PROMPTS:
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
        assert_close(our_logits(cfg, params, ids), ref)
    d = json.loads((tmp_path / "mm" / "config.json").read_text())
    defaults = transformers.Gemma3TextConfig().to_dict()
    d["text_config"] = {k: v for k, v in d["text_config"].items() if v != defaults.get(k)}
    assert "head_dim" not in d["text_config"]   # 256 is the default
    assert ModelConfig.from_hf(d) == cfg


@pytest.mark.parametrize("m", [2, 4])
def test_blocked_layout_forward_equals_flat(m):
    """Tensor parallel's blocked weights (each block its heads' q, k and v) with q/k norms,
    windows and Gemma's norms: the forward on one device computes what the flat layout does."""
    from jaxspec.parallel.tensor_parallel import _blocked_layer

    cfg, params, _ = _agreeing_gemma3(window=3)
    cfg = dataclasses.replace(cfg, num_heads=8, num_kv_heads=4, head_dim=16)
    params = llama.init_random_params(cfg, jax.random.PRNGKey(3), scale=0.3)
    blocked = dict(params, layers=_blocked_layer(params["layers"], cfg, m))
    ids = jnp.asarray([PROMPTS[1][:12]], jnp.int32)
    pos = jnp.arange(12, dtype=jnp.int32)[None]
    cache = init_cache(cfg, 1, 8, jnp.float32)

    def run(p):
        h, kn, _, _ = llama.forward(p, cfg, ids, pos, cache.k, cache.v, cache.lens,
                                    llama.causal_mask(1, 12))
        return llama.lm_head(p, cfg, h), kn

    (a, ka), (b, kb) = run(params), run(blocked)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kb, ka, rtol=1e-5, atol=1e-5)


def _gguf_meta(arch, **keys):
    meta = {"general.architecture": arch, f"{arch}.embedding_length": 64,
            f"{arch}.attention.head_count": 4, f"{arch}.feed_forward_length": 128,
            f"{arch}.block_count": 6, f"{arch}.attention.key_length": 32}
    meta.update({f"{arch}.{k}": v for k, v in keys.items()})
    return meta


def test_gguf_gemma_rules_as_llama_cpp_loads_them():
    """What a Gemma GGUF leaves out, filled in as llama.cpp does: Gemma 3 slides five layers of
    six where a window is stored (none without), RoPE base 10000 there, no soft-cap; Gemma 2
    slides every other layer (4096 unless stored) and caps at 50 / 30; the query scale is
    head_dim's, but (hidden / heads)'s at the 27B layer counts; a stored pattern wins."""
    from jaxspec.config import model_config_from_gguf as read

    g3 = read(_gguf_meta("gemma3", **{"attention.sliding_window": 512}), vocab_size=9,
              tie_word_embeddings=True)
    assert g3.window_layers == (True,) * 5 + (False,) and g3.sliding_window == 512
    assert (g3.rope_local_theta, g3.rope_theta, g3.final_logit_softcap) == (10000.0, 1e6, None)
    assert g3.query_pre_attn_scalar == 32 and g3.qk_norm and g3.embed_scale == 8.0
    assert read(_gguf_meta("gemma3"), vocab_size=9,
                tie_word_embeddings=True).window_layers == (False,) * 6
    g2 = read(_gguf_meta("gemma2"), vocab_size=9, tie_word_embeddings=True)
    assert g2.window_layers == (True, False) * 3 and g2.sliding_window == 4096
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (50.0, 30.0) and not g2.qk_norm
    big = read(_gguf_meta("gemma3", block_count=62, **{"attention.sliding_window": 1024}),
               vocab_size=9, tie_word_embeddings=True)
    assert big.query_pre_attn_scalar == 64 / 4
    stored = read(_gguf_meta("gemma3", **{"attention.sliding_window": 8,
                                          "attention.sliding_window_pattern": 2}),
                  vocab_size=9, tie_word_embeddings=True)
    assert stored.window_layers == (True, False) * 3
    flags = [True, True, False, True, True, False]
    per_layer = read(_gguf_meta("gemma3", **{"attention.sliding_window": 8,
                                             "attention.sliding_window_pattern": flags}),
                     vocab_size=9, tie_word_embeddings=True)
    assert per_layer.window_layers == tuple(flags)
    with pytest.raises(ConfigError, match="sliding_window_pattern has 2 entries for 6 layers"):
        read(_gguf_meta("gemma3", **{"attention.sliding_window": 8,
                                     "attention.sliding_window_pattern": [True, False]}),
             vocab_size=9, tie_word_embeddings=True)


def test_llm_serves_a_gemma3_directory(family, tmp_path):
    """The engine (admission by chunks and packs, the cycle, the stop path) over a Gemma 3 HF
    directory with a random EAGLE-1 head: greedy outputs equal transformers'."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxspec import LLM, SamplingParams

    src, model, cfg, params = family("gemma3")
    d = tmp_path / "gemma3"
    shutil.copytree(src, d)
    raw = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(cfg.vocab_size)}, "<0>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<0>", bos_token="<1>",
                            eos_token="<2>").save_pretrained(d)
    head = eagle.init_eagle_params(cfg, jax.random.PRNGKey(1), scale=0.2)
    llm = LLM(str(d), draft=head, spec=SHAPES["tree"], dtype=jnp.float32, max_batch=2,
              max_model_len=MAX_LEN)
    assert llm.config == cfg
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    for ids, o in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
        assert o.token_ids == ref[0, len(ids):].tolist()



def test_llm_serves_a_gemma3_gguf_with_its_sentencepiece_vocabulary(family, tmp_path):
    """A Gemma GGUF carries a SentencePiece vocabulary (tokenizer model 'llama'): LLM builds it
    with transformers' GGUF reader, encodes text as transformers does, and its greedy output
    equals transformers' on the same ids."""
    from transformers import AutoTokenizer

    from jaxspec import LLM, SamplingParams

    _, model, cfg, _ = family("gemma3")
    model = model.float()
    vocab = sentencepiece_vocab(cfg.vocab_size)
    path = write_family_gguf(tmp_path / "gemma3.gguf", "gemma3", model, vocab)
    ref_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    llm = LLM(str(path), dtype=jnp.float32, max_batch=1, max_model_len=MAX_LEN)
    text = "Hello world the cat sat on a mat"
    ids = ref_tok(text)["input_ids"]
    assert ids[0] == 2 and 3 not in ids     # bos first; every word in the vocabulary
    out = llm.generate(text, SamplingParams(max_tokens=NEW, ignore_eos=True))[0]
    assert out.prompt_token_ids == ids
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
    assert out.token_ids == ref[0, len(ids):].tolist()
    assert out.text == ref_tok.decode(out.token_ids, skip_special_tokens=True)
