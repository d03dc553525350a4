"""Figures, written to files (matplotlib's Agg backend: no display needed)."""

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@contextmanager
def _figure(path: str | os.PathLike, title: str, size: tuple[float, float] = (5.5, 3.6),
            title_size: int = 9) -> Iterator[plt.Axes]:
    """One set of axes, written to `path` with a grid, a legend and `title` once the caller has drawn."""
    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        if title:
            ax.set_title(title, fontsize=title_size)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def accuracy_per_epoch(
    test_acc: Sequence[float], path: str | os.PathLike, title: str = ""
) -> None:
    """The lesson's plot: test accuracy after each epoch."""
    with _figure(path, title, size=(4.5, 3.2)) as ax:
        ax.plot(range(1, len(test_acc) + 1), test_acc, marker="o", label="test acc")
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy")
        ax.set_xlim(0.5, max(len(test_acc), 1) + 0.5)
        ax.set_ylim(0, 1)


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
    with _figure(path, title) as ax:
        for label, ys in series.items():
            ax.plot(xs if xs is not None else range(1, len(ys) + 1), ys, marker="o", label=label)
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)


def busbw_vs_size(rows: Sequence[dict], path: str | os.PathLike, title: str = "") -> None:
    """nccl-tests' picture: bus bandwidth against buffer size, one line per allreduce algorithm.

    Args:
      rows: `jdp bench allreduce` results (algorithm, size_bytes, busbw_gbps).
      path: the image file to write.
      title: shown above the plot.
    """
    with _figure(path, title, title_size=8) as ax:
        for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
            mine = [r for r in rows if r["algorithm"] == algorithm]
            ax.plot([r["size_bytes"] for r in mine], [r["busbw_gbps"] for r in mine], marker="o", label=algorithm)
        ax.set_xscale("log", base=2)
        if all(r["busbw_gbps"] > 0 for r in rows):  # on 1 device busbw is 0: nothing crosses a link
            ax.set_yscale("log")
        ax.set_xlabel("bytes per device")
        ax.set_ylabel("busbw (GB/s)")
