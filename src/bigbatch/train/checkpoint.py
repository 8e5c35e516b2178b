"""Atomic checkpoints: weights in safetensors, optimiser + RNG + data position in torch files.

Layout under ``<out>/checkpoints/``::

    step-00000012/model.safetensors   every parameter and buffer of the DualEncoder
    step-00000012/state.pt            optimiser state, step, config (rank 0)
    step-00000012/rng-rank{r}.pt      torch / CUDA / Python RNG states of rank r
    latest                            the name of the newest complete checkpoint

A checkpoint is written to a temporary directory and renamed into place (``os.replace``,
atomic on POSIX), then ``latest`` is replaced atomically; a crash at any point leaves the
previous checkpoint usable. The newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

LATEST = "latest"


def rng_state(device: Optional[torch.device] = None) -> Dict[str, Any]:
    """Every RNG a training step may draw from: torch's CPU generator, Python's, and the generator
    of the CUDA ``device`` the run trains on (only that one: a resumed run may have fewer GPUs, or
    train on another index, and continues this device's stream on its own)."""
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device is not None and device.type == "cuda":
        state["cuda_device"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Dict[str, Any], device: Optional[torch.device] = None) -> None:
    """Put back :func:`rng_state`'s generators; the saved CUDA stream goes to ``device`` (the
    device this run trains on, whichever index the saved run used)."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if device is None or device.type != "cuda":
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], device)
    elif state.get("cuda"):  # a checkpoint before session 16: every visible device's state, by index
        saved = state["cuda"]
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_rng_state(saved[index] if index < len(saved) else saved[0], device)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def save_checkpoint(
    out: Path, step: int, model: nn.Module, state: Dict[str, Any], rng: Dict[str, Any], *, rank: int = 0,
    world_size: int = 1, barrier=None, keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` atomically (all ranks call this; rank 0 writes the shared files).

    ``barrier`` (a callable) synchronises ranks in distributed runs so every rank's RNG file is
    in the temporary directory before rank 0 renames it.
    """
    from safetensors.torch import save_model

    root = Path(out) / "checkpoints"
    name = f"step-{step:08d}"
    tmp = root / f".tmp-{name}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if barrier is not None:
        barrier()
    torch.save(rng, tmp / f"rng-rank{rank}.pt")
    if rank == 0:
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(dict(state, world_size=world_size), tmp / "state.pt")
    # each rank its own files on disk before the rename: a power loss must not leave `latest` naming
    # empty files
    for f in [tmp / f"rng-rank{rank}.pt"] + ([tmp / "model.safetensors", tmp / "state.pt"] if rank == 0 else []):
        _fsync(f)
    _fsync(tmp)
    if barrier is not None:
        barrier()
    final = root / name
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_text_atomic(root / LATEST, name)
        done = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if barrier is not None:
        barrier()
    return final


def _fsync(path: Path) -> None:
    """Flush a file or a directory to disk, where the filesystem can: some refuse an fsync of a
    directory (CIFS, WSL's DrvFs, some FUSE mounts: EINVAL / ENOTSUP), which must not stop a run."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # (a platform that cannot open directories)
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EROFS):
            raise
    finally:
        os.close(fd)


def latest_checkpoint(out: Path) -> Optional[Path]:
    """The newest complete checkpoint directory, or None."""
    root = Path(out) / "checkpoints"
    marker = root / LATEST
    if not marker.is_file():
        return None
    path = root / marker.read_text(encoding="utf-8").strip()
    return path if (path / "model.safetensors").is_file() and (path / "state.pt").is_file() else None


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except TypeError:  # pragma: no cover - torch without weights_only
        return torch.load(path, map_location="cpu")


def _damaged(file: Path, exc: BaseException) -> ValueError:
    earlier = sorted(p.name for p in file.parent.parent.glob("step-*") if p.is_dir() and p != file.parent)
    hint = (f"; to resume from the checkpoint before it, remove {file.parent} and write {earlier[-1]!r} into "
            f"{file.parent.parent / LATEST}" if earlier else "")
    return ValueError(f"checkpoint file {file} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): "
                      f"it is damaged or incomplete{hint}")


def load_checkpoint(path: Path, model: nn.Module, *, rank: int = 0, device: Optional[torch.device] = None):
    """Load weights into ``model``; return ``(state, rng)`` (rng of this rank). A file that cannot be
    read is a ValueError naming it (and the earlier checkpoint to fall back on)."""
    from safetensors.torch import load_model

    def read(file: Path, load: Callable[[], Any], unreadable: tuple) -> Any:
        try:
            return load()
        except unreadable as exc:
            raise _damaged(file, exc) from None
        except Exception as exc:  # safetensors' own error type (SafetensorError) is not exported stably
            if type(exc).__name__ != "SafetensorError":
                raise
            raise _damaged(file, exc) from None

    # torch.load's reader: RuntimeError (the zip archive), EOFError, UnpicklingError; not so for the
    # weights, where a RuntimeError is a state dict that does not fit the model (raised as it is)
    # (a flipped byte can also surface as KeyError, UnicodeDecodeError or ValueError in the unpickler)
    pickled = (OSError, RuntimeError, EOFError, pickle.UnpicklingError, KeyError, UnicodeDecodeError, ValueError)
    model_file = path / "model.safetensors"
    read(model_file, lambda: load_model(model, str(model_file), device=str(device or "cpu")), (OSError,))
    state = read(path / "state.pt", lambda: _load(path / "state.pt"), pickled)
    rng_file = path / f"rng-rank{rank}.pt"
    if not rng_file.is_file():
        raise ValueError(f"checkpoint {path} has no RNG state for rank {rank} (saved with world size "
                         f"{state.get('world_size')}); resume with the same number of processes")
    return state, read(rng_file, lambda: _load(rng_file), pickled)
