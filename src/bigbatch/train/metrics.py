"""Retrieval metrics and the run's metrics log (``<out>/metrics.jsonl``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch
from torch import Tensor


@torch.no_grad()
def retrieval_metrics(queries: Tensor, docs: Tensor, *, block: int = 1024) -> Dict[str, float]:
    """Recall@1, Recall@10 and MRR of query i retrieving document i among all documents.

    ``queries`` (N, D) and ``docs`` (N, D) are features (cosine if normalised). Ties count
    against the query (rank = 1 + number of documents scoring >= the positive, minus itself),
    so a constant encoder scores at chance, never perfectly. Memory O(block * N).
    """
    n = queries.shape[0]
    if docs.shape[0] != n or n == 0:
        raise ValueError(f"need as many documents as queries (> 0), got {n} queries and {docs.shape[0]} documents")
    q, d = queries.float(), docs.float()
    ranks = torch.empty(n, dtype=torch.float64)
    for s in range(0, n, block):
        sim = q[s : s + block] @ d.T
        pos = sim.diagonal(offset=s).unsqueeze(1)
        ranks[s : s + block] = (sim >= pos).sum(1).double()  # includes the positive itself
    return {
        "recall@1": (ranks <= 1).double().mean().item(),
        "recall@10": (ranks <= 10).double().mean().item(),
        "mrr": (1.0 / ranks).mean().item(),
    }


@torch.no_grad()
def encode_all(encode: Callable[[Tensor], Tensor], n: int, *, batch: int = 1024) -> Tensor:
    """Concatenated ``encode(index)`` over ``range(n)`` in batches (no graph)."""
    return torch.cat([encode(torch.arange(s, min(n, s + batch))).float().cpu() for s in range(0, n, batch)])


class MetricsLog:
    """Append-only JSONL of training records; each line is flushed when written.

    ``truncate_after(step)`` drops records of steps beyond a checkpoint when resuming
    (rewritten atomically), so the log of a resumed run equals an uninterrupted one's.
    """

    def __init__(self, path: os.PathLike | str) -> None:
        self.path = Path(path)

    def append(self, record: dict) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def read(self) -> List[dict]:
        """The records. A last line cut short by an interrupted write (no newline at its end) is left
        out; any other line that is not JSON is an error naming the file and the line."""
        if not self.path.exists():
            return []
        with self.path.open("r", encoding="utf-8") as f:
            lines = f.readlines()
        out = []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                if i == len(lines) and not line.endswith("\n"):
                    break  # a torn final write: the steps after the checkpoint are run again anyway
                raise ValueError(f"{self.path} is damaged at line {i} ({exc}); remove that line, or start "
                                 f"over with --overwrite") from None
        return out

    def truncate_after(self, step: int) -> None:
        keep = [r for r in self.read() if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in keep)
        os.replace(tmp, self.path)


def format_metrics(m: Dict[str, float]) -> str:
    return "  ".join(f"{k} {100 * m[k]:5.1f}%" if k != "mrr" else f"MRR {m[k]:.3f}" for k in ("recall@1", "recall@10", "mrr"))


def summary_table(before: Dict[str, float], after: Dict[str, float], keys: Sequence[str] = ("recall@1", "recall@10", "mrr")) -> str:
    rows = ["metric       untrained   trained"]
    for k in keys:
        rows.append(f"{k:<12} {before[k]:9.4f} {after[k]:9.4f}")
    return "\n".join(rows)
