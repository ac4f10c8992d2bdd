"""Train SASRec or BERT4Rec with CutBCE over the full item catalog, then evaluate on the full catalog.

    python examples/train.py                      # SASRec + CutBCE on MovieLens-100K, CPU
    python examples/train.py --model bert4rec
    python examples/train.py --loss dense         # the materialized BCEWithLogitsLoss A/B
    python examples/train.py --loss sampled       # baseline: the next item against 1 sampled negative
    python examples/train.py --loss ce            # baseline: full-softmax cross-entropy on the next item
    python examples/train.py --dataset synthetic --synthetic-items 1000000
    python examples/train.py --device xla         # torch_xla (TPU, or PJRT_DEVICE=CPU)
    python examples/train.py --resume             # continue runs/.../ckpt.pt exactly where it stopped
    torchrun --standalone --nproc-per-node 2 examples/train.py --fsdp   # data parallel, table sharded by FSDP2

Each epoch ends with a validation pass; the best epoch by validation NDCG@10 is kept (best.pt) and
only that model is evaluated on the test items, once, at the end, next to a popularity baseline.
Checkpoints are written atomically and hold everything the remaining run depends on (model,
optimizer, RNG states, position in the data order), so a killed run resumed with --resume ends
with the same parameters as an uninterrupted one. A bad flag, or a file or folder the run cannot
use (the data, a checkpoint, --out-dir), ends the run with one line naming it and exit status 2.

The run reads top to bottom in `train`: load the data, build the model, start or resume, then per
epoch `train_one_epoch` and `validate`, and at the end `test_and_report`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: make `examples` and `torch_cutbce` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from tqdm import tqdm

from examples import data, fsdp
from examples.bert4rec import BERT4Rec
from examples.config import TrainConfig, parse_args
# ResumeError: train() raises it, callers catch it as train.ResumeError.
from examples.checkpoint import (ResumeError, RunError, TrainState, atomic_save, load_model_state,  # noqa: F401
                                 model_state, save_checkpoint, start_or_resume)
from examples.device import get_device, make_mesh, shard, sync
from examples.evaluate import evaluate, evaluate_users, format_metrics, model_query, popularity_query, ranked_items
# multi_hot: benchmarks/tpu_torch_step.py imports it from here.
from examples.losses import bce_loss, multi_hot, sampled_bce_loss, softmax_ce_loss  # noqa: F401
from examples.sasrec import RecConfig, SASRec

MODELS = {"sasrec": SASRec, "bert4rec": BERT4Rec}
NEGATIVES_STREAM = 2  # the negatives' generator is seeded [seed, step, 2]; the data order's is [seed, epoch]


# ----------------------------------------------------------------------------- batches and loss


def make_batch(rows: np.ndarray, cfg: TrainConfig, model, step: int, users: np.ndarray | None = None,
               sampler: data.NegativeSampler | None = None) -> dict[str, torch.Tensor]:
    """Training rows `[B, T + k]` (see data.train_windows) -> inputs, targets `[B, T, k]`, weight `[B, T]`.

    The batch is padded to batch_size with empty rows (weight 0) so every step has one shape.
    With --loss sampled, also negatives `[B, T, K]` (catalog ids) for the rows' `users`, drawn
    from `sampler` with a generator seeded by (seed, step), so a resumed run draws the same ones.
    """
    if cfg.loss == "sampled":
        users = np.concatenate([users, np.full(cfg.batch_size - len(users), -1)])  # -1: a padding row
        generator = np.random.default_rng([cfg.seed, step, NEGATIVES_STREAM])
        negatives = data.to_catalog_ids(torch.from_numpy(sampler.sample(users, (cfg.max_len, cfg.negatives),
                                                                        generator)))
    rows = torch.from_numpy(rows).long()
    if rows.shape[0] < cfg.batch_size:
        rows = torch.cat([rows, rows.new_zeros(cfg.batch_size - rows.shape[0], rows.shape[1])])
    T, k = cfg.max_len, cfg.labels
    windows = rows.unfold(1, k, 1)  # [B, T + 1, k]: windows[:, t] = rows[:, t:t + k]
    inputs = rows[:, :T]
    if cfg.model == "sasrec":
        future = windows[:, 1 : T + 1]  # the k items after position t
        weight = (inputs != 0) & (future != 0).any(-1)
    else:
        # The mask draw depends only on (seed, step): a resumed run draws the same masks.
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        weight = model.mask_items(inputs, cfg.mask_prob, generator)
        inputs = torch.where(weight, model.mask_id, inputs)
        future = windows[:, :T]  # the hidden item itself, then the bert_labels - 1 after it
    batch = dict(inputs=inputs, targets=data.to_catalog_ids(future), weight=weight.float())
    if cfg.loss == "sampled":
        batch["negatives"] = negatives
    return batch


def loss_of_batch(model, batch: dict[str, torch.Tensor], cfg: TrainConfig, pos_weight=None, mesh=None,
                  ranks: fsdp.Ranks | None = None):
    """The training loss of one batch (see examples/losses.py); with --fsdp this rank's share of it."""
    hidden = model(batch["inputs"])
    if ranks is not None:
        return fsdp.bce_loss(hidden, model, batch["targets"], batch["weight"], pos_weight, cfg, ranks)
    if cfg.loss == "sampled":
        return sampled_bce_loss(hidden, model.item_weight, model.item_bias, batch["targets"][..., 0],
                                batch["negatives"], batch["weight"], cfg.pos_weight)
    if cfg.loss == "ce":
        return softmax_ce_loss(hidden, model.item_weight, model.item_bias, batch["targets"], batch["weight"])
    return bce_loss(hidden, model.item_weight, model.item_bias, batch["targets"], batch["weight"], pos_weight,
                    cfg, mesh)


# ----------------------------------------------------------------------------- the pieces of a run


@dataclass
class Run:
    """What a run is made of once built: the data, the model and where it runs."""

    cfg: TrainConfig
    ds: data.SeqDataset
    windows: np.ndarray  # [W, max_len + labels] training windows (data.train_windows)
    exclude_seen: bool
    device: torch.device
    mesh: object  # a torch_xla SPMD mesh, or None
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    pos_weight: torch.Tensor | None
    out_dir: Path
    users: np.ndarray | None = None  # [W] the user of each window (--loss sampled)
    sampler: data.NegativeSampler | None = None  # --loss sampled
    ranks: fsdp.Ranks | None = None  # --fsdp

    @property
    def main(self) -> bool:
        """The process that prints and writes files (rank 0 with --fsdp)."""
        return self.ranks is None or self.ranks.main

    @property
    def world(self) -> int:
        return 1 if self.ranks is None else self.ranks.world

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.windows) / self.cfg.batch_size)

    @property
    def eval_kwargs(self) -> dict:
        """The settings `evaluate` shares for the model and the popularity baseline."""
        context_len = self.cfg.max_len if self.cfg.model == "sasrec" else self.cfg.max_len - 1  # BERT4Rec: + [MASK]
        return dict(context_len=context_len, k_next=self.cfg.k, exclude_seen=self.exclude_seen,
                    batch_size=self.cfg.eval_batch_size)

    def data_order(self, epoch: int) -> np.ndarray:
        """The windows' order in `epoch`: a function of (seed, epoch), so the same after a resume."""
        return np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.windows))


def _usable_out_dir(out_dir: Path) -> Path:
    """--out-dir, created; a file there, or a folder this process cannot write, is a RunError."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RunError(f"--out-dir {out_dir}: cannot create it ({type(error).__name__}: {error})") from error
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise RunError(f"--out-dir {out_dir}: this process cannot write there")
    return out_dir


def load_data(cfg: TrainConfig) -> tuple[data.SeqDataset, np.ndarray, bool]:
    """The data set, its training windows and whether rankings exclude seen items.

    The set and its split depend on the data seed (0), never on --seed.
    """
    source = f"--dataset {cfg.dataset}" + (f" --data-path {cfg.data_path}" if cfg.data_path else "")
    try:
        ds = data.load_dataset(cfg.dataset, cfg.data_path or None, synthetic_items=cfg.synthetic_items,
                               synthetic_users=cfg.synthetic_users)
    except (OSError, ValueError, KeyError, IndexError, EOFError, zipfile.BadZipFile) as error:
        # A missing, truncated or malformed file: say which and what, not a traceback from the reader.
        raise RunError(f"{source}: cannot read the data ({type(error).__name__}: {error})") from error
    try:
        ds = data.drop_short_users(ds, 2 * cfg.holdout + 1)
    except ValueError as error:
        raise RunError(f"--holdout {cfg.holdout}: {error}") from error
    if ds.num_items < ranked_items(cfg.k):  # --dataset synthetic: refused at parse time (config.py)
        raise RunError(f"{source}: {ds.num_items} items, fewer than the top {ranked_items(cfg.k)} the metrics rank")
    windows = data.train_windows(ds, cfg.holdout, cfg.max_len, cfg.labels)
    exclude_seen = {"yes": True, "no": False, "auto": not ds.has_repeats()}[cfg.exclude_seen]
    return ds, windows, exclude_seen


def build_model(cfg: TrainConfig, num_items: int, device: torch.device, mesh, ranks: fsdp.Ranks | None = None):
    """The model, its optimizer (Adam or AdamW) and the loss's pos_weight (None when 1).

    The seed fixes the initialization, made on the CPU so that it is the same on every device (and
    on every rank: with --fsdp each rank then keeps its shard, examples/fsdp.py shard_model).
    """
    torch.manual_seed(cfg.seed)
    model = MODELS[cfg.model](RecConfig(num_items, cfg.max_len, cfg.dim, cfg.num_layers, cfg.num_heads,
                                        dropout=cfg.dropout, item_bias=cfg.item_bias))
    if model.item_bias is not None:
        # Start at the log-odds of a positive, about log(k / V) over the full catalog: otherwise
        # the first steps spend themselves pushing every score down, through the item vectors
        # too. Sampled BCE sees 1 positive per K negatives: log(1 / K), 0 (no bias) for K = 1. A
        # softmax is shift-invariant, so for --loss ce every constant is the same start: 0.
        base_odds = {"sampled": 1 / cfg.negatives, "ce": 1.0}.get(cfg.loss, cfg.labels / num_items)
        torch.nn.init.constant_(model.item_bias, math.log(base_odds))
    model = model.to(device)
    if mesh is not None:
        shard(model.item_emb.weight, mesh, ("model", None))  # each device holds a slice of the catalog
        if model.item_bias is not None:
            shard(model.item_bias, mesh, ("model",))
    if ranks is not None:
        fsdp.shard_model(model, ranks)  # before the optimizer: it holds the sharded parameters
    optimizer_class = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[cfg.optimizer]
    optimizer = optimizer_class(model.parameters(), lr=cfg.lr, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    pos_weight = None if cfg.pos_weight == 1.0 else torch.full((num_items,), cfg.pos_weight, device=device)
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(cfg.seed, device)
    return model, optimizer, pos_weight


def train_step(run: Run, batch: dict[str, torch.Tensor]) -> float:
    """One optimizer step on one batch; returns the loss (--fsdp: of the global batch, the ranks' mean)."""
    if run.mesh is not None:
        shard(batch["inputs"], run.mesh, ("data", None))  # positions split over the data axis
    if run.ranks is not None:
        batch = fsdp.local_rows(batch, run.ranks)  # this rank's rows of the global batch
    loss = loss_of_batch(run.model, batch, run.cfg, run.pos_weight, run.mesh, run.ranks)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    run.optimizer.step()
    sync(run.device)
    return loss.item() if run.ranks is None else fsdp.mean_over_ranks(loss)


def train_one_epoch(run: Run, state: TrainState, after_step: Callable[[int], None] | None) -> None:
    """The steps of epoch `state.epoch` from `state.step_in_epoch` on (a resumed run starts mid-epoch)."""
    cfg = run.cfg
    order = run.data_order(state.epoch)
    run.model.train()
    bar = tqdm(total=run.steps_per_epoch, initial=state.step_in_epoch, desc=f"epoch {state.epoch}", disable=None,
               mininterval=1.0, leave=False) if run.main else tqdm(disable=True)
    while state.step_in_epoch < run.steps_per_epoch:
        t0 = time.time()
        i = state.step_in_epoch
        rows = order[i * cfg.batch_size:(i + 1) * cfg.batch_size]
        users = None if run.users is None else run.users[rows]
        batch = make_batch(run.windows[rows], cfg, run.model, state.step, users, run.sampler)
        state.losses.append(train_step(run, {name: t.to(run.device) for name, t in batch.items()}))
        state.step_in_epoch += 1
        state.step += 1
        state.positions += cfg.batch_size * cfg.max_len
        state.train_time_s += time.time() - t0
        bar.update(1)
        bar.set_postfix(loss=f"{state.losses[-1]:.5f}", pos_per_s=f"{state.positions_per_s():.0f}")
        if cfg.ckpt_every and state.step % cfg.ckpt_every == 0:
            save_checkpoint(run, state)
        if after_step is not None:
            after_step(state.step)
        if cfg.max_steps and state.step >= cfg.max_steps:
            state.done = True
            break
    bar.close()


def validate(run: Run, state: TrainState) -> dict[str, float]:
    """Validation metrics of the epoch just trained, the only thing model selection looks at.

    Keeps the best model so far in best.pt and counts epochs without improvement for --patience.
    """
    run.model.eval()
    val, _ = evaluate_model(run, "val")
    epoch_losses = state.losses[len(state.losses) - state.step_in_epoch:]
    train_loss = float(np.mean(epoch_losses)) if epoch_losses else float("nan")
    state.val.append(dict(epoch=state.epoch, step=state.step, train_loss=train_loss, **val))
    if val["NDCG@10"] > state.best_ndcg:
        state.best_ndcg, state.best_epoch, state.bad_epochs = val["NDCG@10"], state.epoch, 0
        best = dict(epoch=state.epoch, val=val, model=model_state(run))
        if run.main:
            atomic_save(best, run.out_dir / "best.pt")
    else:
        state.bad_epochs += 1
        state.done |= bool(run.cfg.patience) and state.bad_epochs >= run.cfg.patience
    return val


def evaluate_model(run: Run, stage: str) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Full-catalog metrics of the model: their means and every user's. --fsdp: every rank ranks every
    user against the gathered table (the same computation as one process); rank 0's means are every
    rank's, so that model selection and --patience decide alike everywhere."""
    query = model_query(run.model) if run.ranks is None else fsdp.query(run.model)
    users = evaluate_users(query, run.ds, run.cfg.holdout, stage, device=run.device, **run.eval_kwargs)
    means = {name: float(values.mean()) for name, values in users.items()}
    return (means if run.ranks is None else fsdp.broadcast(means)), users


def test_and_report(run: Run, state: TrainState, t_start: float) -> dict:
    """Tests the model validation picked, once, next to popularity; writes metrics.json and curves.png."""
    cfg, ds = run.cfg, run.ds
    final = dict(parameter_stats(run.model), adam=adam_scale(run.model, run.optimizer, cfg.adam_eps))
    best_path = run.out_dir / "best.pt"
    if best_path.exists() if run.ranks is None else fsdp.broadcast(best_path.exists()):  # rank 0's file
        load_model_state(run, torch.load(best_path, weights_only=False)["model"] if run.main else {})
    run.model.eval()
    test, test_users = evaluate_model(run, "test")
    popularity = {stage: evaluate(popularity_query(ds, cfg.holdout, stage), ds, cfg.holdout, stage, **run.eval_kwargs)
                  for stage in ("val", "test")}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = dict(
        config=dataclasses.asdict(cfg),
        data=dict(name=ds.name, users=ds.num_users, items=ds.num_items, events=len(ds.items),
                  train_windows=len(run.windows), exclude_seen=run.exclude_seen),
        setup=dict(loss=cfg.loss, negatives=cfg.negatives if cfg.loss == "sampled" else None,
                   normalization=None if cfg.loss in ("sampled", "ce") else cfg.normalization, optimizer=cfg.optimizer,
                   adam_eps=cfg.adam_eps, weight_decay=cfg.weight_decay),
        best_epoch=state.best_epoch, test=test, popularity=popularity, history=state.val,
        parameters=dict(final=final, tested=parameter_stats(run.model)),
        steps=state.step, train_time_s=state.train_time_s, positions_per_s=state.positions_per_s(),
        peak_rss_mib=usage.ru_maxrss / 1024,  # Linux reports KiB
        cpu_s=usage.ru_utime + usage.ru_stime,  # all threads; less sensitive than wall_s to other load
        wall_s=time.time() - t_start,
    )
    if not run.main:
        return result
    (run.out_dir / "metrics.json").write_text(json.dumps(result, indent=2))
    np.savez(run.out_dir / "test_users.npz", **test_users)  # per test user, for examples/compare.py
    plot_curves(state, popularity["val"], run.out_dir / "curves.png")
    print(f"test  ({cfg.model}, {cfg.loss}, best epoch {state.best_epoch}): {format_metrics(test)}")
    print(f"test  (popularity): {format_metrics(popularity['test'])}")
    tested = result["parameters"]["tested"]
    if "item_bias" in tested:
        print("item bias (tested model): mean {mean:.3f} std {std:.3f} min {min:.3f} max {max:.3f}; "
              .format(**tested["item_bias"]) + "item row norm mean {mean:.3f} std {std:.3f}".format(
                  **tested["item_row_norm"]))
    print(f"peak RSS {result['peak_rss_mib']:.0f} MiB, {result['positions_per_s']:.0f} positions/s, "
          f"wall {result['wall_s']:.0f}s, CPU {result['cpu_s']:.0f}s; "
          f"wrote metrics.json, test_users.npz and curves.png to {run.out_dir}")
    return result


def summary(values: torch.Tensor) -> dict[str, float]:
    values = values.detach().cpu().double().flatten()
    return dict(mean=float(values.mean()), std=float(values.std()), min=float(values.min()),
                max=float(values.max()))


def parameter_stats(model) -> dict:
    """What the item bias and the item table learned: the bias's spread and the table's row norms.

    With --fsdp (a sharded model) the table is gathered: every rank must call it."""
    if fsdp.is_sharded(model):
        item_weight, item_bias = fsdp.item_table(model)
    else:
        item_weight, item_bias = model.item_weight, model.item_bias
    stats = dict(item_row_norm=summary(item_weight.norm(dim=1)))
    if item_bias is not None:
        stats["item_bias"] = summary(item_bias)
    return stats


def adam_scale(model, optimizer, eps: float) -> dict:
    """Adam's bias-corrected sqrt(v) (the gradients' running RMS) at the end, against its eps.

    Adam moves a parameter by lr * m / (sqrt(v) + eps): where sqrt(v) is far below eps, steps are
    far below lr. This shows whether a normalisation puts the gradients there.

    Returns:
        Per group (item_bias, item_table, other): the median of sqrt(v_hat) and the fraction of
        entries where it is below eps.
    """
    item_rows = slice(1, model.cfg.num_items + 1)  # the catalog rows of the tied table (no padding/[MASK])
    groups = {"item_bias": [], "item_table": [], "other": []}
    for name, param in model.named_parameters():
        state = optimizer.state.get(param)
        if not state:
            continue
        beta2 = optimizer.param_groups[0]["betas"][1]
        exp_avg_sq = fsdp.whole(state["exp_avg_sq"])  # --fsdp: gathered (every rank calls it, in one order)
        rms = (exp_avg_sq.detach().cpu().double() / (1 - beta2 ** float(fsdp.whole(state["step"])))).sqrt()
        # --fsdp keeps the bias with the table, rows 1..V (examples/fsdp.py)
        group = {"item_bias": "item_bias", "item_emb.bias": "item_bias", "item_emb.weight": "item_table"}.get(
            name, "other")
        groups[group].append(rms[item_rows] if name.startswith("item_emb.") else rms)
    return {group: dict(median_sqrt_v=float(torch.cat([r.flatten() for r in rms]).median()),
                        below_eps=float(torch.cat([(r < eps).flatten() for r in rms]).double().mean()))
            for group, rms in groups.items() if rms}


def plot_curves(state: TrainState, popularity_val: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(state.losses, lw=0.7)
    ax_loss.set(xlabel="step", ylabel="train loss (--loss, --normalization)", yscale="log", title="training loss")
    epochs = [v["epoch"] for v in state.val]
    for name in ("HR@10", "NDCG@10"):
        line, = ax_val.plot(epochs, [v[name] for v in state.val], marker=".", label=name)
        ax_val.axhline(popularity_val[name], color=line.get_color(), ls="--", lw=0.8, label=f"popularity {name}")
    ax_val.set(xlabel="epoch", ylabel="metric on the validation users (0-1)", title="validation (full catalog)")
    ax_val.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- the run


def train(cfg: TrainConfig, *, after_step: Callable[[int], None] | None = None) -> dict:
    """Trains, validates each epoch, tests the best epoch; returns what metrics.json holds.

    Args:
        cfg: the run's settings.
        after_step: called with the step number after each optimizer step and its checkpoint (if
            any). Not a command-line option: tests pass one that raises, to kill a run mid-epoch.

    Returns:
        The metrics, configuration and history written to `<out_dir>/metrics.json`.

    Raises:
        ResumeError: --resume with an incompatible checkpoint.
    """
    t_start = time.time()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    out_dir = _usable_out_dir(Path(cfg.out_dir))
    mesh = make_mesh(cfg.mesh)  # before any XLA tensor exists: SPMD must be on first
    started = cfg.fsdp and not fsdp.dist.is_initialized()
    ranks = fsdp.start() if cfg.fsdp else None  # the process group of torchrun's processes
    device = get_device(cfg.device) if ranks is None else ranks.device

    ds, windows, exclude_seen = load_data(cfg)
    model, optimizer, pos_weight = build_model(cfg, ds.num_items, device, mesh, ranks)
    run = Run(cfg, ds, windows, exclude_seen, device, mesh, model, optimizer, pos_weight, out_dir, ranks=ranks)
    if cfg.loss == "sampled":
        run.users = data.window_users(ds, cfg.holdout, cfg.max_len)
        try:
            run.sampler = data.NegativeSampler(ds, cfg.holdout)
        except ValueError as error:  # a user has seen the whole catalog: the data decide, not a flag
            raise RunError(f"--loss sampled: {error}") from error
    if run.main:
        print(f"{ds.name}: {ds.num_users} users, {ds.num_items} items, {len(ds.items)} events, "
              f"{len(windows)} training windows of {cfg.max_len}, {run.steps_per_epoch} steps/epoch, "
              f"exclude_seen={exclude_seen}" + (f", {run.world} ranks (FSDP2) on {device.type}" if ranks else ""))

    state = start_or_resume(run)
    while state.epoch < cfg.epochs and not state.done:
        train_one_epoch(run, state, after_step)
        val = validate(run, state)
        if run.main:
            print(f"epoch {state.epoch:3d} | loss {state.val[-1]['train_loss']:.6f} | val {format_metrics(val)} | "
                  f"best epoch {state.best_epoch} | {state.positions_per_s():.0f} pos/s | "
                  f"{time.time() - t_start:.0f}s")
        state.epoch += 1
        state.step_in_epoch = 0
        save_checkpoint(run, state)
    result = test_and_report(run, state, t_start)
    if started:
        fsdp.stop()
    return result


# ----------------------------------------------------------------------------- command line


def main(argv=None) -> int:
    cfg = parse_args(argv, description=__doc__)
    try:
        train(cfg)
    except RunError as error:  # the data, a checkpoint or --out-dir: one line naming the file
        if fsdp.is_main():
            print(f"examples/train.py: error: {error}", file=sys.stderr)
        fsdp.stop(barrier=False)
        return 2
    return 0


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # epoch lines show up live in CI logs and pipes
    sys.exit(main())
