"""PNG plot of a run's metrics.jsonl: training loss and held-out retrieval metrics over steps."""

from __future__ import annotations

import json
import os
from pathlib import Path


def plot_metrics(metrics_path: os.PathLike | str, png_path: os.PathLike | str) -> Path:
    """Draw loss (left) and Recall@1 / Recall@10 / MRR (right) against the step; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in Path(metrics_path).read_text(encoding="utf-8").splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval" in r]
    fig, (ax_l, ax_r) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax_l.plot([r["step"] for r in train], [r["loss"] for r in train], color="tab:blue")
    ax_l.set_xlabel("step")
    ax_l.set_ylabel("training loss")
    ax_l.set_title("contrastive loss")
    ax_l.grid(alpha=0.3)
    for key, label in (("recall@1", "Recall@1"), ("recall@10", "Recall@10"), ("mrr", "MRR")):
        ax_r.plot([r["step"] for r in evals], [r["eval"][key] for r in evals], marker="o", ms=3, label=label)
    ax_r.set_xlabel("step")
    top = max([r["eval"][k] for r in evals for k in ("recall@1", "recall@10", "mrr")], default=1.0)
    ax_r.set_ylim(0, min(1.0, 1.35 * top + 0.02))
    ax_r.set_title("held-out retrieval")
    ax_r.grid(alpha=0.3)
    ax_r.legend(loc="upper left", ncol=3, fontsize=8)
    fig.tight_layout()
    png = Path(png_path)
    tmp = png.with_name(png.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png)
    return png
