"""The persistent compilation cache is a GPU-only convenience: on CPU it stays off, a directory
the user set wins, and JAXSPEC_COMPILE_CACHE=0 turns it off. The GPU branch runs in a child
process so this test process's own JAX configuration is never touched."""
import os
import subprocess
import sys
import textwrap

import jax

from jaxspec import compile_cache


def test_cpu_leaves_jax_config_alone():
    before = jax.config.jax_compilation_cache_dir
    assert compile_cache.enable() is None
    assert jax.config.jax_compilation_cache_dir == before


def test_gpu_sets_the_directory_unless_off_or_user_set(tmp_path):
    script = textwrap.dedent(f"""
        import os, jax
        from jaxspec import compile_cache
        compile_cache.jax.default_backend = lambda: "gpu"
        os.environ["JAXSPEC_COMPILE_CACHE"] = "0"
        assert compile_cache.enable({str(tmp_path / "off")!r}) is None
        del os.environ["JAXSPEC_COMPILE_CACHE"]
        assert compile_cache.enable({str(tmp_path / "xla")!r}) == {str(tmp_path / "xla")!r}
        assert jax.config.jax_compilation_cache_dir == {str(tmp_path / "xla")!r}
        # a directory already set (by the user, or a first call) is kept
        assert compile_cache.enable({str(tmp_path / "other")!r}) == {str(tmp_path / "xla")!r}
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert (tmp_path / "xla").is_dir() and not (tmp_path / "off").exists()
