"""Public EAGLE-3 heads as their writers save them (SpecForge, SGLang, vLLM, the EAGLE repository)
for Llama-3.x-like targets and with Qwen3 heads' config fields: the head's forward equals a
reference written here from the published definition (numpy, fp64; SpecForge's
LlamaForCausalLMEagle3 / the EAGLE repository's cnets.Model, each with its own config rules), the
config fields (target layers, draft vocabulary, RoPE, head_dim) are read as each writer means
them, a head of the wrong version, architecture or size is refused with the field or tensor
named, and LLM(draft=<dir>) runs one on a tiny Llama target with greedy output equal to plain
greedy decoding."""
import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxspec.config import ModelConfig, RopeScaling
from jaxspec.loading.common import WeightsError
from jaxspec.loading.eagle3_ckpt import load_eagle3_head
from jaxspec.loading.eagle_ckpt import load_draft, load_eagle1
from jaxspec.models import eagle3, llama

V, H, L = 97, 32, 8
LLAMA3 = RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=32)
# A Llama 3.x-shaped target: RoPE theta 5e5 with llama3 scaling (short original context, so the
# scaled frequencies show at the test's positions).
TARGET = ModelConfig(arch="LlamaForCausalLM", vocab_size=V, hidden_size=H, intermediate_size=64,
                     num_layers=L, num_heads=4, num_kv_heads=2, head_dim=8,
                     rope_theta=500000.0, rope_scaling=LLAMA3,
                     max_position_embeddings=256)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


# ---------------------------------------------------------------- heads as their writers save them


def random_head(seed, *, h=H, heads=4, kv=2, d=8, f=48, vd=40, target_h=H, embed=False):
    """Canonical-name tensors (SpecForge's) of a random head; d2t / t2d of a random draft
    vocabulary of vd ids (none when vd == V)."""
    rng = np.random.default_rng(seed)
    w = lambda o, i: (rng.standard_normal((o, i)) * 0.6 / np.sqrt(i)).astype(np.float32)  # noqa
    n = lambda: (1 + 0.2 * rng.standard_normal(h)).astype(np.float32)  # noqa: E731
    m, a = "midlayer.", "midlayer.self_attn."
    sd = {"fc.weight": w(h, 3 * target_h), m + "input_layernorm.weight": n(),
          m + "hidden_norm.weight": n(), a + "q_proj.weight": w(heads * d, 2 * h),
          a + "k_proj.weight": w(kv * d, 2 * h), a + "v_proj.weight": w(kv * d, 2 * h),
          a + "o_proj.weight": w(h, heads * d), m + "post_attention_layernorm.weight": n(),
          m + "mlp.gate_proj.weight": w(f, h), m + "mlp.up_proj.weight": w(f, h),
          m + "mlp.down_proj.weight": w(h, f), "norm.weight": n(), "lm_head.weight": w(vd, h)}
    if embed:
        sd["embed_tokens.weight"] = rng.standard_normal((V, h)).astype(np.float32)
    if vd < V:
        ids = np.sort(rng.choice(V, vd, replace=False))
        sd["d2t"] = (ids - np.arange(vd)).astype(np.int64)
        t2d = np.zeros(V, bool)
        t2d[ids] = True
        sd["t2d"] = t2d
    return sd


def renamed(sd, naming):
    """SpecForge / the EAGLE repository: as is; SGLang: "model." before all but lm_head and the
    vocabulary maps; vLLM: "midlayer." as "layers.0."."""
    if naming == "sglang":
        return {(k if k in ("lm_head.weight", "d2t", "t2d") else "model." + k): v
                for k, v in sd.items()}
    if naming == "vllm":
        return {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}
    return dict(sd)


def write_head(d, sd, config, naming="specforge", fmt="safetensors", dtype=None):
    d.mkdir(parents=True, exist_ok=True)
    sd = renamed(sd, naming)
    if fmt == "safetensors":
        from safetensors.numpy import save_file
        cast = (lambda x: x.astype(dtype) if dtype is not None and x.dtype.kind == "f" else x)
        save_file({k: cast(v) for k, v in sd.items()}, str(d / "model.safetensors"))
    else:  # the EAGLE repository's torch.save of a state dict
        import torch
        torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()},
                   d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps(config))
    return d


def specforge_config(**kw):
    """As SpecForge's configs/llama3-70B-eagle3.json (scaled down)."""
    c = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "intermediate_size": 48, "num_hidden_layers": 1, "hidden_act": "silu",
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
         "rope_scaling": LLAMA3_SCALING, "tie_word_embeddings": False, "vocab_size": V,
         "draft_vocab_size": 40, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}
    return {**c, **kw}


def eagle_repo_config(**kw):
    """As the EAGLE repository's eagle/traineagle3/config.json (yuhuili/EAGLE3-LLaMA3.1-Instruct-
    8B's): the target's class, no rope_theta, head_dim or rope_scaling."""
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
         "hidden_size": H, "intermediate_size": 48, "max_position_embeddings": 2048,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
         "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "vocab_size": V,
         "draft_vocab_size": 40}
    return {**c, **kw}


def qwen3_config(**kw):
    """As SpecForge's configs/qwen3-4b-eagle3.json (scaled down): head_dim 16, not hidden /
    heads, RoPE theta 1e6, eps 1e-6, Qwen's extra fields."""
    c = specforge_config(head_dim=16, rms_norm_eps=1e-06, rope_theta=1000000, rope_scaling=None,
                         max_position_embeddings=40960, attention_bias=False,
                         attention_dropout=0.0, max_window_layers=36, sliding_window=None,
                         use_sliding_window=False)
    c.pop("eagle_config")
    return {**c, **kw}


# name: (writer whose rules the reference follows, naming, file format, tensors, config.json,
#        tensor dtype on disk)
HEADS = {
    "specforge-llama3": ("specforge", "specforge", "safetensors", dict(seed=1),
                         specforge_config(), None),
    "eagle-repo-llama3.1": ("eagle", "eagle", "bin", dict(seed=2), eagle_repo_config(), None),
    "eagle-repo-whole-vocab": ("eagle", "eagle", "bin", dict(seed=3, vd=V),
                               eagle_repo_config(draft_vocab_size=V), None),
    "sglang-names-rope-parameters-bf16": (
        "specforge", "sglang", "safetensors", dict(seed=4, embed=True),
        specforge_config(rope_theta=None, rope_scaling=None, rope_parameters={
            "rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}), ml_dtypes.bfloat16),
    "vllm-names-norm-before-residual": (
        "specforge", "vllm", "safetensors", dict(seed=5),
        {**specforge_config(architectures=["Eagle3LlamaForCausalLM"], norm_before_residual=True,
                            eagle_aux_hidden_state_layer_ids=[0, 4, 7]),
         "eagle_config": None}, None),
    "specforge-qwen3": ("specforge", "specforge", "safetensors", dict(seed=6, d=16),
                        qwen3_config(), None),
    "eagle-repo-qwen3": ("eagle", "eagle", "bin", dict(seed=7, d=8),
                         qwen3_config(architectures=["LlamaForCausalLMEagle3"]), None),
    "wider-than-target": ("specforge", "specforge", "safetensors",
                          dict(seed=8, h=48, d=12, embed=True),
                          specforge_config(hidden_size=48, head_dim=12, target_hidden_size=H),
                          None),
}


# ---------------------------------------------------------------- the reference


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _writer_rules(writer, conf):
    """(head_dim, eps, theta, scaling dict or None) as `writer` reads config.json: SpecForge
    (get_rope_config; head_dim if given), the EAGLE repository (cnets.LlamaAttention: head_dim
    = hidden / heads, rope_theta if present, rope_scaling["type"] linear / dynamic)."""
    h, heads = conf["hidden_size"], conf["num_attention_heads"]
    eps = conf.get("rms_norm_eps", 1e-6)
    if writer == "eagle":
        return h // heads, eps, conf.get("rope_theta", 10000), conf.get("rope_scaling")
    rp = conf.get("rope_parameters")
    if rp:
        return conf.get("head_dim", h // heads), eps, rp["rope_theta"], rp
    return (conf.get("head_dim", h // heads), eps, conf.get("rope_theta") or 10000,
            conf.get("rope_scaling"))


def _rope_angles(positions, d, theta, scaling):
    """[n, d/2] angles: SpecForge's LlamaRotaryEmbedding (llama3 frequency blend) and
    LlamaLinearScalingRotaryEmbedding (positions / factor)."""
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    t = np.asarray(positions, np.float64)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "llama3":
        s = scaling
        low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
        high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
        wave = 2 * np.pi / inv
        smooth = (s["original_max_position_embeddings"] / wave - s["low_freq_factor"]) / (
            s["high_freq_factor"] - s["low_freq_factor"])
        inv = np.where(wave < high_wl, inv, np.where(
            wave > low_wl, inv / s["factor"], (1 - smooth) * inv / s["factor"] + smooth * inv))
    elif kind == "linear":
        t = t / scaling["factor"]
    else:
        assert kind == "default", kind
    return t[:, None] * inv[None]


def _rotate(x, ang):
    """x [n, heads, d], rotate-half layout."""
    c = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, None]
    s = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, None]
    half = x.shape[-1] // 2
    return x * c + np.concatenate([-x[..., half:], x[..., :half]], -1) * s


def reference_head(sd, conf, writer, target_embed, tokens, aux, positions, rope=None):
    """The head's midlayer over a causal sequence, fp64: rows (token t, target layers at t) at
    RoPE positions -> (output before the final norm [n, H], draft logits [n, Vd], target ids
    of the draft argmax [n]). sd: canonical names. rope: (theta, scaling) overriding the
    config's (to show what a wrong RoPE changes)."""
    t = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    d, eps, theta, scaling = _writer_rules(writer, conf)
    if rope is not None:
        theta, scaling = rope
    heads = conf["num_attention_heads"]
    kv = conf.get("num_key_value_heads", heads)
    n = len(tokens)
    m, a = "midlayer.", "midlayer.self_attn."
    emb = t.get("embed_tokens.weight", np.asarray(target_embed, np.float64))
    h = np.asarray(aux, np.float64) @ t["fc.weight"].T
    hn = _rms(h, t[m + "hidden_norm.weight"], eps)
    residual = hn if conf.get("norm_before_residual") else h
    x = np.concatenate([_rms(emb[tokens], t[m + "input_layernorm.weight"], eps), hn], -1)
    q = (x @ t[a + "q_proj.weight"].T).reshape(n, heads, d)
    k = (x @ t[a + "k_proj.weight"].T).reshape(n, kv, d)
    v = (x @ t[a + "v_proj.weight"].T).reshape(n, kv, d)
    ang = _rope_angles(positions, d, theta, scaling)
    q, k = _rotate(q, ang), _rotate(k, ang)
    k, v = np.repeat(k, heads // kv, 1), np.repeat(v, heads // kv, 1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", p, v).reshape(n, heads * d) @ t[a + "o_proj.weight"].T
    residual = residual + o
    z = _rms(residual, t[m + "post_attention_layernorm.weight"], eps)
    g = z @ t[m + "mlp.gate_proj.weight"].T
    mlp = (g / (1 + np.exp(-g)) * (z @ t[m + "mlp.up_proj.weight"].T)) @ t[
        m + "mlp.down_proj.weight"].T
    out = residual + mlp
    logits = _rms(out, t["norm.weight"], eps) @ t["lm_head.weight"].T
    best = logits.argmax(-1)
    ids = best + (sd["d2t"][best] if "d2t" in sd else 0)
    return out, logits, ids


def jaxspec_head(head, target_embed, tokens, aux, positions):
    """The cached inference forward (`eagle3.forward`, tree attention over an empty draft cache,
    causal rows) -> (out [n, H], draft logits [n, Vd], target ids of the draft argmax)."""
    hc = head.config
    n = len(tokens)
    cache = jnp.zeros((1, 1, hc.num_kv_heads, 32, hc.head_dim), jnp.float32)
    out, _, _ = eagle3.forward({"embed": jnp.asarray(target_embed)}, head, TARGET,
                               jnp.asarray(tokens)[None], jnp.asarray(aux, jnp.float32)[None],
                               jnp.asarray(positions, jnp.int32)[None], cache, cache,
                               jnp.zeros((1,), jnp.int32), llama.causal_mask(1, n))
    logits = eagle3.logits(head, out)[0]
    return (np.asarray(out[0]), np.asarray(logits),
            np.asarray(eagle3.to_target(head, jnp.argmax(logits, -1))))


def _inputs(seed, n=12, start=20):
    rng = np.random.default_rng(100 + seed)
    embed = rng.standard_normal((V, H)).astype(np.float32)
    tokens = rng.integers(0, V, n)
    aux = rng.standard_normal((n, 3 * H)).astype(np.float32)
    return embed, tokens, aux, np.arange(start, start + n)


def _on_disk(sd, dtype):
    """The tensors as the file holds them (bf16-rounded floats where saved in bf16)."""
    if dtype is None:
        return sd
    return {k: (v.astype(dtype).astype(np.float32) if v.dtype.kind == "f" else v)
            for k, v in sd.items()}


@pytest.mark.parametrize("name", list(HEADS))
def test_head_forward_matches_the_public_definition(tmp_path, name):
    writer, naming, fmt, spec, conf, dtype = HEADS[name]
    sd = random_head(**spec)
    path = write_head(tmp_path / name, sd, conf, naming, fmt, dtype)
    head = load_draft(path, TARGET)
    assert isinstance(head, eagle3.Eagle3Head)
    sd = _on_disk(sd, dtype)
    embed, tokens, aux, pos = _inputs(spec["seed"])
    ref_out, ref_logits, ref_ids = reference_head(sd, conf, writer, embed, tokens, aux, pos)
    out, logits, ids = jaxspec_head(head, embed, tokens, aux, pos)
    np.testing.assert_allclose(out, ref_out, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(logits, ref_logits, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(ids, ref_ids)
    # The comparison sees RoPE: the target's (theta 5e5, llama3 scaling), LlamaConfig's default
    # (1e4) or the head's theta without its scaling would each be told apart.
    theta, scaling = _writer_rules(writer, conf)[2:]
    for wrong in {(TARGET.rope_theta, json.dumps(LLAMA3_SCALING)), (10000.0, "null"),
                  (theta, "null")} - {(theta, json.dumps(scaling))}:
        bad, _, _ = reference_head(sd, conf, writer, embed, tokens, aux, pos,
                                   rope=(wrong[0], json.loads(wrong[1])))
        assert np.abs(bad - ref_out).max() > 20 * 2e-4, wrong


def test_config_fields_are_read_as_each_writer_means_them(tmp_path):
    """head_dim, RoPE, epsilon, target layers, draft vocabulary and residual variant of the
    heads above, as Eagle3Config holds them."""
    def head_of(name):
        writer, naming, fmt, spec, conf, dtype = HEADS[name]
        return load_draft(write_head(tmp_path / name, random_head(**spec), conf, naming, fmt,
                                     dtype), TARGET)

    sf = head_of("specforge-llama3").config
    assert (sf.head_dim, sf.rope_theta, sf.rope_scaling, sf.rms_norm_eps, sf.aux_layers,
            sf.draft_vocab_size, sf.intermediate_size) == (
        8, 500000.0, TARGET.rope_scaling, 1e-5, (1, 3, 5), 40, 48)
    er = head_of("eagle-repo-llama3.1").config   # LlamaConfig's defaults, not the target's
    assert (er.rope_theta, er.rope_scaling, er.aux_layers) == (10000.0, None, (1, 3, 4))
    whole = head_of("eagle-repo-whole-vocab")      # no d2t / t2d: the identity map
    assert whole.config.draft_vocab_size == V
    np.testing.assert_array_equal(eagle3.to_target(whole, jnp.arange(V)), np.arange(V))
    assert bool(whole.params["t2d"].all())
    assert head_of("sglang-names-rope-parameters-bf16").config.rope_scaling == RopeScaling(
        kind="linear", factor=2.0)
    vl = head_of("vllm-names-norm-before-residual").config
    assert vl.norm_before_residual and vl.aux_layers == (0, 4, 7)
    q3 = head_of("specforge-qwen3").config
    assert (q3.head_dim, q3.rope_theta, q3.rms_norm_eps, q3.aux_layers) == (
        16, 1e6, 1e-6, (1, 3, 4))
    assert head_of("eagle-repo-qwen3").config.head_dim == 8    # hidden / heads, as q_proj has
    wide = head_of("wider-than-target").config
    assert (wide.hidden_size, wide.target_hidden_size, wide.feature_width) == (48, H, 3 * H)
    # SpecForge's rule for the layers it trains a head on: 1, L/2 - 1, L - 4
    assert eagle3.default_aux_layers(32) == (1, 15, 28)      # Llama-3.1-8B
    assert eagle3.default_aux_layers(36) == (1, 17, 32)      # Qwen3-8B


# ---------------------------------------------------------------- refusals


def _eagle1_state_dict(seed):
    rng = np.random.default_rng(seed)
    w = lambda o, i: (0.1 * rng.standard_normal((o, i))).astype(np.float32)  # noqa: E731
    a, m = "layers.0.self_attn.", "layers.0.mlp."
    return {"fc.weight": w(H, 2 * H), "fc.bias": w(1, H)[0], a + "q_proj.weight": w(H, H),
            a + "k_proj.weight": w(16, H), a + "v_proj.weight": w(16, H),
            a + "o_proj.weight": w(H, H), m + "gate_proj.weight": w(64, H),
            m + "up_proj.weight": w(64, H), m + "down_proj.weight": w(H, 64),
            "layers.0.post_attention_layernorm.weight": np.ones(H, np.float32)}


def test_the_other_version_is_refused_saying_which(tmp_path):
    """An EAGLE-3 head where EAGLE-1 is expected and the reverse, and config.json naming one
    version over the other's tensors: each error says what the file is."""
    e3 = write_head(tmp_path / "e3", random_head(1), specforge_config())
    e1 = write_head(tmp_path / "e1", _eagle1_state_dict(0), eagle_repo_config(
        draft_vocab_size=None, intermediate_size=64))
    with pytest.raises(WeightsError, match=r"e3: an EAGLE-3 head \(tensors d2t, "
                                           r"midlayer.hidden_norm.weight, t2d\), not an EAGLE-1"):
        load_eagle1(e3, TARGET)
    with pytest.raises(WeightsError, match=r"e1: an EAGLE-1 head \(fc.weight \(32, 64\), .*and "
                                           r"no hidden_norm, d2t or t2d\), not an EAGLE-3 one"):
        load_eagle3_head(e1, TARGET)
    # LLM(draft=...) goes by the tensors, and refuses a config.json that says otherwise
    assert isinstance(load_draft(e1, TARGET), dict)
    (e1 / "config.json").write_text(json.dumps(specforge_config()))
    with pytest.raises(WeightsError, match=r"architectures=\['LlamaForCausalLMEagle3'\] name an "
                                           r"EAGLE-3 head but its tensors are an EAGLE-1 head's"):
        load_draft(e1, TARGET)
    (e3 / "config.json").write_text(json.dumps(specforge_config(
        architectures=["LlamaForCausalLMEagle"])))
    with pytest.raises(WeightsError, match=r"architectures=\['LlamaForCausalLMEagle'\] name an "
                                           r"EAGLE-1 head but its tensors are an EAGLE-3 head's"):
        load_draft(e3, TARGET)


BIG = ModelConfig(arch="LlamaForCausalLM", vocab_size=V, hidden_size=48, intermediate_size=64,
                  num_layers=L, num_heads=4, num_kv_heads=2, head_dim=12)


@pytest.mark.parametrize("target,tensors,config,match", [
    # fits the target: the fc input width, the vocabulary, the target layers
    (BIG, {}, {}, r"tensor 'fc.weight' has shape \(32, 96\): it reads three target layers of "
                  r"width 32, the target's hidden_size is 48 \(expected \(32, 144\)\)"),
    (TARGET, {"seed": 1, "target_h": H}, {"target_hidden_size": 48},
     r"config.json target_hidden_size=48 but the target's hidden_size is 32"),
    (TARGET, {"seed": 1, "h": 48, "d": 12, "target_h": H}, {"hidden_size": 48, "head_dim": 12},
     r"config.json hidden_size=48 \(no target_hidden_size\) but the target's hidden_size is 32"),
    (TARGET, {"seed": 1, "h": 48, "d": 12, "target_h": H},
     {"hidden_size": 48, "head_dim": 12, "target_hidden_size": H},
     r"hidden_size=48 differs from the target's 32 and it has no embed_tokens.weight"),
    (TARGET, {}, {"vocab_size": 96}, r"config.json vocab_size=96 but the target has "
                                     r"vocab_size=97"),
    (TARGET, {}, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 8]}},
     r"eagle_aux_hidden_state_layer_ids=\[1, 3, 8\]: an EAGLE-3 head reads three target layers "
     r"in \[0, 8\) \(the target has num_layers=8\)"),
    (TARGET, {}, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3]}},
     r"eagle_aux_hidden_state_layer_ids=\[1, 3\]: an EAGLE-3 head reads three"),
    (TARGET, {"seed": 1, "d": 6}, {}, r"tensor 'midlayer.self_attn.q_proj.weight' has 24 rows, "
                                      r"expected num_attention_heads=4 x head_dim=8 = 32"),
    # architectures and variants the layer does not implement
    (TARGET, {}, {"architectures": ["DeepseekV3ForCausalLMEagle3"]},
     r"architectures=\['DeepseekV3ForCausalLMEagle3'\]: not a supported EAGLE-3 head; "
     r"supported: LlamaForCausalLMEagle3, Eagle3LlamaForCausalLM, LlamaForCausalLM"),
    (TARGET, {}, {"model_type": "llama4_text"}, r"model_type='llama4_text'"),
    (TARGET, {}, {"num_hidden_layers": 2}, r"num_hidden_layers=2: an EAGLE-3 head of more than "
                                           r"one decoder layer is not supported"),
    (TARGET, {}, {"fc_norm": True}, r"fc_norm=True: norms on the target layers before fc "
                                    r"\(SpecForge's EAGLE-3.1\) is not supported"),
    (TARGET, {}, {"tie_word_embeddings": True}, r"tie_word_embeddings=True"),
    (TARGET, {}, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_scaling type 'yarn' is not supported for an EAGLE-3 head \(llama3, linear\)"),
    (TARGET, {}, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     r"rope_scaling of type 'llama3' has no low_freq_factor"),
    (TARGET, {}, {"transformer_layer_config": {"hidden_size": H}},
     r"a speculators-format config.json .* is not read"),
    (TARGET, {}, {"eagle_config": {"use_aux_hidden_state": False}},
     r"use_aux_hidden_state=False"),
    (TARGET, {}, {"hidden_size": None}, r"config.json hidden_size=None, expected a positive"),
])
def test_a_head_that_does_not_fit_is_refused_naming_why(tmp_path, target, tensors, config,
                                                        match):
    sd = random_head(**{"seed": 1, **tensors})
    path = write_head(tmp_path / "h", sd, specforge_config(**config))
    with pytest.raises(WeightsError, match=match):
        load_draft(path, target)


def test_tensors_the_layer_has_no_place_for_are_named(tmp_path):
    """A second decoder layer, EAGLE-3.1's fc norms, a missing d2t, a t2d that marks other ids
    than d2t maps to: named, with the file."""
    sd = random_head(1)
    for i, (extra, match) in enumerate((
            ({"layers.1.mlp.up_proj.weight": np.zeros((48, H), np.float32)},
             r"h0: unexpected tensor\(s\) \['layers.1.mlp.up_proj.weight'\]"),
            ({"fc_norm.0.weight": np.ones(H, np.float32)},
             r"h1: unexpected tensor\(s\) \['fc_norm.0.weight'\]"))):
        with pytest.raises(WeightsError, match=match):
            load_draft(write_head(tmp_path / f"h{i}", {**sd, **extra}, specforge_config()),
                       TARGET)
    no_map = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    with pytest.raises(WeightsError, match=r"h2: missing tensor 'd2t'"):
        load_draft(write_head(tmp_path / "h2", no_map, specforge_config()), TARGET)
    other = np.roll(sd["t2d"], 1)              # as many marks, not all on d2t's ids
    assert not other[sd["t2d"]].all()
    with pytest.raises(WeightsError, match=r"h3: tensors 'd2t' and 't2d' disagree"):
        load_draft(write_head(tmp_path / "h3", {**sd, "t2d": other}, specforge_config()),
                   TARGET)


def test_eagle1_unsupported_architecture_is_named(tmp_path):
    path = write_head(tmp_path / "e1", _eagle1_state_dict(0), eagle_repo_config(
        architectures=["MixtralForCausalLM"], draft_vocab_size=None, intermediate_size=64))
    with pytest.raises(WeightsError, match=r"architectures=\['MixtralForCausalLM'\]: not a "
                                           r"supported EAGLE-1 head"):
        load_draft(path, TARGET)


def test_a_head_wider_than_its_target_runs_the_cycle(tmp_path):
    """A head of hidden size 48 on a 32-wide target (target_hidden_size, its own embedding):
    the speculative cycle runs it (fc reads the target's layers, later steps the head's own
    output) and greedy output equals plain greedy decoding."""
    import jax

    from jaxspec.spec import SpecConfig
    from reference_runner import SpecRunner, plain_greedy

    writer, naming, fmt, spec, conf, dtype = HEADS["wider-than-target"]
    head = load_draft(write_head(tmp_path / "w", random_head(**spec), conf), TARGET)
    params = llama.init_random_params(TARGET, jax.random.PRNGKey(0), scale=0.2)
    prompts = [[5, 17, 42, 8, 9], list(range(30, 50))]
    runner = SpecRunner(TARGET, params, head, SpecConfig(3, 2, 5), max_slots=2, max_len=96)
    for p, r in zip(prompts, runner.generate(prompts, [12, 12], eos_ids=())):
        assert r.token_ids == plain_greedy(params, TARGET, p, 12, 96)


# ---------------------------------------------------------------- through LLM


def _write_hf_llama(d, cfg, params, bos=0, eos=1):
    """A tiny Llama as transformers saves one: config.json, model.safetensors (torch [out, in]
    names) and a word-level tokenizer of tokens "<i>"."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(cfg.vocab_size)}, "<0>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<0>", bos_token=f"<{bos}>",
                            eos_token=f"<{eos}>").save_pretrained(d)
    a = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    q, kv, f = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    lay = params["layers"]
    sd = {"model.embed_tokens.weight": a(params["embed"]), "model.norm.weight":
          a(params["final_norm"]), "lm_head.weight": a(params["lm_head"]).T.copy()}
    for i in range(cfg.num_layers):
        p, w = f"model.layers.{i}.", np.asarray(lay["wqkv"][i])
        sd.update({p + "input_layernorm.weight": a(lay["attn_norm"][i]),
                   p + "post_attention_layernorm.weight": a(lay["mlp_norm"][i]),
                   p + "self_attn.q_proj.weight": a(w[:, :q].T),
                   p + "self_attn.k_proj.weight": a(w[:, q:q + kv].T),
                   p + "self_attn.v_proj.weight": a(w[:, q + kv:].T),
                   p + "self_attn.o_proj.weight": a(np.asarray(lay["wo"][i]).T),
                   p + "mlp.gate_proj.weight": a(np.asarray(lay["w_gate_up"][i])[:, :f].T),
                   p + "mlp.up_proj.weight": a(np.asarray(lay["w_gate_up"][i])[:, f:].T),
                   p + "mlp.down_proj.weight": a(np.asarray(lay["w_down"][i]).T)})
    save_file(sd, str(d / "model.safetensors"))
    rs = cfg.rope_scaling
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": f, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": False, "bos_token_id": bos,
        "eos_token_id": eos, "rope_scaling": {
            "rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings}}))
    return d


def test_llm_runs_a_public_head_on_a_llama3_target(tmp_path):
    """LLM(draft=<dir>) with an EAGLE-3 head in vLLM's names and LlamaConfig defaults (RoPE
    theta 1e4 while its Llama-3.x target runs 5e5 with llama3 scaling), built to agree with its
    target (draft_models.agreeing_eagle3_pair): greedy output equals plain greedy decoding, and
    the head's drafts are accepted (3.8 of 4 per cycle when measured)."""
    from draft_models import agreeing_eagle3_pair
    from jaxspec import LLM, SamplingParams
    from jaxspec.loading.eagle3_ckpt import eagle3_state_dict
    from jaxspec.spec import SpecConfig
    from reference_runner import plain_greedy

    cfg = ModelConfig(arch="LlamaForCausalLM", vocab_size=211, hidden_size=64,
                      intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2,
                      head_dim=16, rope_theta=500000.0,
                      rope_scaling=LLAMA3,
                      max_position_embeddings=512)
    params, head = agreeing_eagle3_pair(cfg, scale=0.02, lm_head_scale=0.5)
    target = _write_hf_llama(tmp_path / "target", cfg, params)
    hc = head.config
    write_head(tmp_path / "head", eagle3_state_dict(head), {
        "architectures": ["Eagle3LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hc.hidden_size, "num_attention_heads": 1, "num_key_value_heads": 1,
        "intermediate_size": hc.intermediate_size, "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": hc.draft_vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps, "norm_before_residual": True}, naming="vllm")
    llm = LLM(str(target), draft=str(tmp_path / "head"), spec=SpecConfig(4, 2, 6),
              dtype=jnp.float32, max_batch=2, max_model_len=128)
    got = llm.engine.backend.draft_params.config
    assert (got.rope_theta, got.rope_scaling, got.aux_layers) == (10000.0, None, (1, 1, 0))
    prompts = [[5, 17, 42, 8, 99, 3], list(range(60, 80))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == plain_greedy(llm.params, llm.config, p, 24, 128)
    accepted = [a for o in outs for a in o.accept_lens]
    assert np.mean(accepted) >= 2.0, accepted
