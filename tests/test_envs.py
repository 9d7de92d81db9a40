"""jaxspec.envs: each variable's default, a valid value and a rejected one; reads follow
os.environ at run time; the library reads JAXSPEC_* variables only through envs; and
docs/configuration.md's table is the one envs.py generates."""
import ast
import pathlib
import re
from pathlib import Path

import pytest

from jaxspec import envs

ROOT = pathlib.Path(__file__).resolve().parents[1]

# name -> (default, (raw, parsed) it accepts, raw values it rejects); a path takes any string.
# The default of a home-relative path is a function of the home directory.
CASES = {
    "JAXSPEC_CACHE": (lambda home: home / ".cache" / "jaxspec",
                      ("~/params", lambda home: home / "params"), ()),
    "JAXSPEC_COMPILE_CACHE": (True, ("0", False), ("2", "maybe")),
    "JAXSPEC_COORDINATOR": (None, ("10.0.0.1:1234", "10.0.0.1:1234"),
                            ("10.0.0.1", "host:port", ":1234", "h:0")),
    "JAXSPEC_CYCLE_COPIES": (1, ("2", 2), ("x", "0", "1.5")),
    "JAXSPEC_DRAFT_HEAD": (None, ("~/head.safetensors", lambda home: home / "head.safetensors"),
                           ()),
    "JAXSPEC_GEMM": ("auto", ("CUBLAS", "cublas"), ("fast", "cudnn")),
    "JAXSPEC_KERNELS": (True, ("off", False), ("2", "no-kernels")),
    "JAXSPEC_MOSAIC": (True, ("false", False), ("-1",)),
    "JAXSPEC_NUM_PROCESSES": (None, ("2", 2), ("0", "two")),
    "JAXSPEC_PREFILL_UNROLL": (1, ("5", 5), ("0", "1.5", "all")),
    "JAXSPEC_PROCESS_ID": (None, ("0", 0), ("-1", "first")),
    "XDG_CACHE_HOME": (lambda home: home / ".cache", ("/var/cache", Path("/var/cache")), ()),
}
EXPECTS = {"int": "an int >=", "bool": "a bool", "choice": "one of", "str": "host:port"}


def _value(v, home):
    return v(home) if callable(v) else v


def test_every_variable_is_covered_here():
    assert set(CASES) == set(envs.environment_variables)


@pytest.mark.parametrize("name", sorted(CASES))
def test_default_valid_and_invalid(name, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    default, (raw, parsed), invalid = CASES[name]
    monkeypatch.delenv(name, raising=False)
    assert getattr(envs, name) == _value(default, tmp_path)
    monkeypatch.setenv(name, "")            # empty counts as unset
    assert getattr(envs, name) == _value(default, tmp_path)
    monkeypatch.setenv(name, raw)
    assert getattr(envs, name) == _value(parsed, tmp_path)
    kind = next(v["type"] for v in envs.describe() if v["name"] == name).split()[0].rstrip(":")
    for bad in invalid:
        monkeypatch.setenv(name, bad)
        with pytest.raises(envs.EnvError, match=rf"^{name} must be {EXPECTS[kind]}.*, got "
                                               rf"{re.escape(repr(bad))}$"):
            getattr(envs, name)


def test_reads_are_lazy_and_unknown_names_fail(monkeypatch):
    monkeypatch.setenv("JAXSPEC_CYCLE_COPIES", "3")
    assert envs.JAXSPEC_CYCLE_COPIES == 3
    monkeypatch.setenv("JAXSPEC_CYCLE_COPIES", "4")
    assert envs.JAXSPEC_CYCLE_COPIES == 4
    monkeypatch.setenv("JAXSPEC_CYCLE_COPIES", "x")
    with pytest.raises(ValueError, match="JAXSPEC_CYCLE_COPIES must be an int >= 1, got 'x'"):
        envs.JAXSPEC_CYCLE_COPIES
    with pytest.raises(AttributeError, match="JAXSPEC_NOPE"):
        envs.JAXSPEC_NOPE
    assert set(envs.environment_variables) <= set(dir(envs))


def test_describe_has_every_field():
    rows = envs.describe()
    assert [r["name"] for r in rows] == sorted(envs.environment_variables)
    for r in rows:
        assert set(r) == {"name", "type", "default", "doc"} and all(r.values()), r
        assert "|" not in "".join(r.values()) and "\n" not in "".join(r.values()), r


def test_library_follows_the_environment(monkeypatch, tmp_path):
    from jaxspec import compile_cache, config, xla_options
    from jaxspec.loading import cache, eagle_ckpt
    from pallas_kernels import _compat, backend_rule

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "c"))
    assert cache.cache_dir() == tmp_path / "c"
    monkeypatch.setenv("JAXSPEC_DRAFT_HEAD", str(tmp_path / "h.safetensors"))
    assert eagle_ckpt.default_head_path() == tmp_path / "h.safetensors"
    monkeypatch.delenv("JAXSPEC_DRAFT_HEAD")
    shipped = eagle_ckpt.DEFAULT_HEAD_DIR / eagle_ckpt.DEFAULT_HEAD_FILE
    assert eagle_ckpt.default_head_path() == shipped
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == tmp_path / "xdg" / "jaxspec" / "xla"
    monkeypatch.setenv("JAXSPEC_GEMM", "triton")
    assert xla_options.gemm_choice() == "triton"
    monkeypatch.setenv("JAXSPEC_PREFILL_UNROLL", "0")
    with pytest.raises(ValueError, match="JAXSPEC_PREFILL_UNROLL"):
        config.ModelConfig(arch="LlamaForCausalLM", vocab_size=8, hidden_size=8,
                           intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                           head_dim=8).for_prefill()
    assert _compat.on_gpu("gpu")
    monkeypatch.setenv("JAXSPEC_KERNELS", "0")
    assert not _compat.on_gpu("gpu")
    monkeypatch.setattr(backend_rule.pm, "on_hopper", lambda: True)
    tile = dict(rows=64, live_len=8192, cache_len=8192, head_dim=128, dtype="bfloat16", batch=8)
    monkeypatch.setattr(backend_rule, "_h100_triton_tile", lambda *a: False)
    assert backend_rule.mosaic_serves(**tile)
    monkeypatch.setenv("JAXSPEC_MOSAIC", "0")
    assert not backend_rule.mosaic_serves(**tile)


def test_distributed_initialize_reads_the_environment(monkeypatch):
    import jax

    from jaxspec.parallel import distributed

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setenv("JAXSPEC_NUM_PROCESSES", "1")
    distributed.initialize()
    assert calls == []
    monkeypatch.setenv("JAXSPEC_COORDINATOR", "10.0.0.1:1234")
    monkeypatch.setenv("JAXSPEC_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXSPEC_PROCESS_ID", "1")
    distributed.initialize()
    distributed.initialize(process_id=0)
    assert calls == [dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=p,
                          local_device_ids=None) for p in (1, 0)]


ALLOWED_DIRECT_READS: set = set()


def _library_files():
    for pkg in ("jaxspec", "pallas_kernels"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel != "jaxspec/envs.py":
                yield rel, ast.parse(path.read_text(), filename=rel)


def test_only_envs_reads_jaxspec_variables():
    """A library file that touches os.environ / os.getenv must not name a JAXSPEC_ variable in
    code (docstrings and comments may): the reads go through `jaxspec.envs`. And any JAXSPEC_
    name in code is one envs.py defines."""
    offenders, unknown = [], []
    for rel, tree in _library_files():
        names = {n.value for n in ast.walk(tree)
                 if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and re.fullmatch(r"JAXSPEC_[A-Z0-9_]+", n.value)}
        unknown += [(rel, n) for n in sorted(names - set(envs.environment_variables))]
        touches_env = any(isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv")
                          or isinstance(n, ast.Name) and n.id in ("environ", "getenv")
                          or isinstance(n, ast.alias) and n.name in ("environ", "getenv")
                          for n in ast.walk(tree))
        if names and touches_env and rel not in ALLOWED_DIRECT_READS:
            offenders.append((rel, sorted(names)))
    assert not offenders, f"read these through jaxspec.envs: {offenders}"
    assert not unknown, f"JAXSPEC_ variables envs.py does not define: {unknown}"


def test_configuration_doc_is_generated_from_envs():
    text = (ROOT / "docs" / "configuration.md").read_text()
    listed = re.findall(r"^\| `([A-Za-z0-9_]+)` \|", text, re.M)
    assert sorted(listed) == sorted(envs.environment_variables)
    assert envs.markdown_table() in text, (
        "docs/configuration.md's table is stale; regenerate it with: python -c \"from jaxspec "
        "import envs; print(envs.markdown_table(), end='')\"")
