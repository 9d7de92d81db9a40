"""What a thread-block cluster costs at launch, and whether Mosaic GPU launches one of 16 CTAs
(past the portable 8): 128 CTAs (batch 1's 16 splits of 8 KV heads) as clusters of 1-16, each
CTA writing one [64, 128] bf16 tile that names it; kernel time (median of 3 traces of 8). Each
size runs twice: with that tile's shared memory alone, and with 176 KB more held (the Mosaic
prefix kernel's share at batch 1: one CTA an SM).

    python3 bench/cluster_launch_probe.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from bench.bench_kernels import median_kernel_us, use_device_time  # noqa: E402


CTAS = 128


def call(size, pad_kb=0):
    """The probe kernel: CTAS // size clusters of `size` CTAs, each holding `pad_kb` KB more."""
    heads = CTAS // size

    def body(o_ref, smem, *pad):
        s, bh = lax.axis_index("split"), lax.axis_index("bh")
        smem[...] = jnp.full((64, 128), 1.0, jnp.bfloat16) * (s + size * bh).astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, o_ref.at[bh, s])
        plgpu.wait_smem_to_gmem(0)
    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    pad = [plgpu.SMEM((pad_kb * 256,), jnp.float32)] if pad_kb else []
    return plgpu.kernel(lambda o: pl.run_scoped(lambda *sm: body(o, *sm),
                                                plgpu.SMEM((64, 128), jnp.bfloat16,
                                                           transforms=tiles), *pad),
                        out_type=jax.ShapeDtypeStruct((heads, size, 64, 128), jnp.bfloat16),
                        grid=(heads,), grid_names=("bh",), cluster=(size,),
                        cluster_names=("split",))


def main():
    use_device_time()
    for size, pad_kb in ((s, p) for p in (0, 176) for s in (1, 2, 4, 8, 16)):
        try:
            f = jax.jit(call(size, pad_kb))
            out = np.asarray(f().astype(jnp.float32))[:, :, 0, 0]
            want = np.arange(CTAS).reshape(CTAS // size, size)
            print(f"cluster {size}, +{pad_kb} KB: ran, right={bool((out == want).all())}, "
                  f"{median_kernel_us(f):.2f} us", flush=True)
        except Exception as e:  # noqa: BLE001  (each size's failure is the finding)
            print(f"cluster {size}, +{pad_kb} KB: FAILED {type(e).__name__}: {str(e)[:400]}",
                  flush=True)


if __name__ == "__main__":
    main()
