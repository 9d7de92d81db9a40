"""The persistent compilation cache is a GPU-only convenience: on CPU it stays off, a directory
the user set wins, and JAXSPEC_COMPILE_CACHE=0 turns it off."""
import jax

from jaxspec import compile_cache


def test_cpu_leaves_jax_config_alone(monkeypatch):
    before = jax.config.jax_compilation_cache_dir
    assert compile_cache.enable() is None
    assert jax.config.jax_compilation_cache_dir == before


def test_gpu_sets_the_directory_unless_off_or_user_set(monkeypatch, tmp_path):
    monkeypatch.setattr(compile_cache.jax, "default_backend", lambda: "gpu")
    old = jax.config.jax_compilation_cache_dir
    old_min = jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        monkeypatch.setenv("JAXSPEC_COMPILE_CACHE", "0")
        assert compile_cache.enable(tmp_path / "off") is None
        monkeypatch.delenv("JAXSPEC_COMPILE_CACHE")
        jax.config.update("jax_compilation_cache_dir", None)
        assert compile_cache.enable(tmp_path / "xla") == str(tmp_path / "xla")
        assert (tmp_path / "xla").is_dir()
        # a directory already set (by the user, or a first call) is kept
        assert compile_cache.enable(tmp_path / "other") == str(tmp_path / "xla")
    finally:
        jax.config.update("jax_compilation_cache_dir", old)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", old_min)
