"""SpecConfig validation and presets."""
import pytest

from jaxspec.config import ConfigError
from jaxspec.spec import PRESETS, SpecConfig, resolve_spec
from jaxspec.spec.config import check_vocab


def test_presets():
    assert resolve_spec("naive") == SpecConfig(1, 1, 2)
    assert resolve_spec("chain") == SpecConfig(3, 1, 4)
    assert resolve_spec("tree") == SpecConfig(6, 10, 60)
    assert set(PRESETS) == {"naive", "chain", "tree"}
    s = SpecConfig(5, 8, 32)
    assert resolve_spec(s) is s
    assert hash(s) == hash(SpecConfig(5, 8, 32))   # usable as a static jit argument
    assert s.max_emit == 6 and s.num_candidates == 8 + 4 * 64


@pytest.mark.parametrize("args, msg", [
    ((0, 1, 2), "num_steps=0 must be >= 1"),
    ((3, 0, 4), "topk=0 must be >= 1"),
    ((3, 1, 1), "num_draft_tokens=1 must be >= 2"),
    ((3, 1, 5), "needs 4 candidates"),
    ((1, 4, 6), "needs 5 candidates"),
    ((2.0, 1, 2), "must be an int"),
])
def test_invalid(args, msg):
    with pytest.raises(ConfigError, match=msg):
        SpecConfig(*args)


def test_unknown_preset_and_type():
    with pytest.raises(ConfigError, match="unknown speculation preset 'big'"):
        resolve_spec("big")
    with pytest.raises(ConfigError, match="SpecConfig or a preset name"):
        resolve_spec(3)


def test_shape_strings():
    assert resolve_spec("6x8x40") == SpecConfig(num_steps=6, topk=8, num_draft_tokens=40)
    assert resolve_spec("3X1X4") == resolve_spec("chain")
    with pytest.raises(ConfigError, match="STEPSxTOPKxTOKENS"):
        resolve_spec("6x8")
    with pytest.raises(ConfigError, match="num_draft_tokens"):     # SpecConfig's own check
        resolve_spec("2x1x9")


def test_topk_larger_than_vocab():
    with pytest.raises(ConfigError, match="exceeds the vocabulary"):
        check_vocab(SpecConfig(2, 8, 4), 5)
