"""Where a backend's weights, state and programs live: one device, or a mesh.

A backend (`engine.backends`) is built over a placement and asks it for everything that depends
on the devices, so parallelism is a constructor argument, never a patch:
  weights(params, draft_params)   the weights placed (replicated, or sharded)
  state(make, slots, axes)        the batch state of `slots` slots, placed; make(n) builds n,
                                  axes: each leaf's slot axis (`engine.admission.batch_axes`)
  program(jitted, kind)           the callable a backend runs for one of its jitted programs
                                  (kind "cycle", "admit", "advance"), e.g. per device
  put_mask(mask)                  the cycle's [B] active mask as the program takes it
  stack(parts)                    an admission's per-replica argument tuples as one call's
  host(x)                         a program output read as numpy, replicas merged ([B, ...])
  replicated(x)                   x on every device the programs run on
  replicas                        how many replica groups the slots are split into
Every program takes (params, draft_params, state, ...) with the state donated.
"""
from __future__ import annotations

import collections

import jax
import numpy as np


class MaskCache:
    """Host bool masks -> device arrays, kept by value (the `keep` most recent).

    A numpy argument is copied to the device inside the call, and on the GPU that copy waits for
    the work already queued, so the device would idle while the host launches the next cycle. A
    serving loop's active mask repeats in steady state, so each one crosses once.
    put: numpy -> device array(s) as the programs take them."""

    def __init__(self, put=jax.device_put, keep: int = 64):
        self.put, self.keep = put, keep
        self._kept: "collections.OrderedDict[tuple, jax.Array]" = collections.OrderedDict()

    def __call__(self, mask: np.ndarray) -> jax.Array:
        mask = np.asarray(mask, bool)
        key = (mask.shape, mask.tobytes())
        got = self._kept.get(key)
        if got is None:
            got = self._kept[key] = self.put(mask.copy())
            if len(self._kept) > self.keep:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        return got


class OneDevice:
    """Everything on the default device, the programs as jitted."""
    replicas = 1

    def __init__(self):
        self.put_mask = MaskCache()

    def weights(self, params, draft_params):
        return params, draft_params

    def state(self, make, slots: int, axes):
        return make(slots)

    def program(self, jitted, kind: str):
        return jitted

    def stack(self, parts):
        part, = parts
        return part

    def host(self, x) -> np.ndarray:
        return np.asarray(x)

    def replicated(self, x):
        return x
