"""Figures, written to files (matplotlib's Agg backend: no display needed)."""

import os
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def accuracy_per_epoch(
    test_acc: Sequence[float], path: str | os.PathLike, title: str = ""
) -> None:
    """The lesson's plot: test accuracy after each epoch."""
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    ax.plot(range(1, len(test_acc) + 1), test_acc, marker="o", label="test acc")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy")
    ax.set_xlim(0.5, max(len(test_acc), 1) + 0.5)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
