"""The training loop of `bigbatch train`: data order, cached contrastive steps, eval, checkpoints.

One step takes the next ``batch_size`` training pairs of the epoch's permutation (a
generator seeded by ``(seed, epoch)``, so the order depends only on the step number),
encodes queries and documents with ONE shared encoder through :class:`bigbatch.GradCache`
in chunks (memory of one chunk, not of the batch), computes the contrastive loss over the
whole batch (every other document of the batch is a negative), accumulates the exact
full-batch gradient and takes an AdamW step. ``accumulate=True`` is the comparison baseline
(gradient accumulation: each chunk's loss only sees its own chunk's negatives).

Under ``torchrun`` each rank encodes its shard of the global batch; the loss gets
``group=WORLD`` (exact over the global batch) and gradients are averaged over ranks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .data import (DataError, Pair, Splits, builtin_codesearch, data_fingerprint, default_cache_dir, jsonl_splits,
                   repeated_positives)
from .interrupt import AgreedStop, sigint_deferred
from .metrics import MetricsLog, encode_all, format_metrics, retrieval_metrics, summary_table
from .model import DualEncoder, Inputs, build_model, resolve_model_path, select

LOSSES = ("clip", "infonce", "siglip")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
OUTPUT_FILES = ("config.json", "metrics.jsonl", "metrics.png", "results.json", "checkpoints")


@dataclass
class TrainConfig:
    """Everything that determines a run (saved as ``<out>/config.json``; resuming requires the same)."""

    data: str = "builtin"  # "builtin" or a JSONL path
    eval_data: Optional[str] = None
    max_pairs: int = 30000  # cap on built-in pairs (extraction time grows with it)
    heldout_fraction: float = 0.1
    model: str = "bag"  # "bag", "minilm" or a Hugging Face directory
    max_length: int = 128
    buckets: int = 2**18
    dim: int = 256
    loss: str = "clip"
    hard_negatives: int = 0  # per query, for loss="infonce" (from the data's "negatives")
    batch_size: int = 4096
    chunk_size: Optional[int] = 256
    memory_budget: Optional[str] = None  # e.g. "2GiB": GradCache sizes the chunks instead
    accumulate: bool = False  # gradient accumulation over chunks instead of caching (baseline)
    precision: str = "fp32"
    lr: Optional[float] = None  # peak learning rate; None: 1e-2 for the bag model, 5e-5 for transformers
    weight_decay: float = 0.0
    warmup: float = 0.05  # fraction of steps with linear warm-up, then cosine decay to 0
    epochs: float = 3.0
    steps: Optional[int] = None  # overrides epochs
    seed: int = 0
    eval_every: Optional[int] = None  # steps; default once per epoch
    save_every: Optional[int] = None  # steps; default once per epoch
    save: bool = True  # write checkpoints (no checkpoints: no --resume)
    backend: str = "auto"
    out: str = "runs/bigbatch-train"
    device: str = "auto"
    progress: bool = True

    # Fields that may differ on --resume (they do not change the trajectory).
    RESUMABLE_OVERRIDES = ("device", "progress", "out", "eval_every", "save_every", "save", "backend")
    # ... of which these belong to the invocation, not the run: always the resuming command's
    INVOCATION = ("device", "progress", "out", "save")

    def peak_lr(self) -> float:
        """``lr``, or the default for the model: 1e-2 (bag: embeddings learn fast) or 5e-5 (transformers)."""
        if self.lr is not None:
            return self.lr
        return 1e-2 if self.model == "bag" else 5e-5

    def without_effect(self) -> Dict[str, str]:
        """Options that this configuration does not use, with the reason (a note when given; never
        a --resume clash)."""
        out = {}
        if self.data != "builtin":
            out["max_pairs"] = "caps only the built-in data, not --data FILE"
        if self.eval_data is not None:
            out["heldout_fraction"] = "holds out part of --data only without --eval-data"
        if self.model != "bag":
            out["dim"] = out["buckets"] = "sizes only the built-in bag model"
        if self.steps is not None:
            out["epochs"] = "sets the length only without --steps"
        return out

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def check(self) -> None:
        """Raise ValueError naming the option for any value that cannot work."""
        if self.loss not in LOSSES:
            raise ValueError(f"--loss must be one of {LOSSES}, got {self.loss!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {tuple(PRECISIONS)}, got {self.precision!r}")
        for name in ("batch_size", "max_length", "max_pairs", "buckets", "dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.batch_size < 2:
            raise ValueError(f"--batch-size must be >= 2 (a contrastive batch needs negatives), got {self.batch_size}")
        if self.model == "bag" and (self.dim < 2 or self.buckets < 2):  # LayerNorm of one feature is 0: one vector for all
            raise ValueError(f"--dim and --buckets must be >= 2 for the bag model, got --dim {self.dim} --buckets {self.buckets}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"--chunk-size must be >= 1, got {self.chunk_size}")
        if self.chunk_size is not None and self.memory_budget is not None:
            raise ValueError("give --chunk-size or --memory-budget, not both")
        if self.accumulate and (self.chunk_size is None or self.loss != "clip"):
            raise ValueError("--accumulate needs --chunk-size (the micro-batch) and --loss clip")
        if self.hard_negatives < 0 or (self.hard_negatives and self.loss != "infonce"):
            raise ValueError("--hard-negatives must be >= 0 and needs --loss infonce")
        if self.hard_negatives and self.data == "builtin":
            raise ValueError("--hard-negatives needs --data FILE.jsonl whose lines carry \"negatives\" "
                             "(the built-in pairs have none)")
        # AdamW's first step divides the rate by 1 - beta1 (0.1) into a float32: past that it overflows
        lr_max = torch.finfo(torch.float32).max * 0.09
        if self.lr is not None and not (0 < self.lr <= lr_max):  # NaN fails too
            raise ValueError(f"--lr must be a positive number (at most {lr_max:.3g} for float32 arithmetic), "
                             f"got {self.lr}")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"--warmup must be in [0, 1), got {self.warmup}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if not (self.epochs > 0 and math.isfinite(self.epochs)):
            raise ValueError(f"--epochs must be a finite number > 0, got {self.epochs}")
        for name in ("eval_every", "save_every"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"--weight-decay must be a number >= 0, got {self.weight_decay}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"--heldout-fraction must be in (0, 1), got {self.heldout_fraction}")


# ----------------------------------------------------------------------------- environment


def check_extras(save: bool) -> None:
    """The ``[train]`` extra's modules, checked before any work: checkpoints need safetensors,
    the metrics plot matplotlib."""
    missing = [m for m in (["safetensors"] if save else []) + ["matplotlib"] if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"bigbatch train needs the [train] extra (missing: {', '.join(missing)}): "
                          "pip install 'bigbatch[train]'")


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    group: Any = None

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def setup_distributed(device_arg: str) -> tuple:
    """``(Dist, device)``: the caller's process group if one is initialised, else joins the
    torchrun group when ``WORLD_SIZE`` > 1, else a single process. ``"auto"`` is the local GPU
    (CPU without CUDA, or under a caller's gloo group): ``LOCAL_RANK``'s GPU under torchrun, else
    the GPU a caller that initialised the group made current."""
    world = int(os.environ.get("WORLD_SIZE", "1"))

    def local_gpu() -> torch.device:
        if "LOCAL_RANK" in os.environ:
            return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        if dist.is_initialized():  # a caller's group without torchrun (mp.spawn): the GPU it made current
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cuda", 0)

    if device_arg == "auto":
        # a caller's gloo group moves only CPU tensors through the ring: auto follows the group
        gloo_group = dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() == "gloo"
        device = local_gpu() if torch.cuda.is_available() and not gloo_group else torch.device("cpu")
    else:
        try:
            device = torch.device(device_arg)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {device_arg!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {device_arg}: CUDA is not available")
        if device.type == "cuda" and device.index is None:
            device = local_gpu()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if world <= 1:
            return Dist(), device
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() == 1:
        return Dist(), device
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(), group=dist.group.WORLD), device


def check_backend(cfg: "TrainConfig", device: torch.device) -> None:
    """--backend names a loss backend that runs on ``device`` (ValueError otherwise), before any output."""
    from bigbatch.backends import resolve_backend
    from bigbatch.sigmoid_loss import resolve_sigmoid_backend

    resolve = resolve_sigmoid_backend if cfg.loss == "siglip" else resolve_backend
    try:
        resolve(cfg.backend, device, torch.float32)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--backend {cfg.backend}: {exc}") from None


def memory_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated since the last reset, or the process's resident set (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):  # not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------- data


def load_splits(cfg: TrainConfig) -> Splits:
    if cfg.data == "builtin":
        if cfg.eval_data is not None:
            raise ValueError("--eval-data needs --data (the built-in set has its own held-out split)")
        return builtin_codesearch(seed=cfg.seed, heldout_fraction=cfg.heldout_fraction, max_pairs=cfg.max_pairs,
                                  cache_dir=default_cache_dir())
    return jsonl_splits(cfg.data, eval_path=cfg.eval_data, heldout_fraction=cfg.heldout_fraction, seed=cfg.seed)


class Tables:
    """Pre-tokenised queries, positives and hard negatives of one split (tokenised once)."""

    def __init__(self, model: DualEncoder, pairs: Sequence[Pair], hard_negatives: int) -> None:
        self.n = len(pairs)
        self.k = hard_negatives
        self.queries = model.tokenize([p.query for p in pairs])
        self.docs = model.tokenize([p.positive for p in pairs])
        self.negs: Optional[Inputs] = None
        if hard_negatives:
            short = [i for i, p in enumerate(pairs) if len(p.negatives) < hard_negatives]
            if short:
                raise DataError(
                    f"--hard-negatives {hard_negatives}: {len(short)} training examples have fewer negatives "
                    f"(first: line {pairs[short[0]].group}); lower --hard-negatives or add \"negatives\""
                )
            self.negs = model.tokenize([n for p in pairs for n in p.negatives[:hard_negatives]])


def concat_inputs(a: Inputs, b: Inputs) -> Inputs:
    """Rows of ``a`` then rows of ``b``, right-padded with zeros to the wider of the two."""
    width = max(a["input_ids"].shape[1], b["input_ids"].shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
    return {k: torch.cat([pad(a[k]), pad(b[k])]) for k in a}


def batch_indices(n: int, batch: int, step: int, seed: int) -> Tensor:
    """Training rows of global step ``step`` (epoch permutation seeded by ``(seed, epoch)``; last partial batch dropped)."""
    per_epoch = n // batch
    epoch, pos = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)[pos * batch : (pos + 1) * batch]


def lr_at(step: int, total: int, base: float, warmup: float) -> float:
    """Linear warm-up over ``w = int(warmup * total)`` steps (``base * (step + 1) / (w + 1)``, all
    below ``base``; a fraction of a step is none), then cosine decay to 0 (stateless
    in ``step``). (It was ``max(1, ...)`` steps ending at ``base``: a one-step warm-up ran at the
    peak rate, so ``--warmup`` under one step did nothing but delay the decay.)"""
    w = int(round(warmup * total, 9))  # 0.29 * 100 is 28.999999999999996 in floating point
    if step < w:
        return base * (step + 1) / (w + 1)
    t = (step - w) / max(1, total - w)
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


# ----------------------------------------------------------------------------- steps


def make_loss_fn(cfg: TrainConfig, model: DualEncoder, d: Dist, local_b: int) -> Callable[[Tensor, Tensor], Tensor]:
    import bigbatch

    if cfg.loss == "clip":
        return lambda q, k: bigbatch.clip_loss(q, k, model.scale(), group=d.group, backend=cfg.backend)
    if cfg.loss == "infonce":
        # Keys of this rank: its b positives then its b*k negatives; with a group, labels index the
        # global key set (ranks' keys in rank order), so this rank's positives start at rank * b * (1 + k).
        def infonce(q: Tensor, k: Tensor) -> Tensor:
            labels = torch.arange(q.shape[0], device=q.device) + d.rank * k.shape[0]
            return bigbatch.infonce_loss(q, k, model.scale(), labels=labels, group=d.group, backend=cfg.backend)

        return infonce
    siglip = getattr(bigbatch, "siglip_loss", None)
    if siglip is None:
        raise NotImplementedError("--loss siglip needs bigbatch.siglip_loss, which this installation does not have")
    return lambda q, k: siglip(q, k, model.scale(), model.logit_bias, group=d.group, backend=cfg.backend)


def make_cached_step(cfg: TrainConfig, model: DualEncoder, loss_fn, scaler) -> Callable[[Inputs, Inputs], Tensor]:
    """A GradCache step: exact full-batch gradient with one chunk's activations in memory."""
    from bigbatch.gradcache import GradCache

    gc = GradCache(
        [model.encoder], chunk_sizes=cfg.chunk_size, loss_fn=loss_fn, memory_budget=cfg.memory_budget,
        scaler=scaler, autocast_dtype=PRECISIONS[cfg.precision],
    )
    return lambda q, k: gc(q, k)


def make_accumulated_step(cfg: TrainConfig, model: DualEncoder, loss_fn, device, d: "Dist",
                          scaler=None) -> Callable[[Inputs, Inputs], Tensor]:
    """Gradient accumulation (the baseline): mean of per-micro-batch losses, negatives only within a
    micro-batch of this process (the returned loss: the mean over ranks). With fp16 each
    micro-batch's loss is scaled by ``scaler`` before its backward, as GradCache scales its loss."""
    dtype = PRECISIONS[cfg.precision]

    def step(q: Inputs, k: Inputs) -> Tensor:
        b = q["input_ids"].shape[0]
        c = cfg.chunk_size
        total = torch.zeros((), device=device)  # on the device: no host sync per micro-batch
        for s in range(0, b, c):
            qc = {kk: v[s : s + c] for kk, v in q.items()}
            kc = {kk: v[s : s + c] for kk, v in k.items()}
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(model(qc), model(kc)) * (qc["input_ids"].shape[0] / b)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total += loss.detach().float()
        if d.world > 1:
            dist.all_reduce(total)
            total /= d.world
        return total.float()

    return step


def all_reduce_grads(params: Sequence[torch.nn.Parameter], d: Dist) -> None:
    """Average ``.grad`` over ranks in one flat buffer (what DDP does, once per step)."""
    if d.world <= 1:
        return
    sparse = {id(p) for p in params if p.grad is not None and p.grad.is_sparse}
    for p in params:
        if id(p) in sparse:
            p.grad = p.grad.to_dense()  # O(table) per step: fine for the sizes this trainer runs
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= d.world
    off = 0
    for g in grads:
        g.copy_(flat[off : off + g.numel()].view_as(g))
        off += g.numel()
    for p in params:
        if id(p) in sparse:  # back to the rows some rank touched, as SparseAdam expects
            p.grad = p.grad.to_sparse(sparse_dim=1)


# ----------------------------------------------------------------------------- the run


class RunError(RuntimeError):
    """A run cannot start (e.g. the output directory holds another run); nothing was written."""


def _prepare_out(cfg: TrainConfig, resume: bool, overwrite: bool) -> Path:
    """Check the output directory WITHOUT writing; return its path."""
    if not str(cfg.out).strip():
        raise RunError("--out must name a directory, got an empty string")
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise RunError(f"--out {out} exists and is not a directory")
    existing = [n for n in OUTPUT_FILES if (out / n).exists()]
    if resume:
        if latest_checkpoint(out) is None:
            raise RunError(f"--resume: no checkpoint in {out} to resume from (run without --resume to start)")
    elif existing and not overwrite:
        how = ("pass --resume to continue it or --overwrite to replace it" if latest_checkpoint(out) is not None
               else "it left no checkpoint to resume from: pass --overwrite to replace it")
        raise RunError(f"{out} holds results of an earlier run ({', '.join(existing)}); {how}")
    return out


def merged_config(cfg: TrainConfig, out: Path, explicit: Sequence[str]) -> TrainConfig:
    """For --resume: the saved config, with only trajectory-neutral fields taken from ``cfg``.

    Raises RunError when an explicitly given option contradicts the saved run.
    """
    try:
        saved = json.loads((out / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunError(f"{out / 'config.json'} cannot be read ({e}): it is damaged; the run cannot be resumed") from None
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    # paths saved relative by an earlier version are read from the working directory, as then
    merged = with_absolute_paths(TrainConfig(**{k: v for k, v in saved.items() if k in known}))
    unused = merged.without_effect()

    def differs(k: str) -> bool:
        if k == "lr":  # None is the model's default rate: the same run when that is what is given
            return cfg.peak_lr() != merged.peak_lr()
        return getattr(cfg, k) != getattr(merged, k)

    def shown(k: str, config: TrainConfig, value: object) -> str:
        if k == "lr" and value is None:  # the model's default rate
            return f"{config.peak_lr()!r}, the model's default"
        return repr(value)

    clashes = [
        f"--{k.replace('_', '-')} {shown(k, cfg, getattr(cfg, k))} (saved: {shown(k, merged, saved.get(k))})"
        for k in explicit
        if k in known and k not in TrainConfig.RESUMABLE_OVERRIDES and k not in unused and differs(k)
    ]
    if clashes:
        raise RunError("--resume continues the saved run exactly; these options differ from it: " + "; ".join(clashes))
    # the invocation's own settings, and what this command gives again (the saved --eval-every,
    # --save-every, --backend otherwise)
    for k in TrainConfig.RESUMABLE_OVERRIDES:
        if k in explicit or k in TrainConfig.INVOCATION:
            setattr(merged, k, getattr(cfg, k))
    return merged


def with_absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``--data``, ``--eval-data`` and a ``--model`` directory made absolute, so that
    the saved run can be resumed (and compared with) from any working directory. A path that does
    not exist is left as typed (its error names it so; a hub-style model name is not a path)."""
    def absolute(path: Optional[str], keywords: Sequence[str]) -> Optional[str]:
        if path is None or path in keywords or not Path(path).expanduser().exists():
            return path
        return str(Path(path).expanduser().resolve())

    return dataclasses.replace(cfg, data=absolute(cfg.data, ("builtin",)), eval_data=absolute(cfg.eval_data, ()),
                               model=absolute(cfg.model, ("bag", "minilm")))


def evaluate(model: DualEncoder, tables: Tables, device: torch.device, precision: str) -> Dict[str, float]:
    """Held-out docstring -> code retrieval over all held-out documents (no graph, eval mode)."""
    was = model.training
    model.eval()
    dtype = PRECISIONS[precision]

    def enc(table: Inputs) -> Callable[[Tensor], Tensor]:
        def f(idx: Tensor) -> Tensor:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                return model({k: v.to(device) for k, v in select(table, idx).items()})

        return f

    try:
        q = encode_all(enc(tables.queries), tables.n)
        k = encode_all(enc(tables.docs), tables.n)
    finally:
        model.train(was)
    return retrieval_metrics(q, k)


def train(
    cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, explicit: Sequence[str] = (),
    stop_after: Optional[int] = None, log: Callable[[str], None] = print,
) -> Dict[str, Any]:
    """Run (or resume) training; returns the results dict also written to ``<out>/results.json``.

    ``stop_after``: stop (after checkpointing) once this many steps are done in total, as if
    interrupted; used to test that ``resume`` continues exactly.
    Nothing is written to ``cfg.out`` until the configuration, the output directory and the
    data have all been checked, so a bad data file leaves earlier results intact.
    """
    t_start = time.perf_counter()
    if not resume:  # (resumed: checked once merged with the saved run's options, below)
        cfg.check()
    cfg = with_absolute_paths(cfg)
    check_extras(cfg.save)
    d, device = setup_distributed(cfg.device)
    check_backend(cfg, device)
    out = _prepare_out(cfg, resume, overwrite)
    if resume:
        cfg = merged_config(cfg, out, explicit)
        cfg.check()
        check_backend(cfg, device)  # the saved run's backend, on this machine
    if cfg.precision == "fp16" and device.type != "cuda":
        raise ValueError("--precision fp16 needs a CUDA device (use bf16 on CPU)")
    if cfg.batch_size % d.world:
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes ({d.world})")
    say = log if d.rank == 0 else (lambda s: None)
    for k, why in cfg.without_effect().items():
        if k in explicit:
            say(f"note: --{k.replace('_', '-')} has no effect here: it {why}")

    resolve_model_path(cfg.model)  # a bad --model fails before any work
    t_data = time.perf_counter()
    splits = load_splits(cfg)  # DataError here leaves `out` untouched
    say(f"data: {splits.source} ({time.perf_counter() - t_data:.1f} s)")
    repeats = repeated_positives(splits.train)
    if repeats:
        say(f"note: {repeats} training pairs repeat the positive text of an earlier pair; two of them in one "
            "batch make each other's positive an in-batch negative (deduplicate the data to avoid it)")
    data_id = data_fingerprint(splits)
    per_epoch = len(splits.train) // cfg.batch_size
    if per_epoch < 1:
        raise ValueError(f"--batch-size {cfg.batch_size} is larger than the training set ({len(splits.train)} pairs)")
    total = cfg.steps if cfg.steps is not None else max(1, math.ceil(cfg.epochs * per_epoch))
    eval_every = cfg.eval_every or per_epoch
    save_every = cfg.save_every or per_epoch

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.loss, max_length=cfg.max_length, buckets=cfg.buckets, dim=cfg.dim)
    train_t = Tables(model, splits.train, cfg.hard_negatives)
    held_t = Tables(model, splits.heldout, 0)
    model.to(device)
    model.train()  # (Hugging Face's from_pretrained returns a model in eval mode)
    opt = Optimizers(model, cfg.peak_lr(), cfg.weight_decay)
    params = opt.params
    scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None

    d.barrier()  # every rank has checked the output directory before rank 0 writes to it
    # ---- from here on the output directory is written
    log_file = MetricsLog(out / "metrics.jsonl")
    start = 0
    if resume:
        ckpt = latest_checkpoint(out)
        state, rng = load_checkpoint(ckpt, model, rank=d.rank, device=device)
        if state.get("world_size", 1) != d.world:
            raise RunError(f"checkpoint {ckpt} was written by {state.get('world_size')} processes, this run has {d.world}")
        if state.get("data", data_id) != data_id:  # (checkpoints before session 13 carry no fingerprint)
            raise RunError(
                f"the data differ from the saved run's ({len(splits.train)} training and {len(splits.heldout)} "
                "held-out pairs now; their fingerprint changed): --resume continues the saved run exactly, "
                "with its batches and schedule; start a new run (another --out, or --overwrite)")
        opt.load_state_dict(state["optimizer"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        start = int(state["step"])
        set_rng_state(rng, device)
        if d.rank == 0:
            log_file.truncate_after(start)
        say(f"resumed from {ckpt} at step {start}/{total}")
    elif d.rank == 0:
        if overwrite:
            _remove_outputs(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n", encoding="utf-8")
    d.barrier()

    local_b = cfg.batch_size // d.world
    # the accumulation baseline's micro-batch is this process's --chunk-size rows (negatives from
    # them alone, whatever the process count; gradients and the logged loss averaged over ranks)
    loss_fn = make_loss_fn(cfg, model, Dist() if cfg.accumulate else d, local_b)
    step_fn = (make_accumulated_step(cfg, model, loss_fn, device, d, scaler) if cfg.accumulate
               else make_cached_step(cfg, model, loss_fn, scaler))
    how = (f"gradient accumulation over micro-batches of {cfg.chunk_size}" if cfg.accumulate else
           f"GradCache chunks of {cfg.chunk_size}" if cfg.chunk_size else f"GradCache, memory budget {cfg.memory_budget}")
    say(f"model: {cfg.model} ({sum(p.numel() for p in params) / 1e6:.1f}M parameters) on {device}"
        f"{f' x {d.world} processes' if d.world > 1 else ''}; loss {cfg.loss}; batch {cfg.batch_size} with {how}; "
        f"{total} steps ({per_epoch} per epoch); {cfg.precision}")

    def run_eval(step: int) -> Dict[str, float]:
        m = evaluate(model, held_t, device, cfg.precision)
        if d.rank == 0:
            log_file.append({"step": step, "epoch": step / per_epoch, "eval": m})
        return m

    history = [r for r in log_file.read() if "eval" in r] if d.rank == 0 else []
    before = next((r["eval"] for r in history if r["step"] == 0), None)
    last = history[-1]["eval"] if history else None
    if start == 0 and resume:
        # resumed at step 0 (interrupted in the first step): its evaluation is logged already;
        # no rank evaluates again (the random state restored from the checkpoint is the one after it)
        if d.rank == 0 and before is None:
            before = last = run_eval(0)
    elif start == 0:
        try:
            before = last = run_eval(0)
        except BaseException:  # Ctrl-C included: a fresh run stopped here leaves nothing behind
            if d.rank == 0:
                _remove_outputs(out)
            raise
        say(f"untrained (step 0): {format_metrics(before)}")
    elif d.rank == 0 and (start % eval_every == 0 or start == total) and not any(r["step"] == start for r in history):
        # interrupted between a step and its evaluation: log the evaluation the uninterrupted run did
        last = run_eval(start)

    bar = None
    if cfg.progress and d.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
    step = start
    step_rng = rng_state(device)
    t_run = time.perf_counter()
    stop = AgreedStop(d.world, device).install()
    try:
        while step < total and (stop_after is None or step < stop_after):
            if stop.requested():  # several processes: all stop at this boundary (interrupt.py)
                raise KeyboardInterrupt
            step_rng = rng_state(device)  # what a checkpoint taken at this step boundary restores
            t0 = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            lr = lr_at(step, total, cfg.peak_lr(), cfg.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            idx = batch_indices(len(splits.train), cfg.batch_size, step, cfg.seed)
            idx = idx[d.rank * local_b : (d.rank + 1) * local_b]
            q, k = select(train_t.queries, idx), select(train_t.docs, idx)
            if train_t.negs is not None:
                nidx = (idx[:, None] * train_t.k + torch.arange(train_t.k)).reshape(-1)
                k = concat_inputs(k, select(train_t.negs, nidx))
            q = {kk: v.to(device, non_blocking=True) for kk, v in q.items()}
            k = {kk: v.to(device, non_blocking=True) for kk, v in k.items()}
            opt.zero_grad(set_to_none=True)
            loss = step_fn(q, k)
            all_reduce_grads(params, d)
            with sigint_deferred():  # the update is applied, counted and logged whole, or not at all
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                step += 1
                step_rng = rng_state(device)  # evaluation and saving draw no random numbers
                dt = time.perf_counter() - t0
                rec = {"step": step, "epoch": step / per_epoch, "loss": float(loss), "lr": lr,
                       "scale": float(model.scale().detach()), "examples_per_s": cfg.batch_size / dt,
                       "memory_mb": memory_mb(device), "step_s": dt}
                if d.rank == 0:
                    log_file.append(rec)
            if not math.isfinite(rec["loss"]):
                raise FloatingPointError(f"loss became {rec['loss']} at step {step}; lower --lr (or --weight-decay), or "
                                         f"train in fp32")
            if step % eval_every == 0 or step == total:
                last = run_eval(step)
            if bar is not None:
                post = {"loss": f"{rec['loss']:.3f}", "ex/s": f"{rec['examples_per_s']:.0f}",
                        "mem": f"{rec['memory_mb']:.0f}MB"}
                if last is not None:
                    post["R@1"] = f"{100 * last['recall@1']:.1f}%"
                bar.set_postfix(post)
                bar.update(1)
            if step % save_every == 0 or step == total or step == stop_after:
                if cfg.save:
                    _save(out, step, model, opt, scaler, cfg, d, step_rng, data_id)
                if d.rank == 0:
                    _plot(out)
    except Exception:
        # a fresh run that failed in its first step (e.g. a memory budget too small for one row)
        # leaves no half-written output behind, so running again needs no --overwrite
        if not resume and step == 0 and d.rank == 0:
            _remove_outputs(out)
        raise
    except KeyboardInterrupt:
        stop.remove()  # a Ctrl-C during the save below ends it, as with one process
        if bar is not None:
            bar.close()
        if cfg.save:
            say(f"\ninterrupted: saving step {step} (resume with --resume --out {out})")
            _save(out, step, model, opt, scaler, cfg, d, step_rng, data_id)
        raise
    finally:
        stop.remove()
    if bar is not None:
        bar.close()

    results = {"steps": step, "total_steps": total, "finished": step >= total, "train_pairs": len(splits.train),
               "heldout_pairs": len(splits.heldout), "data": splits.source, "before": before,
               "after": last if step >= total else None, "seconds": time.perf_counter() - t_run,
               # the whole command after start-up: data extraction, evaluations, training, saving
               "wall_seconds": time.perf_counter() - t_start,
               "device": str(device), "world_size": d.world, "config": cfg.to_json()}
    if d.rank == 0:
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, out / "results.json")
        if step >= total and before is not None and last is not None:
            what = "docstring -> code" if cfg.data == "builtin" else "query -> positive"
            say(f"held-out {what} retrieval:\n" + summary_table(before, last))
        say(f"outputs in {out}: metrics.jsonl, metrics.png, results.json{', checkpoints/' if cfg.save else ''}")
    return results


def _remove_outputs(out: Path) -> None:
    """Delete what a run writes in ``out`` (``OUTPUT_FILES``), nothing else."""
    for name in OUTPUT_FILES:
        p = out / name
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)


def _save(out, step, model, opt, scaler, cfg, d: Dist, rng, data_id: str) -> None:
    state = {"optimizer": opt.state_dict(), "step": step, "config": json.dumps(cfg.to_json()), "data": data_id}
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    save_checkpoint(out, step, model, state, rng, rank=d.rank, world_size=d.world,
                    barrier=d.barrier if d.world > 1 else None)


def _plot(out: Path) -> None:
    from .plot import plot_metrics

    plot_metrics(out / "metrics.jsonl", out / "metrics.png")


class Optimizers:
    """AdamW for dense parameters plus SparseAdam for sparse-gradient tables (the bag model's).

    Both follow the same stateless learning-rate schedule; ``state_dict`` holds both.
    """

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float) -> None:
        sparse = [m.weight for m in model.modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
        ids = {id(p) for p in sparse}
        dense = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
        self.params = dense + sparse
        self.opts = [torch.optim.AdamW(dense, lr=lr, weight_decay=weight_decay)]
        if sparse:
            self.opts.append(torch.optim.SparseAdam(sparse, lr=lr))

    @property
    def param_groups(self) -> List[dict]:
        return [g for o in self.opts for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def state_dict(self) -> Dict[str, Any]:
        return {str(i): o.state_dict() for i, o in enumerate(self.opts)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if len(state) != len(self.opts):
            raise RunError("the checkpoint's optimizer state does not match this model")
        for i, o in enumerate(self.opts):
            o.load_state_dict(state[str(i)])
