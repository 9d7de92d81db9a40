"""Training an EAGLE-3 head further: `--init-head` takes a saved head (public layout), whose
arrays are the start and whose draft vocabulary and target layers stay."""
import functools

import jax
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.loading.eagle_ckpt import save_eagle3
from jaxspec.models import llama
from jaxspec.train import eagle3 as e3
from jaxspec.train.cli import eagle3_setup, initial_head

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=67, hidden_size=32, intermediate_size=48,
                  num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8)
AUX = (0, 1, 3)


@functools.lru_cache(maxsize=None)
def target():
    return llama.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.3)


def corpus(n=16, seed=0, t=24):
    """Token rows over 40 of the 67 ids, the loss on all but the first 6 tokens of a row."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 40, size=(n, t)).astype(np.int32)
    mask = np.zeros((n, t), np.uint8)
    mask[:, 6:] = 1
    return toks, mask


def saved_head(tmp_path, vocab=24):
    toks, mask = corpus(16)
    ids = e3.build_draft_vocab(toks, mask, CFG.vocab_size, vocab)
    head = e3.init_train_head(target(), CFG, jax.random.PRNGKey(3), ids, AUX)
    # arrays unlike a fresh head's, so a start from scratch cannot pass for a resumed one
    head = jax.tree_util.tree_map(
        lambda a: a + 0.01 if np.issubdtype(a.dtype, np.floating) else a, head)
    return save_eagle3(tmp_path / "head", head, CFG, dtype="float32"), head, ids, toks, mask


def test_a_saved_head_is_the_start_with_its_vocabulary_and_layers(tmp_path):
    path, head, ids, toks, mask = saved_head(tmp_path)
    # other rows would build another vocabulary: the head's own must win
    other, _ = corpus(16, seed=5)
    obj, got = eagle3_setup(target(), CFG, other, mask, None, None, init_head=str(path))
    np.testing.assert_array_equal(got, ids)
    assert obj.config == head.config and obj.config.aux_layers == AUX
    for k in e3.TRAINED_KEYS:
        for a, b in zip(jax.tree_util.tree_leaves(obj.init[k]),
                        jax.tree_util.tree_leaves(head.params[k])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(obj.fixed["d2t"]), np.asarray(head.params["d2t"]))
    np.testing.assert_array_equal(np.asarray(obj.fixed["t2d"]), np.asarray(head.params["t2d"]))
    # the same sizes, given explicitly, are accepted
    eagle3_setup(target(), CFG, toks, mask, 24, AUX, init_head=str(path))
    # an EAGLE-3 start is the objective's: no EAGLE-1 head is built for it
    assert initial_head(str(path), CFG, "eagle3") is None


def test_a_saved_head_refuses_other_sizes(tmp_path):
    path, _, _, toks, mask = saved_head(tmp_path)
    with pytest.raises(ValueError, match="drafts 24"):
        eagle3_setup(target(), CFG, toks, mask, 32, None, init_head=str(path))
    with pytest.raises(ValueError, match="reads target layers"):
        eagle3_setup(target(), CFG, toks, mask, None, (0, 1, 2), init_head=str(path))


def test_a_fresh_head_drafts_the_default_vocabulary_size():
    toks, mask = corpus(16)
    obj, ids = eagle3_setup(target(), CFG, toks, mask, None, AUX)
    assert len(ids) == CFG.vocab_size == obj.config.draft_vocab_size   # 16,384 > 67: all



def test_an_eagle1_start_is_refused(tmp_path):
    with pytest.raises(ValueError, match="EAGLE-1"):
        initial_head("shipped", CFG, "eagle3")
    with pytest.raises(ValueError, match="EAGLE-1"):
        initial_head(str(tmp_path / "missing"), CFG, "eagle3")
