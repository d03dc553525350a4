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


def curves(
    series: dict[str, Sequence[float]],
    path: str | os.PathLike,
    *,
    xs: Sequence[float] | None = None,
    xlabel: str = "",
    ylabel: str = "",
    logx: bool = False,
    title: str = "",
) -> None:
    """One line per labelled series over shared x values (default 1, 2, ...)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for label, ys in series.items():
        ax.plot(xs if xs is not None else range(1, len(ys) + 1), ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def busbw_vs_size(rows: Sequence[dict], path: str | os.PathLike, title: str = "") -> None:
    """nccl-tests' picture: bus bandwidth against buffer size, one line per allreduce algorithm.

    Args:
      rows: `jdp bench allreduce` results (algorithm, size_bytes, busbw_gbps).
      path: the image file to write.
      title: shown above the plot.
    """
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
        mine = [r for r in rows if r["algorithm"] == algorithm]
        ax.plot([r["size_bytes"] for r in mine], [r["busbw_gbps"] for r in mine], marker="o", label=algorithm)
    ax.set_xscale("log", base=2)
    if all(r["busbw_gbps"] > 0 for r in rows):  # on 1 device busbw is 0: nothing crosses a link
        ax.set_yscale("log")
    ax.set_xlabel("bytes per device")
    ax.set_ylabel("busbw (GB/s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
