"""Figures of runs and benchmarks, returned as matplotlib `Figure`s.

They are built with `matplotlib.figure.Figure`, not pyplot: nothing here touches matplotlib's
global state or backend, so a notebook keeps its own and displays them inline, and a script
saves them with `save(figure, path)` (or `figure.savefig`).
"""

import os
from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure


def _figure(size: tuple[float, float] = (5.5, 3.6)) -> tuple[Figure, Axes]:
    figure = Figure(figsize=size)
    return figure, figure.add_subplot()


def _finish(figure: Figure, ax: Axes, title: str, title_size: int = 9) -> Figure:
    """A grid, a legend if anything is labelled, the title, a tight layout."""
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=title_size)
    figure.tight_layout()
    return figure


def save(figure: Figure, path: str | os.PathLike, dpi: int = 120) -> None:
    """Writes `figure` to `path` (the format follows the suffix, e.g. .png)."""
    figure.savefig(path, dpi=dpi)


def accuracy_per_epoch(test_acc: Sequence[float], title: str = "") -> Figure:
    """The lesson's plot: test accuracy after each epoch."""
    figure, ax = _figure((4.5, 3.2))
    ax.plot(range(1, len(test_acc) + 1), test_acc, marker="o", label="test acc")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy")
    ax.set_xlim(0.5, max(len(test_acc), 1) + 0.5)
    ax.set_ylim(0, 1)
    return _finish(figure, ax, title)


def curves(
    series: dict[str, Sequence[float]],
    *,
    xs: Sequence[float] | None = None,
    xlabel: str = "",
    ylabel: str = "",
    logx: bool = False,
    title: str = "",
) -> Figure:
    """One line per labelled series over shared x values (default 1, 2, ...)."""
    figure, ax = _figure()
    for label, ys in series.items():
        ax.plot(xs if xs is not None else range(1, len(ys) + 1), ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _finish(figure, ax, title)


def busbw_vs_size(rows: Sequence[dict], title: str = "") -> Figure:
    """nccl-tests' picture: bus bandwidth against buffer size, one line per allreduce algorithm.

    Args:
      rows: `jdp bench allreduce` results (algorithm, size_bytes, busbw_gbps).
      title: shown above the plot.
    """
    figure, ax = _figure()
    for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
        mine = [r for r in rows if r["algorithm"] == algorithm]
        ax.plot([r["size_bytes"] for r in mine], [r["busbw_gbps"] for r in mine], marker="o", label=algorithm)
    ax.set_xscale("log", base=2)
    if all(r["busbw_gbps"] > 0 for r in rows):  # on 1 device busbw is 0: nothing crosses a link
        ax.set_yscale("log")
    ax.set_xlabel("bytes per device")
    ax.set_ylabel("busbw (GB/s)")
    return _finish(figure, ax, title, title_size=8)


def runs_per_epoch(test_acc: dict[str, Sequence[float]], train_loss: dict[str, Sequence[float]],
                   title: str = "", bytes_sent: dict[str, Sequence[float]] | None = None) -> Figure:
    """Several runs side by side: test accuracy (left) and train loss (right) per epoch, one line per run;
    with `bytes_sent` (per run, each epoch's bytes sent per device so far), test accuracy against them too."""
    panels = 2 + (bytes_sent is not None)
    figure = Figure(figsize=(5 * panels, 3.8))
    axes = figure.subplots(1, panels)
    left, right = axes[0], axes[-1]
    for ax, series, ylabel in ((left, test_acc, "test accuracy"), (right, train_loss, "train loss")):
        for label, ys in series.items():
            ax.plot(range(1, len(ys) + 1), ys, marker="o", markersize=3, label=label)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    if bytes_sent is not None:
        middle = axes[1]
        for color, label in enumerate(test_acc):
            if bytes_sent.get(label) is not None:
                middle.plot([b / 2**20 for b in bytes_sent[label]], test_acc[label], marker="o", markersize=3,
                            color=f"C{color}", label=label)
        middle.set_xscale("log")
        middle.set_xlabel("MB sent per device")
        middle.set_ylabel("test accuracy")
        middle.grid(alpha=0.3, which="both")
    right.set_yscale("log")
    left.legend(fontsize=8)
    if title:
        figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    return figure


def bytes_per_device(rows: Sequence[dict], title: str = "") -> Figure:
    """`jdp bench memory`'s picture: bytes per device vs device count, one panel per model.

    Solid lines: replicated; dashed: `--shard-optimizer`. Per optimizer, the optimizer state alone
    (thin) and params + gradients + optimizer state (thick).

    Args:
      rows: `jdp bench memory` results (model, optimizer, k, mode, opt_state_bytes, total_bytes).
      title: shown above the panels.
    """
    names = list(dict.fromkeys(r["model"] for r in rows))
    figure = Figure(figsize=(5.0 * len(names), 4.0))
    for index, name in enumerate(names, start=1):
        ax = figure.add_subplot(1, len(names), index)
        for color, optimizer in enumerate(dict.fromkeys(r["optimizer"] for r in rows)):
            for mode, style in (("replicated", "-"), ("sharded", "--")):
                mine = [r for r in rows if (r["model"], r["optimizer"], r["mode"]) == (name, optimizer, mode)]
                ks = [r["k"] for r in mine]
                ax.plot(ks, [r["total_bytes"] / 2**20 for r in mine], style, color=f"C{color}", marker="o", lw=2,
                        label=f"{optimizer} {mode}: total")
                ax.plot(ks, [r["opt_state_bytes"] / 2**20 for r in mine], style, color=f"C{color}", marker=".",
                        lw=0.8, label=f"{optimizer} {mode}: opt state")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices k")
        ax.set_ylabel("MiB per device")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3, which="both")
        if index == 1:
            ax.legend(fontsize=6)
    if title:
        figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    return figure


def predicted_scaling(rows: Sequence[dict], title: str = "") -> Figure:
    """`jdp predict`'s picture: step time and scaling efficiency against devices, one line per strategy.

    Args:
      rows: `jdp predict` rows (devices, strategies: {name: step_ms, efficiency}, best).
      title: shown above the plots.
    """
    figure = Figure(figsize=(9.5, 3.8))
    time_ax, efficiency_ax = figure.subplots(1, 2)
    names = list(dict.fromkeys(name for r in rows for name in r["strategies"]))
    for name in names:
        mine = [r for r in rows if name in r["strategies"]]
        xs = [r["devices"] for r in mine]
        line, = time_ax.plot(xs, [r["strategies"][name]["step_ms"] for r in mine], marker=".", label=name)
        efficiency_ax.plot(xs, [r["strategies"][name]["efficiency"] for r in mine], marker=".", color=line.get_color())
        best = [r for r in mine if r["best"] == name]  # the fastest strategy at that count: a ring around it
        time_ax.scatter([r["devices"] for r in best], [r["strategies"][name]["step_ms"] for r in best], s=90,
                        facecolors="none", edgecolors=line.get_color())
    for ax, label in ((time_ax, "step time (ms)"), (efficiency_ax, "scaling efficiency (compute / step)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
    time_ax.set_yscale("log")
    efficiency_ax.set_ylim(0, 1.02)
    time_ax.legend(fontsize=7, title="circled: fastest", title_fontsize=7)
    figure.suptitle(title, fontsize=8)
    figure.tight_layout()
    return figure


def fitted_vs_measured(record: dict, title: str = "") -> Figure:
    """The α–β fit's check: predicted against measured allreduce time, one colour per algorithm.

    Dots are the rows the fit saw; crosses the held-out device count's rows, predicted without them.
    The diagonal is a perfect prediction, the dashed lines ±30%.

    Args:
      record: `jdp bench allreduce --fit`'s fit.json (algorithms: {name: residuals}, held_out).
      title: shown above the plot.
    """
    figure, ax = _figure((5.5, 4.2))
    held = (record.get("held_out") or {}).get("per_algorithm", {})
    times = []
    for name, fit in record["algorithms"].items():
        rows = fit["residuals"]
        dots = ax.scatter([r["measured_us"] for r in rows], [r["predicted_us"] for r in rows], s=12, alpha=0.6,
                          label=name)
        errors = held.get(name, {}).get("errors", [])
        ax.scatter([e["measured_us"] for e in errors], [e["predicted_us"] for e in errors], marker="x", s=40,
                   color=dots.get_facecolor()[0])
        times += [r["measured_us"] for r in rows] + [e["measured_us"] for e in errors]
    low, high = min(times) / 1.5, max(times) * 1.5
    ax.plot([low, high], [low, high], color="gray", linewidth=1)
    for factor in (0.7, 1.3):
        ax.plot([low, high], [low * factor, high * factor], color="gray", linewidth=0.8, linestyle="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured time (µs)")
    ax.set_ylabel("predicted time (µs)")
    return _finish(figure, ax, title)
