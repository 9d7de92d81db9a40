"""Building an engine from options: the draft head, the placement, the backend, the engine.

`LLM` calls `build_engine`; scripts that hold their own weights (benchmarks, tests) can too.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import jax

from jaxspec import defaults
from jaxspec.config import ConfigError, ModelConfig
from jaxspec.engine import Engine, EngineConfig, PlainBackend, SpecBackend
from jaxspec.spec.config import DraftConfig, resolve_spec


def placement(cfg: ModelConfig, data_parallel: int = 1, tensor_parallel: int = 1,
              data_parallel_impl: str = "shard_map"):
    """The placement of a backend: one device, data parallel over local devices, or tensor
    parallel over a model mesh."""
    for name, n in (("data_parallel", data_parallel), ("tensor_parallel", tensor_parallel)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {n!r}")
    if data_parallel > 1 and tensor_parallel > 1:
        raise ConfigError("data_parallel and tensor_parallel together (a 2-D mesh) are not "
                          "supported: choose one")
    if tensor_parallel > 1:
        from jaxspec.parallel.tensor_parallel import TensorParallel, make_mesh
        return TensorParallel(make_mesh(tensor_parallel), cfg)
    if data_parallel > 1:
        from jaxspec.parallel.data_parallel import DataParallel, local_devices
        return DataParallel(local_devices(data_parallel), data_parallel_impl)
    from jaxspec.parallel.data_parallel import IMPLS
    if data_parallel_impl not in IMPLS:
        raise ConfigError(f"data_parallel_impl must be one of {IMPLS}, got "
                          f"{data_parallel_impl!r}")
    from jaxspec.parallel.placement import OneDevice
    return OneDevice()


def load_draft(draft: Any, cfg: ModelConfig, params, dtype, dcfg: DraftConfig,
               max_batch: int, sharded: bool):
    """Draft params (an EAGLE-1 dict or an `eagle3.Eagle3Head`) from draft: None / 'default'
    (the shipped head of the default model), a checkpoint path, or params; the vocabulary cut
    per `dcfg`."""
    from jaxspec.loading import eagle_ckpt
    shipped = draft in (None, "default")
    if shipped:
        draft = eagle_ckpt.load_default_head(cfg, dtype=dtype)
    elif isinstance(draft, (str, os.PathLike)):
        draft = eagle_ckpt.load_draft(str(draft), cfg, dtype=dtype)
    return _restrict_vocab(draft, cfg, params, dcfg, shipped, max_batch, sharded)


def _restrict_vocab(draft, cfg, params, dcfg: DraftConfig, shipped: bool, max_batch: int,
                    sharded: bool):
    from jaxspec.models.eagle3 import is_eagle3
    from jaxspec.spec import draft_vocab as dv
    k, context = dcfg.draft_vocab, dcfg.draft_context_vocab
    if k is None:
        k = defaults.DRAFT_VOCAB if shipped and not is_eagle3(draft) else 0
    path = None
    if 0 < k < cfg.vocab_size:
        path = dv.ranking_path(cfg, dcfg.draft_vocab_ranking)
        if dcfg.draft_vocab is None and dcfg.draft_vocab_ranking is None and not path.is_file():
            path = None   # a head shipped without its ranking: the whole vocabulary
    if path is None:
        if context:         # asked for (the default is none without a cut)
            raise ConfigError(f"draft_context_vocab={context} needs a draft that scores a cut "
                              "vocabulary (draft_vocab > 0, an EAGLE-1 head and its ranking); "
                              "this one scores every token")
        return draft
    if context is None:     # the default, and none under tensor parallelism (whose sharded
        # draft vocabulary the context rows were not built for)
        context = defaults.context_vocab(max_batch)
        context = context if context < k and not sharded else 0
    return dv.restrict_top(params, draft, cfg, k, path, context=context)


def build_engine(cfg: ModelConfig, params, econf: EngineConfig, *, draft=None, spec=None,
                 dcfg: DraftConfig = DraftConfig(), eos_ids=(), tokenizer=None,
                 data_parallel: int = 1, tensor_parallel: int = 1,
                 data_parallel_impl: str = "shard_map") -> Engine:
    """A plain engine (draft and spec None) or a speculative one. econf: unresolved options
    (None fields take their defaults here); cfg.max_position_embeddings caps max_model_len."""
    pl = placement(cfg, data_parallel, tensor_parallel, data_parallel_impl)
    speculative = draft is not None or spec is not None
    slots = econf.max_batch * data_parallel
    econf = econf.resolved(slots=slots, speculative=speculative,
                           model_limit=cfg.max_position_embeddings)
    cfg = _with_layout(cfg, econf.layer_layout)
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    common = dict(seed=econf.seed, short_rows=econf.short_rows, placement=pl,
                  cycle_copies=econf.cycle_copies)
    if speculative:
        spec = resolve_spec(spec if spec is not None else defaults.spec(econf.max_batch))
        draft = load_draft(draft, cfg, params, dtype, dcfg, econf.max_batch,
                           sharded=tensor_parallel > 1)
        # rows for the speculative tokens of the calls that may run past a request's end
        rows = econf.max_model_len + 2 * spec.max_emit * econf.cycles_per_call
        backend = SpecBackend(cfg, params, draft, spec, slots, rows,
                              cycles_per_call=econf.cycles_per_call, **common)
    else:
        rows = econf.max_model_len + 2 * econf.decode_steps
        backend = PlainBackend(cfg, params, slots, rows, n_steps=econf.decode_steps, **common)
    return Engine(backend, econf, vocab_size=cfg.vocab_size, eos_ids=eos_ids,
                  detokenize=None if tokenizer is None else tokenizer.decode,
                  stream_decoder=getattr(tokenizer, "stream_decoder", None))


def _with_layout(cfg: ModelConfig, layout: Optional[str]) -> ModelConfig:
    return cfg.with_layout(unroll_layers=layout == "unrolled")
