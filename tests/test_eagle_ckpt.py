"""Public EAGLE-1 / EAGLE-3 checkpoints: synthetic files written in the published layouts
(safetensors and torch .bin, with config.json) convert to our params exactly; wrong shapes,
dtypes and missing tensors are named."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.loading.common import WeightsError
from jaxspec.loading.eagle_ckpt import load_eagle1, load_eagle3
from jaxspec.models import eagle, llama

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=67, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
QWEN = ModelConfig(arch="Qwen2ForCausalLM", vocab_size=67, hidden_size=32, intermediate_size=48,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)
H, F, Q, KV = 32, 48, 32, 16


def rnd(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def eagle1_state_dict(rng, bias=False):
    sd = {"fc.weight": rnd(rng, H, 2 * H), "fc.bias": rnd(rng, H),
          "embed_tokens.weight": rnd(rng, 67, H),
          "layers.0.self_attn.q_proj.weight": rnd(rng, Q, H),
          "layers.0.self_attn.k_proj.weight": rnd(rng, KV, H),
          "layers.0.self_attn.v_proj.weight": rnd(rng, KV, H),
          "layers.0.self_attn.o_proj.weight": rnd(rng, H, Q),
          "layers.0.mlp.gate_proj.weight": rnd(rng, F, H),
          "layers.0.mlp.up_proj.weight": rnd(rng, F, H),
          "layers.0.mlp.down_proj.weight": rnd(rng, H, F),
          "layers.0.post_attention_layernorm.weight": rnd(rng, H)}
    if bias:
        for n, s in (("q", Q), ("k", KV), ("v", KV)):
            sd[f"layers.0.self_attn.{n}_proj.bias"] = rnd(rng, s)
    return sd


def write(tmp, sd, fmt, config=None):
    tmp.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.numpy import save_file
        save_file(sd, str(tmp / "model.safetensors"))
    else:
        import torch
        torch.save({k: torch.from_numpy(np.asarray(v)) for k, v in sd.items()},
                   tmp / "pytorch_model.bin")
    (tmp / "config.json").write_text(json.dumps(config or {
        "architectures": ["LlamaForCausalLM"], "hidden_size": H, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": F, "vocab_size": 67}))
    return tmp


def torch_reference_eagle1(sd, tokens, features, embed):
    """The EAGLE-1 reference head in torch (cnets.py semantics), no cache, causal, RoPE at
    positions 0..n-1 (theta 10000, rotate-half)."""
    torch = pytest.importorskip("torch")
    t = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in sd.items()}
    x = torch.cat([torch.from_numpy(embed[tokens]), torch.from_numpy(features)], -1)
    x = x @ t["fc.weight"].T + t["fc.bias"]                                  # [n, H]
    n = x.shape[0]
    q = (x @ t["layers.0.self_attn.q_proj.weight"].T).view(n, 4, 8)
    k = (x @ t["layers.0.self_attn.k_proj.weight"].T).view(n, 2, 8)
    v = (x @ t["layers.0.self_attn.v_proj.weight"].T).view(n, 2, 8)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    ang = torch.arange(n).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    rot = lambda a: torch.cat([-a[..., 4:], a[..., :4]], -1)  # noqa: E731
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / 8 ** 0.5
    s = s.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool)), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, Q)
    h = x + o @ t["layers.0.self_attn.o_proj.weight"].T
    hn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * t[
        "layers.0.post_attention_layernorm.weight"]
    g = hn @ t["layers.0.mlp.gate_proj.weight"].T
    u = hn @ t["layers.0.mlp.up_proj.weight"].T
    return (h + (torch.nn.functional.silu(g) * u) @ t["layers.0.mlp.down_proj.weight"].T).numpy()


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle1_checkpoint_matches_reference_forward(tmp_path, fmt):
    rng = np.random.default_rng(0)
    sd = eagle1_state_dict(rng)
    sd = {k: v * 0.2 if v.ndim == 2 else 1 + 0.1 * v for k, v in sd.items()}
    path = write(tmp_path / fmt, sd, fmt)
    draft = load_eagle1(path, CFG)
    np.testing.assert_array_equal(draft["fc"], sd["fc.weight"].T)
    np.testing.assert_array_equal(draft["layers"]["w_down"][0], sd["layers.0.mlp.down_proj.weight"].T)
    cfg = ModelConfig(**{**CFG.__dict__, "rope_theta": 10000.0, "rms_norm_eps": 1e-6})
    params = llama.init_random_params(cfg, jax.random.PRNGKey(0))
    params["embed"] = jnp.asarray(sd["embed_tokens.weight"])
    n = 7
    tokens = rng.integers(0, 67, n)
    feats = rnd(rng, n, H)
    cache = jnp.zeros((1, 1, 2, 16, 8), jnp.float32)
    ours, _, _ = eagle.forward(params, draft, cfg, jnp.asarray(tokens)[None], jnp.asarray(feats)[None],
                               jnp.arange(n)[None], cache, cache, jnp.zeros((1,), jnp.int32),
                               llama.causal_mask(1, n))
    ref = torch_reference_eagle1(sd, tokens, feats, sd["embed_tokens.weight"])
    np.testing.assert_allclose(np.asarray(ours[0]), ref, rtol=1e-4, atol=1e-4)


def test_eagle1_qwen_biases_and_missing_fc_bias(tmp_path):
    rng = np.random.default_rng(1)
    sd = eagle1_state_dict(rng, bias=True)
    del sd["fc.bias"]
    draft = load_eagle1(write(tmp_path, sd, "safetensors"), QWEN)
    np.testing.assert_array_equal(draft["fc_bias"], np.zeros(H))
    np.testing.assert_array_equal(draft["layers"]["bqkv"][0], np.concatenate(
        [sd[f"layers.0.self_attn.{n}_proj.bias"] for n in "qkv"]))
    with pytest.raises(WeightsError, match="biases but the target has none"):
        load_eagle1(tmp_path, CFG)


def test_eagle1_bf16_bin(tmp_path):
    torch = pytest.importorskip("torch")
    sd = eagle1_state_dict(np.random.default_rng(2))
    tmp_path.mkdir(exist_ok=True)
    torch.save({k: torch.from_numpy(v).bfloat16() for k, v in sd.items()}, tmp_path / "pytorch_model.bin")
    draft = load_eagle1(tmp_path / "pytorch_model.bin", CFG, dtype=jnp.bfloat16)
    assert draft["fc"].dtype == jnp.bfloat16
    want = torch.from_numpy(sd["fc.weight"]).bfloat16().float().numpy().T
    np.testing.assert_array_equal(np.asarray(draft["fc"], np.float32), want)


@pytest.mark.parametrize("name,shape,match", [
    ("layers.0.self_attn.k_proj.weight", (KV + 8, H), "k_proj.weight.*shape"),
    ("fc.weight", (H, 3 * H), "'fc.weight' has shape"),
    ("layers.0.mlp.up_proj.weight", None, "missing tensor 'layers.0.mlp.up_proj.weight'"),
])
def test_eagle1_bad_tensor_is_named(tmp_path, name, shape, match):
    sd = eagle1_state_dict(np.random.default_rng(3))
    if shape is None:
        del sd[name]
    else:
        sd[name] = np.zeros(shape, np.float32)
    with pytest.raises(WeightsError, match=match):
        load_eagle1(write(tmp_path, sd, "safetensors"), CFG)


def test_eagle1_wrong_dtype_and_config(tmp_path):
    sd = eagle1_state_dict(np.random.default_rng(4))
    sd["fc.bias"] = np.zeros(H, np.int32)
    with pytest.raises(WeightsError, match="'fc.bias' has dtype int32"):
        load_eagle1(write(tmp_path / "a", sd, "safetensors"), CFG)
    sd = eagle1_state_dict(np.random.default_rng(4))
    cfg_json = {"hidden_size": 64}
    with pytest.raises(WeightsError, match="hidden_size=64"):
        load_eagle1(write(tmp_path / "b", sd, "safetensors", cfg_json), CFG)


def test_eagle1_rejects_eagle3_file(tmp_path):
    sd = eagle1_state_dict(np.random.default_rng(5))
    sd["midlayer.hidden_norm.weight"] = np.ones(H, np.float32)
    with pytest.raises(WeightsError, match=r"an EAGLE-3 head \(tensors "
                                           r"midlayer.hidden_norm.weight\), not an EAGLE-1 one"):
        load_eagle1(write(tmp_path, sd, "safetensors"), CFG)


VD, F3 = 20, 40


def eagle3_state_dict(rng):
    d2t_ids = np.sort(rng.choice(67, VD, replace=False))
    t2d = np.zeros(67, bool)
    t2d[d2t_ids] = True
    return {"fc.weight": rnd(rng, H, 3 * H),
            "midlayer.input_layernorm.weight": rnd(rng, H),
            "midlayer.hidden_norm.weight": rnd(rng, H),
            "midlayer.self_attn.q_proj.weight": rnd(rng, Q, 2 * H),
            "midlayer.self_attn.k_proj.weight": rnd(rng, KV, 2 * H),
            "midlayer.self_attn.v_proj.weight": rnd(rng, KV, 2 * H),
            "midlayer.self_attn.o_proj.weight": rnd(rng, H, Q),
            "midlayer.post_attention_layernorm.weight": rnd(rng, H),
            "midlayer.mlp.gate_proj.weight": rnd(rng, F3, H),
            "midlayer.mlp.up_proj.weight": rnd(rng, F3, H),
            "midlayer.mlp.down_proj.weight": rnd(rng, H, F3),
            "norm.weight": rnd(rng, H), "lm_head.weight": rnd(rng, VD, H),
            "d2t": (d2t_ids - np.arange(VD)).astype(np.int64), "t2d": t2d}


EAGLE3_CONFIG = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": F3,
                 "vocab_size": 67, "draft_vocab_size": VD, "rms_norm_eps": 1e-5,
                 "rope_theta": 10000.0}


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle3_checkpoint_converts(tmp_path, fmt):
    sd = eagle3_state_dict(np.random.default_rng(6))
    p, hc = load_eagle3(write(tmp_path, sd, fmt, EAGLE3_CONFIG), CFG)
    assert hc["draft_vocab_size"] == VD and hc["intermediate_size"] == F3
    np.testing.assert_array_equal(p["fc"], sd["fc.weight"].T)
    wqkv = np.concatenate([sd[f"midlayer.self_attn.{n}_proj.weight"].T for n in "qkv"], axis=1)
    np.testing.assert_array_equal(p["layers"]["wqkv"][0], wqkv)
    np.testing.assert_array_equal(p["layers"]["w_gate_up"][0], np.concatenate(
        [sd["midlayer.mlp.gate_proj.weight"].T, sd["midlayer.mlp.up_proj.weight"].T], axis=1))
    np.testing.assert_array_equal(p["lm_head"], sd["lm_head.weight"].T)
    np.testing.assert_array_equal(p["hidden_norm"], sd["midlayer.hidden_norm.weight"])
    assert p["d2t"].dtype == jnp.int32 and p["t2d"].dtype == jnp.bool_
    # draft id -> target id through d2t lands exactly on the ids t2d marks.
    ids = np.arange(VD) + np.asarray(p["d2t"])
    np.testing.assert_array_equal(ids, np.flatnonzero(np.asarray(p["t2d"])))


@pytest.mark.parametrize("name,value,match", [
    ("lm_head.weight", np.zeros((VD + 1, H), np.float32), "'lm_head.weight' has shape"),
    ("midlayer.self_attn.q_proj.weight", np.zeros((Q, H), np.float32), "q_proj.weight' has shape"),
    ("d2t", np.full(VD, 500, np.int64), "outside the target vocabulary"),
    ("d2t", np.zeros(VD, np.float32), "'d2t' has dtype float32"),
    ("t2d", np.ones(67, bool), "t2d' marks 67"),
    ("norm.weight", None, "missing tensor 'norm.weight'"),
])
def test_eagle3_bad_tensor_is_named(tmp_path, name, value, match):
    sd = eagle3_state_dict(np.random.default_rng(7))
    if value is None:
        del sd[name]
    else:
        sd[name] = value
    with pytest.raises(WeightsError, match=match):
        load_eagle3(write(tmp_path, sd, "safetensors", EAGLE3_CONFIG), CFG)


def torch_reference_eagle3(sd, embed, tokens, aux, eps=1e-5, theta=10000.0):
    """The published EAGLE-3 midlayer (norm after residual), causal, no cache, in torch."""
    torch = pytest.importorskip("torch")
    t = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in sd.items()
         if np.asarray(v).dtype.kind == "f"}
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w  # noqa: E731
    n = len(tokens)
    h = torch.from_numpy(aux) @ t["fc.weight"].T
    residual = h
    x = torch.cat([rms(torch.from_numpy(embed[tokens]), t["midlayer.input_layernorm.weight"]),
                   rms(h, t["midlayer.hidden_norm.weight"])], -1)
    a = "midlayer.self_attn."
    q = (x @ t[a + "q_proj.weight"].T).view(n, 4, 8)
    k = (x @ t[a + "k_proj.weight"].T).view(n, 2, 8)
    v = (x @ t[a + "v_proj.weight"].T).view(n, 2, 8)
    inv = 1.0 / (theta ** (torch.arange(0, 8, 2).float() / 8))
    ang = torch.arange(n).float()[:, None] * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    rot = lambda z: torch.cat([-z[..., 4:], z[..., :4]], -1)  # noqa: E731
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / 8 ** 0.5
    s = s.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool)), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, Q) @ t[a + "o_proj.weight"].T
    residual = residual + o
    m = rms(residual, t["midlayer.post_attention_layernorm.weight"])
    m = (torch.nn.functional.silu(m @ t["midlayer.mlp.gate_proj.weight"].T)
         * (m @ t["midlayer.mlp.up_proj.weight"].T)) @ t["midlayer.mlp.down_proj.weight"].T
    out = m + residual
    return out.numpy(), (rms(out, t["norm.weight"]) @ t["lm_head.weight"].T).numpy()


def test_eagle3_forward_matches_reference(tmp_path):
    from jaxspec.train import eagle3

    rng = np.random.default_rng(8)
    sd = eagle3_state_dict(rng)
    sd = {k: (0.2 * v if v.ndim == 2 else 1 + 0.1 * v) if v.dtype == np.float32 else v
          for k, v in sd.items()}
    p, hc = load_eagle3(write(tmp_path, sd, "safetensors", EAGLE3_CONFIG), CFG)
    embed = rnd(rng, 67, H)
    n = 9
    tokens = rng.integers(0, 67, n)
    aux = rnd(rng, n, 3 * H)
    out, logits = eagle3.forward(p, hc, CFG, jnp.asarray(embed), jnp.asarray(tokens)[None],
                                 jnp.asarray(aux)[None], jnp.arange(n)[None])
    ref_out, ref_logits = torch_reference_eagle3(sd, embed, tokens, aux)
    np.testing.assert_allclose(np.asarray(out[0]), ref_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits[0]), ref_logits, rtol=1e-4, atol=1e-4)
    ids = eagle3.draft_to_target(p["d2t"])
    np.testing.assert_array_equal(ids, np.flatnonzero(np.asarray(p["t2d"])))


def test_load_draft_reads_our_own_head_file(tmp_path):
    """LLM(draft=<file from jaxspec train-eagle>) goes through load_draft: our own format must be
    recognised, not parsed as a public checkpoint (which has fc.weight, not fc)."""
    from jaxspec.loading.eagle_ckpt import load_draft, save_head

    head = eagle.init_eagle_params(CFG, jax.random.PRNGKey(3))
    path = save_head(tmp_path / "head.safetensors", head, {"steps": 1})
    got = load_draft(path, CFG)
    for a, b in zip(jax.tree_util.tree_leaves(head), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _shipped_layout(d, head):
    """A directory as the project ships its head: head.safetensors, token_ranking.safetensors
    and a README.md card."""
    from safetensors.numpy import save_file

    from jaxspec.loading.eagle_ckpt import DEFAULT_HEAD_FILE, DEFAULT_RANKING_FILE, save_head
    d.mkdir(parents=True, exist_ok=True)
    save_head(d / DEFAULT_HEAD_FILE, head, {"steps": 1})
    save_file({"ids": np.arange(67, dtype=np.int32)[::-1].copy()}, str(d / DEFAULT_RANKING_FILE))
    (d / "README.md").write_text("# a head\n")
    return d


def test_load_draft_reads_a_directory_in_the_shipped_layout(tmp_path):
    """draft=<directory> of our own head loads as its file does; a head of another shape names
    the tensor, its shape and the expected one as a directory and as a file alike."""
    from jaxspec.loading.eagle_ckpt import DEFAULT_HEAD_FILE, load_draft
    head = eagle.init_eagle_params(CFG, jax.random.PRNGKey(3))
    d = _shipped_layout(tmp_path / "head", head)
    for got in (load_draft(d, CFG), load_draft(str(d), CFG)):
        for a, b in zip(jax.tree_util.tree_leaves(head), jax.tree_util.tree_leaves(got)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    wide = ModelConfig(arch="LlamaForCausalLM", vocab_size=67, hidden_size=48,
                       intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=12)
    wrong = _shipped_layout(tmp_path / "wrong", eagle.init_eagle_params(wide,
                                                                        jax.random.PRNGKey(4)))
    for path in (wrong, wrong / DEFAULT_HEAD_FILE):
        with pytest.raises(WeightsError, match=r"head.safetensors: tensor 'fc' has shape "
                                               r"\(96, 48\), expected \(64, 32\)"):
            load_draft(path, CFG)


def test_load_draft_directory_errors_are_clear(tmp_path):
    """Two head files in one directory, a corrupt head file, a corrupt config.json and a torch
    file that pickles code: each a WeightsError naming the file, nothing executed."""
    from jaxspec.loading.eagle_ckpt import DEFAULT_HEAD_FILE, load_draft, save_head
    head = eagle.init_eagle_params(CFG, jax.random.PRNGKey(3))
    two = _shipped_layout(tmp_path / "two", head)
    save_head(two / "other.safetensors", head)
    with pytest.raises(WeightsError, match="several head files .*head.safetensors, "
                                           "other.safetensors"):
        load_draft(two, CFG)
    bad = _shipped_layout(tmp_path / "bad", head)
    (bad / DEFAULT_HEAD_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    for path in (bad, bad / DEFAULT_HEAD_FILE):
        with pytest.raises(WeightsError, match="head.safetensors: unreadable safetensors"):
            load_draft(path, CFG)
    cfg_dir = write(tmp_path / "cfg", eagle1_state_dict(np.random.default_rng(0)), "safetensors")
    (cfg_dir / "config.json").write_text("{broken")
    with pytest.raises(WeightsError, match="config.json: not valid JSON"):
        load_draft(cfg_dir, CFG)
    torch = pytest.importorskip("torch")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = tmp_path / "evil"
    evil.mkdir()
    torch.save({"fc.weight": torch.zeros(H, 2 * H), "x": Payload()}, evil / "pytorch_model.bin")
    with pytest.raises(WeightsError, match="pytorch_model.bin: unreadable torch checkpoint"):
        load_draft(evil, CFG)
    assert not marker.exists()


def test_widened_head_computes_the_same_and_round_trips(tmp_path):
    """eagle.widen_mlp keeps the head's function (new w_down rows are zero); its file records the
    width, loads back exactly, and a width the tensors do not have is named."""
    from safetensors.numpy import load_file, save_file

    from jaxspec.loading.eagle_ckpt import HEAD_META_KEY, load_head, read_head_meta, save_head

    p = llama.init_random_params(CFG, jax.random.PRNGKey(0), jnp.float32)
    head = eagle.init_eagle_params(CFG, jax.random.PRNGKey(3))
    wide = eagle.widen_mlp(head, 3 * F, jax.random.PRNGKey(4))
    assert eagle.mlp_width(wide) == 3 * F and eagle.mlp_width(head) == F
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 67, (2, 5)), jnp.int32)
    feats = jnp.asarray(rnd(rng, 2, 5, H))
    pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    cache = jnp.zeros((1, 2, 2, 8, 8), jnp.float32)
    mask = jnp.asarray(np.tril(np.ones((5, 5), bool)))[None].repeat(2, 0)
    run = lambda d: eagle.forward(p, d, CFG, tokens, feats, pos, cache, cache,
                                  jnp.zeros(2, jnp.int32), mask)[0]
    np.testing.assert_allclose(np.asarray(run(wide)), np.asarray(run(head)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="narrow"):
        eagle.widen_mlp(wide, F, jax.random.PRNGKey(5))

    path = save_head(tmp_path / "wide.safetensors", wide, {"steps": 1})
    assert read_head_meta(path) == {"steps": 1, "mlp_width": 3 * F}
    got = load_head(path, CFG)
    for a, b in zip(jax.tree_util.tree_leaves(wide), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # metadata claiming the target's width: the MLP tensors are named as wrong
    bad = tmp_path / "bad.safetensors"
    save_file(load_file(str(path)), str(bad), metadata={HEAD_META_KEY: json.dumps({})})
    with pytest.raises(WeightsError, match="w_gate_up"):
        load_head(bad, CFG)
    for meta, match in (("{not json", "not JSON"), ('{"mlp_width": -3}', "positive integer")):
        save_file(load_file(str(path)), str(bad), metadata={HEAD_META_KEY: meta})
        with pytest.raises(WeightsError, match=match):
            load_head(bad, CFG)
