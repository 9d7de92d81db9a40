"""EAGLE draft-head training: ShareGPT data (teacher-forced or self-distilled), the EAGLE-1 loss,
an optax loop with orbax checkpoints, and the `jaxspec train-eagle` command (`cli.main`).

Importing this package is light; the loop's dependencies load with its modules.
"""
from jaxspec.loading.eagle_ckpt import load_default_head, load_head, save_head

__all__ = ["load_default_head", "load_head", "save_head"]
