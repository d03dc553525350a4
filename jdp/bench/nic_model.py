"""The cost model on an emulated cluster's link: β from the NIC rate alone, α from small messages once.

`jdp bench allreduce --fit RUN.json ... --nic-model` reads runs of `jdp bench allreduce` made under
`jdp launch --hosts H --nic RATE` (each records its hosts and rate) and predicts every row from a
network description that was never fitted to them:

- β, seconds per byte across a NIC: 8 / RATE, divided by the payload share of what the shaper
  counts (TCP over IPv4 on Ethernet with a 1500-byte MTU and timestamps: 1448 of 1514 bytes);
- α, seconds per message, per algorithm and topology (H hosts × L devices): measured once, from the
  rows of at most `ALPHA_MAX_BYTES` at one rate (`--alpha-rate`), as the median of (t − b·β) / m;
- traffic within a host (its L devices' memory) costs nothing next to the NIC's.

Every row at the other rates, and the larger rows at the α rate, are held out. The counts m and b
are the strategy's own cost (`jdp.Allreduce.cost`) with L devices per host (hierarchical's inner ring stays in memory,
its outer level has all L devices' chunks cross the one NIC at once).

One property of the transport is part of the description: between two processes, an exchange made of
`ppermute`s with two members (a ring or tree on 2 devices, hierarchical's outer ring on 2 hosts: each
strategy's cost says which of its messages are, `jdp.Cost.exchange`) is a swap, which Gloo's TCP transport
runs one direction after the other when it is large: both directions' bytes. jdp's ring and tree send theirs
in pieces small enough to overlap (`jdp.Cost.swap_piece_bytes`; docs/cluster.md, "Where each falls short, and
why"): each piece a message, the bytes both ways at once. With 3 or more members each device sends on one
connection and receives on another, and the ring is full duplex whole.
"""

import dataclasses
import math
import statistics
from collections.abc import Sequence

from jdp.errors import Arg, ConfigError
from jdp.parallel import allreduce, cost

WIRE_PAYLOAD = 1448 / 1514  # TCP payload per Ethernet frame (MTU 1500, TCP timestamps on): what tbf counts
ALPHA_MAX_BYTES = 64 * 1024  # rows this small measure α: the NIC's β share of them is a few percent
LARGE_BYTES = 2**20  # rows this large are the wire's: their errors are also reported apart


def nic_beta(rate_bps: float) -> float:
    """Seconds per payload byte through a NIC of `rate_bps` (each direction)."""
    return 8 / (rate_bps * WIRE_PAYLOAD)


def _base(name: str) -> str:
    """`hierarchical:2x2` → `hierarchical`: one α for every grouping."""
    return ":".join(part for part in name.split(":") if "x" not in part)


def _cost(name: str) -> cost.Cost | None:
    """The cost of a registered strategy's name, or None if it has none (or is not registered)."""
    try:
        return allreduce.get(name).cost
    except ConfigError:
        return None


def inter_terms(row: dict) -> cost.Terms:
    """m, b of a `jdp bench allreduce` row across the NICs, L = devices / hosts per host; with two hosts,
    an exchange of `ppermute`s counts each of its pieces as a message (see the module's docstring)."""
    priced = _cost(row["algorithm"])
    hosts, k = row["hosts"], row["devices"]
    levels = None if priced is None else priced.terms(k, [row["size_bytes"]], k // hosts)
    if levels is None:
        raise ConfigError(f"`{row['algorithm']}` has no cost for {hosts} hosts: leave it out of the runs.")
    inter = levels["inter"]
    messages, bytes_sent = inter.messages + levels["intra"].messages, inter.bytes_sent
    if priced.exchange is not None and priced.exchange(k, k // hosts) == 2 and inter.messages:  # swaps
        if priced.swap_piece_bytes is None:  # whole: one direction after the other
            bytes_sent *= 2
        else:  # in pieces, each a message, both ways at once
            messages += inter.messages * (math.ceil(bytes_sent / inter.messages / priced.swap_piece_bytes) - 1)
    return dataclasses.replace(inter, messages=messages, bytes_sent=bytes_sent)


def transfer_seconds(row: dict) -> float:
    """The NIC's share of a row's time: b · β, with the NIC shared by the devices sending at once."""
    t = inter_terms(row)
    return t.bytes_sent * nic_beta(row["nic_bps"]) * max(1.0, t.concurrent)


def measure_alpha(rows: Sequence[dict]) -> float:
    """α of one algorithm: median over its small rows of (t − b·β) / m."""
    return statistics.median((r["time_us"] * 1e-6 - transfer_seconds(r)) / max(inter_terms(r).messages, 1.0)
                             for r in rows)


def predict_us(row: dict, alpha: float) -> float:
    """A row's time from the NIC rate and α: m·α + b·β."""
    return (inter_terms(row).messages * alpha + transfer_seconds(row)) * 1e6


def _errors(errors: Sequence[dict], least_bytes: int = 0) -> tuple[float | None, float | None]:
    sizes = [abs(e["relative_error"]) for e in errors if e["size_bytes"] >= least_bytes]
    return (statistics.median(sizes), max(sizes)) if sizes else (None, None)


def check(runs: Sequence[dict], alpha_rate: int) -> dict:
    """α per algorithm and topology from the small rows at `alpha_rate`, then the held-out errors of every other row.

    Returns:
      {"alpha_rate_bps", "wire_payload", "algorithms": {"NAME HxL": {"algorithm", "hosts", "per_host", "alpha_s",
      "alpha_rows", "held_out": [rows with predicted_us and relative_error], "median_relative_error",
      "worst_relative_error", and the same two over rows of at least LARGE_BYTES: "large_median_relative_error",
      "large_worst_relative_error"}}}.

    Raises:
      ConfigError: if a run was not made on an emulated cluster, or no run is at `alpha_rate`.
    """
    rows = []
    for run in runs:
        if "nic_bps" not in run:
            raise ConfigError(Arg("nic_model"), " needs runs made under `jdp launch --hosts H --nic RATE` (their "
                              "allreduce.json records `nic_bps`).")
        rows += [r for r in run["results"] if _cost(r["algorithm"]) is not None]
    if not any(r["nic_bps"] == alpha_rate for r in rows):
        rates = sorted({r["nic_bps"] for r in rows})
        raise ConfigError(Arg("alpha_rate", alpha_rate), f" matches no run; the runs are at {rates} bit/s.")
    by_name: dict[str, list[dict]] = {}
    for r in rows:
        by_name.setdefault(f"{_base(r['algorithm'])} {r['hosts']}x{r['devices'] // r['hosts']}", []).append(r)
    record = {"alpha_rate_bps": alpha_rate, "wire_payload": WIRE_PAYLOAD, "algorithms": {}}
    for name, mine in by_name.items():
        small = [r for r in mine if r["nic_bps"] == alpha_rate and r["size_bytes"] <= ALPHA_MAX_BYTES]
        if not small:
            continue
        alpha = measure_alpha(small)
        held = [r for r in mine if r not in small]
        errors = [{"devices": r["devices"], "hosts": r["hosts"], "nic_bps": r["nic_bps"], "size_bytes": r["size_bytes"],
                   "measured_us": r["time_us"], "predicted_us": predict_us(r, alpha),
                   "relative_error": predict_us(r, alpha) / r["time_us"] - 1} for r in held]
        median, worst = _errors(errors)
        large_median, large_worst = _errors(errors, LARGE_BYTES)
        record["algorithms"][name] = {"algorithm": _base(mine[0]["algorithm"]), "hosts": mine[0]["hosts"],
                                      "per_host": mine[0]["devices"] // mine[0]["hosts"], "alpha_s": alpha,
                                      "alpha_rows": len(small), "held_out": errors, "median_relative_error": median,
                                      "worst_relative_error": worst, "large_median_relative_error": large_median,
                                      "large_worst_relative_error": large_worst}
    return record


def format_check(record: dict) -> str:
    """α per algorithm and topology, its held-out median and worst error: all rows, rows >= 1 MiB, per rate."""
    def cell(median: float | None, worst: float | None) -> str:
        return "-" if median is None else f"{median:.0%} / {worst:.0%}"

    lines = [f"{'algorithm, HxL':<24} {'alpha (us)':>10} {'held out':>8} {'all: median / worst':>20} "
             f"{'>=1MiB: median / worst':>23}  per rate, all sizes"]
    for name, a in record["algorithms"].items():
        per = []
        for rate in sorted({e["nic_bps"] for e in a["held_out"]}):
            per.append(f"{rate / 1e6:g}mbit {cell(*_errors([e for e in a['held_out'] if e['nic_bps'] == rate]))}")
        lines.append(f"{name:<24} {a['alpha_s'] * 1e6:>10.0f} {len(a['held_out']):>8} "
                     f"{cell(a['median_relative_error'], a['worst_relative_error']):>20} "
                     f"{cell(a['large_median_relative_error'], a['large_worst_relative_error']):>23}  " + ", ".join(per))
    return "\n".join(lines)
