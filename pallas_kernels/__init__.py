"""Pallas GPU kernels for jaxspec: tree attention over a KV cache, and KV compaction.

Each module holds the kernel, its `pallas_call` wrapper, a jitted entry point and a pure-jnp
`*_reference` that defines the semantics (and runs wherever the kernel cannot).
"""
