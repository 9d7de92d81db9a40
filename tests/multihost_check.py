"""Two processes on one machine, one CPU device each, joined by `jax.distributed`: the engine
over a speculative backend placed tensor parallel on the 2-device global mesh equals the
single-device greedy output.

    python tests/multihost_check.py          # spawns the two processes, prints `ok multihost`
"""
import os
import socket
import subprocess
import sys
from pathlib import Path


def worker(pid: int, port: int):
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from jaxspec.parallel import distributed
    distributed.initialize(f"localhost:{port}", 2, pid)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import parallel_check as pc
    from reference_runner import SpecRunner

    from jaxspec.engine import Engine, EngineConfig, SpecBackend
    from jaxspec.parallel import TensorParallel
    mesh = distributed.global_mesh()
    assert mesh.devices.size == 2 and jax.local_device_count() == 1
    p, d = pc.pair()
    rows = pc.MAX_LEN + 2 * pc.SPEC.max_emit
    be = SpecBackend(pc.CFG, p, d, pc.SPEC, 2, rows, placement=TensorParallel(mesh, pc.CFG))
    eng = Engine(be, EngineConfig(max_batch=2, max_model_len=pc.MAX_LEN, prefill_chunk=16),
                 vocab_size=pc.CFG.vocab_size)
    got = [r.output for r in pc.serve(eng, pc.PROMPTS[:3], pc.greedy(pc.NEW[:3]))]
    # The single-device reference, on this process's own device.
    with jax.default_device(jax.local_devices()[0]):
        ref = [x.token_ids for x in SpecRunner(pc.CFG, p, d, pc.SPEC, 2, rows).generate(
            pc.PROMPTS[:3], pc.NEW[:3])]
    assert got == ref, (got, ref)
    print(f"ok multihost process {pid}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        worker(int(sys.argv[1]), int(sys.argv[2]))
        sys.exit(0)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port)], env=env)
             for i in range(2)]
    codes = [p.wait(timeout=900) for p in procs]
    assert codes == [0, 0], codes
    print("ok multihost", flush=True)
