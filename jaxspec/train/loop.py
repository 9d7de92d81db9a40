"""EAGLE head training loop: optax AdamW, linear warmup + cosine decay, orbax checkpoints
(resumable), tqdm progress, JSONL loss log and a loss plot. EAGLE-1 by default; EAGLE-3 with
`objective=Eagle3Objective(head)` (the head fixes the draft vocabulary and the target layers).

The learning-rate schedule is computed inside the step from two array arguments (step, total), so
changing the total (a time-budgeted run fixes it after timing its first steps) reuses the compiled
step. The data order is a function of (seed, epoch), so a resumed run sees the batches the
interrupted one would have.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec.config import ModelConfig
from jaxspec.models import eagle
from jaxspec.train.loss import FEATURE_WEIGHT, TOKEN_WEIGHT, eagle1_loss, target_features
from jaxspec.xla_options import jit


@dataclasses.dataclass
class TrainConfig:
    steps: int = 2000              # total steps (a max_seconds run re-derives it after timing)
    batch_size: int = 16
    lr: float = 3e-4
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    b1: float = 0.9
    b2: float = 0.95
    noise: float = 0.2             # EAGLE-1 input-feature noise, U(-0.1, 0.1)
    seed: int = 0
    log_every: int = 20
    ckpt_every: int = 500
    max_seconds: Optional[float] = None   # stop after this much training time; sets `steps`
    calibrate_steps: int = 30      # steps timed before `steps` is set from max_seconds
    refit_every: int = 100         # then `steps` re-fitted from the pace since, this often
    compute_dtype: Optional[str] = None   # "bfloat16" for the head's matmuls; None: feature dtype
    ttt_steps: int = 1             # > 1: also train on the head's own predicted features
    ttt_decay: float = 0.8
    feature_weight: float = FEATURE_WEIGHT   # EAGLE-1 loss: w_reg x feature smooth-L1
    token_weight: float = TOKEN_WEIGHT       # + w_cls x token cross-entropy
    target_temperature: float = 1.0          # the token term's target: softmax(logits / T)


def init_head(cfg: ModelConfig, key, scale: float = 0.02, mlp_width=None):
    """Random fp32 EAGLE-1 head whose fc starts as the identity on the feature half (the first
    prediction of f_{t+1} is f_t plus the layer's residual updates), which converges faster
    than a fully random fc. mlp_width: its MLP's intermediate size (default the target's)."""
    p = eagle.init_eagle_params(cfg, key, jnp.float32, scale, intermediate_size=mlp_width)
    h = cfg.hidden_size
    fc = p["fc"].at[h:].set(jnp.eye(h, dtype=jnp.float32))
    return {**p, "fc": fc, "fc_bias": jnp.zeros((h,), jnp.float32),
            "layers": {**p["layers"], "mlp_norm": jnp.ones_like(p["layers"]["mlp_norm"])}}


def make_optimizer(tc: TrainConfig):
    # The learning rate is applied in the step (see lr_at): weight decay scales with it as in
    # optax.adamw.
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                       optax.scale_by_adam(b1=tc.b1, b2=tc.b2),
                       optax.add_decayed_weights(tc.weight_decay))


def lr_at(step, total, tc: TrainConfig):
    """Linear warmup to tc.lr over warmup_steps, cosine to min_lr_ratio * lr at `total`."""
    step = step.astype(jnp.float32)
    warm = jnp.minimum(1.0, (step + 1) / max(tc.warmup_steps, 1))
    frac = jnp.clip((step - tc.warmup_steps) / jnp.maximum(total - tc.warmup_steps, 1), 0.0, 1.0)
    cos = tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
    return tc.lr * jnp.where(step < tc.warmup_steps, warm, cos)


class Eagle3Objective:
    """What `train` needs for an EAGLE-3 head: the trained arrays start from `head`'s, its draft
    vocabulary (d2t, t2d) and shapes stay fixed; features are the target's three layers and
    its post-norm hidden (for the target distribution); the loss is `train.eagle3.eagle3_loss`."""
    name = "EAGLE-3"

    def __init__(self, head):
        from jaxspec.train.eagle3 import split_head
        self.init, self.fixed = split_head(head)
        self.config = head.config
        self.hc = head.config.as_dict()

    def features(self, params, cfg: ModelConfig, tokens):
        from jaxspec.train.eagle3 import target_features as e3_features
        return e3_features(params, cfg, self.config.aux_layers, tokens)

    def loss(self, draft, params, cfg, tokens, features, loss_mask, key, noise=0.0,
             compute_dtype=None, ttt_steps=1, ttt_decay=0.8):
        from jaxspec.train.eagle3 import eagle3_loss
        aux, normed = features
        return eagle3_loss(draft, self.fixed, self.hc, params, cfg, tokens, aux, normed,
                           loss_mask, key, noise, compute_dtype, ttt_steps, ttt_decay)

    def head(self, draft):
        """Trained arrays -> the Eagle3Head (what the cycle runs and save_eagle3 writes)."""
        from jaxspec.models.eagle3 import Eagle3Head
        return Eagle3Head({**draft, **self.fixed}, self.config)


def make_train_step(cfg: ModelConfig, tc: TrainConfig, opt, objective=None):
    cdt = jnp.dtype(tc.compute_dtype) if tc.compute_dtype else None
    loss_fn = objective.loss if objective is not None else functools.partial(
        eagle1_loss, feature_weight=tc.feature_weight, token_weight=tc.token_weight,
        target_temperature=tc.target_temperature)

    @functools.partial(jit, donate_argnums=(0, 1))
    def step_fn(draft, opt_state, params, tokens, features, loss_mask, key, step, total):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, metrics), grads = grad_fn(draft, params, cfg, tokens, features, loss_mask, key,
                                      tc.noise, cdt, tc.ttt_steps, tc.ttt_decay)
        updates, opt_state = opt.update(grads, opt_state, draft)
        lr = lr_at(step, total, tc)
        draft = jax.tree_util.tree_map(lambda p, u: p - lr * u, draft, updates)
        metrics = {**metrics, "lr": lr, "grad_norm": optax.tree.norm(grads) if hasattr(optax, "tree") else optax.global_norm(grads)}
        return draft, opt_state, metrics

    return step_fn


@functools.partial(jit, static_argnums=(2, 6, 7, 8, 9))
def eval_loss(draft, params, cfg: ModelConfig, tokens, features, loss_mask, ttt_steps: int = 1,
              feature_weight: float = FEATURE_WEIGHT, token_weight: float = TOKEN_WEIGHT,
              target_temperature: float = 1.0):
    return eagle1_loss(draft, params, cfg, tokens, features, loss_mask, jax.random.PRNGKey(0),
                       0.0, ttt_steps=ttt_steps, feature_weight=feature_weight,
                       token_weight=token_weight, target_temperature=target_temperature)[1]


def _eval_fn(cfg: ModelConfig, tc: TrainConfig, objective):
    if objective is None:
        return lambda draft, params, *batch: eval_loss(draft, params, cfg, *batch, tc.ttt_steps,
                                                       tc.feature_weight, tc.token_weight,
                                                       tc.target_temperature)
    return jit(lambda draft, params, tokens, feats, mask: objective.loss(
        draft, params, cfg, tokens, feats, mask, jax.random.PRNGKey(0), 0.0,
        ttt_steps=tc.ttt_steps, ttt_decay=tc.ttt_decay)[1])


class Batches:
    """Batches of rows of (tokens, loss_mask[, features]) in a per-epoch shuffled order.

    features: None (computed on the fly by a teacher-forced target forward: `feature_fn`, by
    default EAGLE-1's post-norm features) or arrays [n, T, ...] (numpy or device, or a tuple
    of them) precomputed once.
    trim: 0 (every batch T columns wide) or a multiple, e.g. 128: rows of similar length are
    batched together (HF's group_by_length: each epoch's shuffled rows are sorted by length
    within groups of `group` batches, and the batches of an epoch are shuffled), and a batch is
    cut to its longest row rounded up to the multiple. The cut columns are right padding that
    no loss reads and causal attention never lets earlier rows see, so the loss is the uncut
    one; the step compiles once per width (T / trim widths at most).
    The order is a function of (seed, epoch) only, so a resumed run sees the same batches.
    """

    def __init__(self, tokens, loss_mask, batch_size: int, seed: int, features=None,
                 feature_fn=None, trim: int = 0, group: int = 64):
        if len(tokens) < batch_size:
            raise ValueError(f"{len(tokens)} training rows < batch_size={batch_size}")
        if trim < 0:
            raise ValueError(f"trim must be >= 0, got {trim}")
        self.tokens, self.mask, self.features = tokens, loss_mask, features
        self.feature_fn = feature_fn or target_features
        self.batch_size, self.seed = batch_size, seed
        self.per_epoch = len(tokens) // batch_size
        self.trim, self.group = trim, group
        self._epoch = (None, None)
        m = np.asarray(loss_mask) > 0
        # a row's length: through its last loss token (what follows is padding)
        self.lengths = np.where(m.any(1), m.shape[1] - np.argmax(m[:, ::-1], axis=1), 1)

    def _order(self, epoch: int) -> np.ndarray:
        """[per_epoch, batch_size] row indices of an epoch's batches."""
        if self._epoch[0] == epoch:
            return self._epoch[1]
        rng = np.random.default_rng((self.seed, epoch))
        perm = rng.permutation(len(self.tokens))[:self.per_epoch * self.batch_size]
        if self.trim:
            chunk = self.group * self.batch_size
            perm = np.concatenate([c[np.argsort(self.lengths[c], kind="stable")]
                                   for c in np.split(perm, range(chunk, len(perm), chunk))])
        order = perm.reshape(self.per_epoch, self.batch_size)
        if self.trim:
            order = order[rng.permutation(self.per_epoch)]
        self._epoch = (epoch, order)
        return order

    def indices(self, step: int) -> np.ndarray:
        epoch, i = divmod(step, self.per_epoch)
        return np.sort(self._order(epoch)[i])

    def width(self, idx) -> int:
        """Columns a batch of rows idx keeps."""
        full = self.tokens.shape[1]
        if not self.trim:
            return full
        longest = int(self.lengths[idx].max())
        return min(full, -(-longest // self.trim) * self.trim)

    def get(self, step: int, params, cfg: ModelConfig):
        idx = self.indices(step)
        w = self.width(idx)
        tokens = jnp.asarray(self.tokens[idx, :w])
        mask = jnp.asarray(self.mask[idx, :w])
        if self.features is None:
            feats = self.feature_fn(params, cfg, tokens)
        else:       # one gather of the kept columns (device arrays take device indices)
            feats = jax.tree_util.tree_map(
                lambda f: jnp.asarray(f[jnp.asarray(idx) if isinstance(f, jax.Array) else idx,
                                        :w]), self.features)
        return tokens, feats, mask


def _checkpoint_manager(ckpt_dir: Path, keep: int = 2):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        ckpt_dir.resolve(), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def save_checkpoint(mngr, step: int, draft, opt_state, total: int):
    import orbax.checkpoint as ocp

    state = {"draft": draft, "opt_state": opt_state, "total": np.asarray(total, np.int64)}
    mngr.save(step, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()


def restore_checkpoint(mngr, draft, opt_state):
    """(step, draft, opt_state, total) from the latest checkpoint, or None."""
    import orbax.checkpoint as ocp

    step = mngr.latest_step()
    if step is None:
        return None
    target = {"draft": draft, "opt_state": opt_state, "total": np.asarray(0, np.int64)}
    state = mngr.restore(step, args=ocp.args.StandardRestore(target))
    return step, state["draft"], state["opt_state"], int(state["total"])


def train(params, cfg: ModelConfig, batches: Batches, tc: TrainConfig, out_dir,
          draft=None, eval_batch=None, progress: bool = True,
          on_log: Optional[Callable[[dict], None]] = None, objective=None):
    """Trains (or resumes) an EAGLE-1 head, or with `objective` (Eagle3Objective) an EAGLE-3
    head; returns (trained params fp32, log records). EAGLE-3: `objective.head(params)` is the
    Eagle3Head.

    out_dir gets ckpt/ (orbax, resumable), train_log.jsonl and loss.png.
    """
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = jax.random.PRNGKey(tc.seed)
    if draft is None:
        draft = objective.init if objective is not None else init_head(cfg,
                                                                       jax.random.fold_in(key, 1))
    opt = make_optimizer(tc)
    opt_state = opt.init(draft)
    mngr = _checkpoint_manager(out / "ckpt")
    start, total = 0, tc.steps
    restored = restore_checkpoint(mngr, draft, opt_state)
    log_path = out / "train_log.jsonl"
    records = []
    if restored is not None:
        start, draft, opt_state, total = restored
        if log_path.exists():
            records = [r for r in map(json.loads, log_path.read_text().splitlines())
                       if r.get("step", 0) <= start]
            log_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    step_fn = make_train_step(cfg, tc, opt, objective)
    evaluate = _eval_fn(cfg, tc, objective)
    t_start = time.perf_counter()
    timed_from = None
    pbar = tqdm(total=total, initial=start, disable=not progress, desc="train-eagle",
                dynamic_ncols=True)
    step = start
    with open(log_path, "a") as logf:
        while step < total:
            tokens, feats, mask = batches.get(step, params, cfg)
            draft, opt_state, metrics = step_fn(draft, opt_state, params, tokens, feats, mask,
                                                jax.random.fold_in(key, step), jnp.int32(step),
                                                jnp.int32(total))
            step += 1
            first = start + tc.calibrate_steps
            if tc.max_seconds is not None and (step in (first, first + 20) or (
                    step > first + 20 and (step - first) % tc.refit_every == 0)):
                # Time 20 steps after compilation and fit the schedule into max_seconds; then
                # fit it again from the pace since, every refit_every steps: a compile inside
                # the first 20 (the evaluation's, a new batch width) only shortens the
                # estimate for a while, and evaluations are counted in the pace.
                jax.block_until_ready(draft)
                now = time.perf_counter()
                if timed_from is None:
                    timed_from = now
                else:
                    per = (now - timed_from) / (step - first)
                    total = max(step + 1, int(step + (tc.max_seconds - (now - t_start)) / per))
                    pbar.total = total
                    pbar.refresh()
            if step % tc.log_every == 0 or step == total:
                m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                rec = {"step": step, **m, "time_s": round(time.perf_counter() - t_start, 2)}
                if eval_batch is not None:
                    ev = jax.device_get(evaluate(draft, params, *eval_batch))
                    rec.update({f"eval_{k}": float(v) for k, v in ev.items()})
                records.append(rec)
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
                pbar.set_postfix(loss=f"{m['loss']:.4f}", acc=f"{m['acc']:.3f}", lr=f"{m['lr']:.1e}")
                if on_log:
                    on_log(rec)
            pbar.update(1)
            if step % tc.ckpt_every == 0 or step == total:
                save_checkpoint(mngr, step, draft, opt_state, total)
    pbar.close()
    mngr.close()
    plot_losses(records, out / "loss.png",
                title=f"{getattr(objective, 'name', 'EAGLE-1')} head training")
    return draft, records


def plot_losses(records, path, title: str = "EAGLE-1 head training"):
    """loss / vloss / ploss (and eval loss if logged) against step, as a PNG."""
    if not records:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k in ("loss", "vloss", "ploss", "eval_loss"):
        if k in records[0]:
            axes[0].plot(steps, [r[k] for r in records], label=k)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("step")
    axes[0].legend()
    axes[0].set_title(title)
    for k in [k for k in records[-1] if k.startswith(("acc", "eval_acc"))]:
        if k in records[0]:
            axes[1].plot(steps, [r[k] for r in records], label=k)
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("draft top-1 == target top-1 (_k: k-th chained step)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def steps_per_epoch(n_rows: int, batch_size: int) -> int:
    return max(1, math.floor(n_rows / batch_size))
