"""Train SASRec or BERT4Rec with CutBCE over the full item catalog, then evaluate on the full catalog.

    python examples/train.py                      # SASRec + CutBCE on MovieLens-100K, CPU
    python examples/train.py --model bert4rec
    python examples/train.py --loss dense         # the materialized BCEWithLogitsLoss A/B
    python examples/train.py --dataset synthetic --synthetic-items 1000000
    python examples/train.py --device xla         # torch_xla (TPU, or PJRT_DEVICE=CPU)
    python examples/train.py --resume             # continue runs/.../ckpt.pt exactly where it stopped

Each epoch ends with a validation pass; the best epoch by validation NDCG@10 is kept (best.pt) and
only that model is evaluated on the test items, once, at the end, next to a popularity baseline.
Checkpoints are written atomically and hold everything the remaining run depends on (model,
optimizer, RNG states, position in the data order), so a killed run resumed with --resume ends
with the same parameters as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples` and `torch_cutbce` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from examples import data
from examples.bert4rec import BERT4Rec
from examples.evaluate import evaluate, format_metrics, model_query, popularity_query
from examples.sasrec import SASRec, RecConfig
from torch_cutbce import cut_bce_with_logits


@dataclass
class TrainConfig:
    model: str = "sasrec"  # sasrec | bert4rec
    dataset: str = "ml-100k"  # ml-100k | yambda | synthetic
    data_path: str = ""  # ml-100k: a local .inter or recbole wheel; yambda: the parquet file/folder
    synthetic_items: int = 100_000
    synthetic_users: int = 10_000
    loss: str = "cutbce"  # cutbce | dense (materialized BCEWithLogitsLoss, the A/B baseline)
    device: str = "cpu"  # cpu | xla
    mesh: str = ""  # e.g. "2x2": torch_xla SPMD over data x model devices, item table split along V (--device xla)
    out_dir: str = ""  # default: runs/<model>-<dataset>-<loss>-seed<seed> (runs/ is git-ignored)
    resume: bool = False
    seed: int = 0
    # data
    holdout: int = 1  # leave-h-out: the last h items test, the h before them validation
    k: int = 8  # SASRec's positives per position: the next k items; also the k of the Hit@k metric
    bert_labels: int = 1  # BERT4Rec's positives per masked position: its item and the bert_labels-1 after it
    max_len: int = 50
    mask_prob: float = 0.2  # BERT4Rec
    # model
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 1
    dropout: float = 0.2
    item_bias: bool = True  # a learned score offset per item (--no-item-bias: vectors only)
    # optimization
    epochs: int = 20
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    pos_weight: float = 1.0  # BCE weight of the positive term (the negatives outnumber them V / k to 1)
    block_v: int = 0  # CutBCE vocabulary tile; 0 = the library's default
    # evaluation and checkpoints
    eval_batch_size: int = 256
    exclude_seen: str = "auto"  # auto | yes | no: drop already-seen items from rankings
    patience: int = 0  # stop after this many epochs without a better validation NDCG@10; 0 = never
    ckpt_every: int = 0  # also checkpoint every this many steps (0: at the end of each epoch only)
    max_steps: int = 0  # stop after this many optimizer steps in total (0: no limit)
    kill_after_steps: int = 0  # testing aid: die abruptly after this many steps, like a kill -9
    num_threads: int = 0  # torch CPU threads (0: torch's default)

    @property
    def labels(self) -> int:
        """Width of the positive-id lists `[B, T, labels]` the loss gets."""
        return self.k if self.model == "sasrec" else self.bert_labels

    def __post_init__(self):
        if self.model not in ("sasrec", "bert4rec"):
            raise ValueError(f"unknown --model {self.model!r}; choose sasrec or bert4rec")
        if self.dataset not in data.DATASETS:
            raise ValueError(f"unknown --dataset {self.dataset!r}; choose one of {data.DATASETS}")
        if self.loss not in ("cutbce", "dense"):
            raise ValueError(f"unknown --loss {self.loss!r}; choose cutbce or dense")
        if self.device not in ("cpu", "xla"):
            raise ValueError(f"unknown --device {self.device!r}; choose cpu or xla")
        if self.mesh and (self.device != "xla" or not re.fullmatch(r"\d+x\d+", self.mesh)):
            raise ValueError(f"--mesh takes DATAxMODEL device counts (e.g. 2x2) with --device xla, got {self.mesh!r}")
        if not self.out_dir:
            self.out_dir = f"runs/{self.model}-{self.dataset}-{self.loss}-seed{self.seed}"
        if self.exclude_seen not in ("auto", "yes", "no"):
            raise ValueError(f"--exclude-seen must be auto, yes or no, got {self.exclude_seen!r}")
        for name in ("k", "bert_labels", "holdout", "max_len", "batch_size", "eval_batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.model == "bert4rec" and self.max_len < 2:
            raise ValueError("bert4rec needs --max-len >= 2 (the history plus the appended [MASK])")
        if not 0 < self.mask_prob <= 1 or self.lr <= 0 or self.pos_weight <= 0:
            raise ValueError(f"need 0 < mask_prob <= 1, lr > 0, pos_weight > 0, got "
                             f"{self.mask_prob}, {self.lr}, {self.pos_weight}")


class SimulatedKill(BaseException):
    """Raised by --kill-after-steps; BaseException so no `except Exception` swallows it."""


# Settings a resumed run must share with the checkpoint (the rest, e.g. --epochs, may change).
SAME_ON_RESUME = ("model", "dataset", "data_path", "synthetic_items", "synthetic_users", "loss", "seed",
                  "holdout", "k", "bert_labels", "max_len", "mask_prob", "dim", "num_layers", "num_heads", "dropout", "item_bias",
                  "batch_size", "lr", "weight_decay", "pos_weight", "mesh")


# ----------------------------------------------------------------------------- batches and loss


def make_batch(rows: np.ndarray, cfg: TrainConfig, model, step: int) -> dict[str, torch.Tensor]:
    """Training rows `[B, T + k]` (see data.train_windows) -> inputs, targets `[B, T, k]`, weight `[B, T]`.

    The batch is padded to batch_size with empty rows (weight 0) so every step has one shape.
    """
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
    return dict(inputs=inputs, targets=data.to_catalog_ids(future), weight=weight.float())


def multi_hot(targets: torch.Tensor, num_items: int) -> torch.Tensor:
    """`[*S, k]` catalog ids (-1 = padding) -> `[*S, V]` 0/1 labels, the dense target BCE needs."""
    labels = torch.zeros(*targets.shape[:-1], num_items + 1, device=targets.device)
    labels.scatter_(-1, torch.where(targets < 0, num_items, targets), 1.0)
    return labels[..., :num_items]


def bce_loss(hidden, item_weight, bias, targets, weight, pos_weight, cfg: TrainConfig, mesh=None) -> torch.Tensor:
    """Mean BCE over real positions and all V items: sum_n weight[n] sum_v l[n, v] / (sum_n weight[n] V).

    'cutbce' never builds the `[B, T, V]` logits; 'dense' is the code it replaces.
    """
    num_items = item_weight.shape[0]
    denominator = weight.sum().clamp(min=1) * num_items
    if cfg.loss == "cutbce":
        total = cut_bce_with_logits(hidden, item_weight, targets, bias, weight=weight, pos_weight=pos_weight,
                                    reduction="sum", block_v=cfg.block_v or None, mesh=mesh)
        return total / denominator
    logits = hidden @ item_weight.T  # [B, T, V]
    if bias is not None:
        logits = logits + bias
    per_item = F.binary_cross_entropy_with_logits(logits, multi_hot(targets, num_items),
                                                  pos_weight=pos_weight, reduction="none")
    return (per_item.sum(-1) * weight).sum() / denominator


# ----------------------------------------------------------------------------- checkpoints


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temporary file in the same folder, then rename: a kill at any moment leaves
    either the old file or the new one, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {key: to_cpu(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(value) for value in obj)
    return obj


def rng_states(device: torch.device) -> dict:
    states = {"torch": torch.get_rng_state()}
    if device.type == "xla":
        import torch_xla.core.xla_model as xm
        states["xla"] = xm.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    if device.type == "xla":
        import torch_xla.core.xla_model as xm
        xm.set_rng_state(states["xla"], device)


def get_device(name: str) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    try:
        import torch_xla
    except ImportError as e:
        raise RuntimeError("--device xla needs torch_xla: pip install -e '.[xla]'") from e
    return torch_xla.device()


def make_mesh(spec: str):
    """'DxM' -> a torch_xla SPMD mesh of D data-parallel x M vocabulary-parallel devices (or None).

    Device ids go 0..n-1 in order, as `cut_bce_with_logits(..., mesh=)` requires. On a CPU host,
    simulate devices with PJRT_DEVICE=CPU CPU_NUM_DEVICES=4.
    """
    if not spec:
        return None
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    data_n, model_n = (int(x) for x in spec.split("x"))
    return xs.Mesh(np.arange(data_n * model_n), (data_n, model_n), ("data", "model"))


def shard(tensor: torch.Tensor, mesh, spec: tuple) -> None:
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(tensor, mesh, spec)


def sync(device: torch.device) -> None:
    """Cuts and runs the lazy XLA graph of one step (a no-op on CPU)."""
    if device.type == "xla":
        import torch_xla
        torch_xla.sync()


# ----------------------------------------------------------------------------- the run


def train(cfg: TrainConfig) -> dict:
    t_start = time.time()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path, best_path = out_dir / "ckpt.pt", out_dir / "best.pt"
    mesh = make_mesh(cfg.mesh)  # before any XLA tensor exists: SPMD must be on first
    device = get_device(cfg.device)

    # data: the set and its split depend on the data seed (0), never on --seed
    ds = data.load_dataset(cfg.dataset, cfg.data_path or None, synthetic_items=cfg.synthetic_items,
                           synthetic_users=cfg.synthetic_users)
    ds = data.drop_short_users(ds, 2 * cfg.holdout + 1)
    windows = data.train_windows(ds, cfg.holdout, cfg.max_len, cfg.labels)
    exclude_seen = {"yes": True, "no": False, "auto": not ds.has_repeats()}[cfg.exclude_seen]
    steps_per_epoch = math.ceil(len(windows) / cfg.batch_size)
    print(f"{ds.name}: {ds.num_users} users, {ds.num_items} items, {len(ds.items)} events, "
          f"{len(windows)} training windows of {cfg.max_len}, {steps_per_epoch} steps/epoch, "
          f"exclude_seen={exclude_seen}")

    # model and optimizer; the seed fixes the initialization (made on CPU, so equal on every device)
    torch.manual_seed(cfg.seed)
    model_cfg = RecConfig(ds.num_items, cfg.max_len, cfg.dim, cfg.num_layers, cfg.num_heads, dropout=cfg.dropout,
                          item_bias=cfg.item_bias)
    model = (SASRec if cfg.model == "sasrec" else BERT4Rec)(model_cfg)
    if model.item_bias is not None:
        # Start at the base rate of a positive, log(k / V): otherwise the first steps spend
        # themselves pushing every score down, through the item vectors too.
        torch.nn.init.constant_(model.item_bias, math.log(cfg.labels / ds.num_items))
    model = model.to(device)
    if mesh is not None:
        shard(model.item_emb.weight, mesh, ("model", None))  # each device holds a slice of the catalog
        if model.item_bias is not None:
            shard(model.item_bias, mesh, ("model",))
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    pos_weight = None if cfg.pos_weight == 1.0 else torch.full((ds.num_items,), cfg.pos_weight, device=device)
    if device.type == "xla":
        import torch_xla.core.xla_model as xm
        xm.set_rng_state(cfg.seed, device)
    context_len = cfg.max_len if cfg.model == "sasrec" else cfg.max_len - 1
    eval_kwargs = dict(context_len=context_len, k_next=cfg.k, exclude_seen=exclude_seen,
                       batch_size=cfg.eval_batch_size)

    # training state, fresh or from the checkpoint
    state = dict(epoch=0, step_in_epoch=0, step=0, losses=[], val=[], best_epoch=-1, best_ndcg=-1.0,
                 bad_epochs=0, done=False, train_time_s=0.0, positions=0)
    if cfg.resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        changed = [n for n in SAME_ON_RESUME if ckpt["config"][n] != getattr(cfg, n)]
        if changed:
            raise ValueError(f"--resume: {changed} differ from the checkpoint in {ckpt_path}; use another --out-dir")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        set_rng_states(ckpt["rng"], device)
        state = ckpt["state"]
        order = np.random.default_rng([cfg.seed, state["epoch"]]).permutation(len(windows))
        if state["step_in_epoch"] and not np.array_equal(order, ckpt["data_order"]):
            raise ValueError(f"--resume: the training data differ from the checkpoint's ({len(windows)} windows "
                             f"now, {len(ckpt['data_order'])} then); the run cannot continue exactly")
        print(f"resumed from {ckpt_path}: epoch {state['epoch']}, step {state['step']}")
    elif cfg.resume:
        print(f"--resume: no checkpoint in {out_dir}, starting fresh")

    def save_checkpoint():
        atomic_save(dict(config=dataclasses.asdict(cfg), model=to_cpu(model.state_dict()),
                         optimizer=to_cpu(optimizer.state_dict()), rng=to_cpu(rng_states(device)),
                         state=state, data_order=order), ckpt_path)

    while state["epoch"] < cfg.epochs and not state["done"]:
        epoch = state["epoch"]
        # The data order of an epoch is a function of (seed, epoch): the same after a resume.
        order = np.random.default_rng([cfg.seed, epoch]).permutation(len(windows))
        model.train()
        bar = tqdm(total=steps_per_epoch, initial=state["step_in_epoch"], desc=f"epoch {epoch}",
                   disable=None, mininterval=1.0, leave=False)
        while state["step_in_epoch"] < steps_per_epoch:
            t0 = time.time()
            i = state["step_in_epoch"]
            batch = make_batch(windows[order[i * cfg.batch_size:(i + 1) * cfg.batch_size]], cfg, model, state["step"])
            batch = {name: t.to(device) for name, t in batch.items()}
            if mesh is not None:
                shard(batch["inputs"], mesh, ("data", None))  # positions split over the data axis
            hidden = model(batch["inputs"])
            loss = bce_loss(hidden, model.item_weight, model.item_bias, batch["targets"], batch["weight"],
                            pos_weight, cfg, mesh)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sync(device)
            state["losses"].append(loss.item())
            state["step_in_epoch"] += 1
            state["step"] += 1
            state["positions"] += cfg.batch_size * cfg.max_len
            state["train_time_s"] += time.time() - t0
            bar.update(1)
            bar.set_postfix(loss=f"{state['losses'][-1]:.5f}",
                            pos_per_s=f"{state['positions'] / max(state['train_time_s'], 1e-9):.0f}")
            if cfg.ckpt_every and state["step"] % cfg.ckpt_every == 0:
                save_checkpoint()
            if cfg.kill_after_steps and state["step"] == cfg.kill_after_steps:
                raise SimulatedKill(f"killed after step {state['step']}")
            if cfg.max_steps and state["step"] >= cfg.max_steps:
                state["done"] = True
                break
        bar.close()

        # validation; the only thing model selection looks at
        model.eval()
        val = evaluate(model_query(model), ds, cfg.holdout, "val", device=device, **eval_kwargs)
        epoch_losses = state["losses"][len(state["losses"]) - state["step_in_epoch"]:]
        train_loss = float(np.mean(epoch_losses)) if epoch_losses else float("nan")
        state["val"].append(dict(epoch=epoch, step=state["step"], train_loss=train_loss, **val))
        if val["NDCG@10"] > state["best_ndcg"]:
            state["best_ndcg"], state["best_epoch"], state["bad_epochs"] = val["NDCG@10"], epoch, 0
            atomic_save(dict(epoch=epoch, val=val, model=to_cpu(model.state_dict())), best_path)
        else:
            state["bad_epochs"] += 1
            state["done"] |= bool(cfg.patience) and state["bad_epochs"] >= cfg.patience
        print(f"epoch {epoch:3d} | loss {train_loss:.6f} | val {format_metrics(val)} | best epoch "
              f"{state['best_epoch']} | {state['positions'] / max(state['train_time_s'], 1e-9):.0f} pos/s | "
              f"{time.time() - t_start:.0f}s")
        state["epoch"] += 1
        state["step_in_epoch"] = 0
        save_checkpoint()

    # test, once, with the model validation picked
    if best_path.exists():
        model.load_state_dict(torch.load(best_path, weights_only=False)["model"])
    model.eval()
    test = evaluate(model_query(model), ds, cfg.holdout, "test", device=device, **eval_kwargs)
    popularity = {stage: evaluate(popularity_query(ds, cfg.holdout, stage), ds, cfg.holdout, stage, **eval_kwargs)
                  for stage in ("val", "test")}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = dict(
        config=dataclasses.asdict(cfg),
        data=dict(name=ds.name, users=ds.num_users, items=ds.num_items, events=len(ds.items),
                  train_windows=len(windows), exclude_seen=exclude_seen),
        best_epoch=state["best_epoch"], test=test, popularity=popularity, history=state["val"],
        steps=state["step"], train_time_s=state["train_time_s"],
        positions_per_s=state["positions"] / max(state["train_time_s"], 1e-9),
        peak_rss_mib=usage.ru_maxrss / 1024,  # Linux reports KiB
        cpu_s=usage.ru_utime + usage.ru_stime,  # all threads; less sensitive than wall_s to other load
        wall_s=time.time() - t_start,
    )
    (out_dir / "metrics.json").write_text(json.dumps(result, indent=2))
    plot_curves(state, popularity["val"], out_dir / "curves.png")
    print(f"test  ({cfg.model}, {cfg.loss}, best epoch {state['best_epoch']}): {format_metrics(test)}")
    print(f"test  (popularity): {format_metrics(popularity['test'])}")
    print(f"peak RSS {result['peak_rss_mib']:.0f} MiB, {result['positions_per_s']:.0f} positions/s, "
          f"wall {result['wall_s']:.0f}s, CPU {result['cpu_s']:.0f}s; wrote {out_dir / 'metrics.json'} and {out_dir / 'curves.png'}")
    return result


def plot_curves(state: dict, popularity_val: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(state["losses"], lw=0.7)
    ax_loss.set(xlabel="step", ylabel="train loss (mean BCE per item)", yscale="log", title="training loss")
    epochs = [v["epoch"] for v in state["val"]]
    for name in ("HR@10", "NDCG@10"):
        line, = ax_val.plot(epochs, [v[name] for v in state["val"]], marker=".", label=name)
        ax_val.axhline(popularity_val[name], color=line.get_color(), ls="--", lw=0.8, label=f"popularity {name}")
    ax_val.set(xlabel="epoch", title="validation (full catalog)")
    ax_val.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None) -> TrainConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        if isinstance(field.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    return TrainConfig(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # epoch lines show up live in CI logs and pipes
    try:
        train(parse_args())
    except SimulatedKill as e:
        print(e, file=sys.stderr)
        os._exit(137)
