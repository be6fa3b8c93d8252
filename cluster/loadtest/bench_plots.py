"""PNG plots for `pdcluster bench --save-result` (matplotlib, no display needed)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _slo_line(ax, result: dict, metric: str) -> None:
    slo = (result.get("goodput_slos_ms") or {}).get(metric)
    if slo:
        ax.axvline(slo, color="tab:red", linestyle="--", label=f"{metric.upper()} SLO {slo:g} ms")
        ax.legend()


def plot_distributions(result: dict, path: Path) -> Path:
    """TTFT and ITL histograms (ms) of one run, SLOs marked."""
    ttft = np.asarray([t for t, e in zip(result["ttfts"], result["errors"]) if not e]) * 1000
    itl = np.asarray([x for xs in result["itls"] for x in xs]) * 1000
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, xs, name, metric in ((axes[0], ttft, "TTFT", "ttft"), (axes[1], itl, "ITL", "tpot")):
        if xs.size:
            ax.hist(xs, bins=min(60, max(10, xs.size // 5)), color="tab:blue", alpha=0.8)
            for q, style in ((50, ":"), (99, "-.")):
                ax.axvline(np.percentile(xs, q), color="black", linestyle=style, label=f"p{q} {np.percentile(xs, q):.1f} ms")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("count")
        ax.set_title(f"{name} distribution ({xs.size} samples)")
        _slo_line(ax, result, metric)
        ax.legend()
    rate = result.get("request_rate")
    rate = f"{rate:.3g}" if isinstance(rate, float) else rate
    trace = f" ({Path(result['trace']).name} trace)" if result.get("trace") else ""
    fig.suptitle(f"{result.get('model_id', '')} at {rate} req/s{trace}: "
                 f"{result['completed']} ok, {result['failed']} failed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(result: dict, path: Path) -> Path:
    """SLO attainment and throughput against request rate, the goodput rate marked."""
    pts = result["sweep"]
    rate = [float(p["request_rate"]) for p in pts]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(rate, [100 * p["slo_attainment"] for p in pts], "o-", label="SLO attainment")
    a1.axhline(100 * result["slo_attainment_target"], color="tab:red", linestyle="--",
               label=f"target {result['slo_attainment_target']:.0%}")
    if result.get("max_goodput_rate") is not None:
        a1.axvline(result["max_goodput_rate"], color="tab:green", linestyle=":",
                   label=f"goodput {'>= ' if result.get('goodput_is_lower_bound') else ''}"
                         f"{result['max_goodput_rate']:.3g} req/s")
    a1.set_xlabel("request rate (req/s)")
    a1.set_ylabel("requests meeting all SLOs (%)")
    a1.set_ylim(0, 105)
    a1.legend()
    a2.plot(rate, [p["request_throughput"] for p in pts], "o-", label="completed req/s")
    a2.plot(rate, [p["request_goodput"] for p in pts], "s--", label="good req/s")
    a2.set_xlabel("request rate (req/s)")
    a2.set_ylabel("requests/s")
    ax3 = a2.twinx()
    ax3.plot(rate, [p["output_throughput"] for p in pts], "^:", color="tab:gray", label="output tok/s")
    ax3.set_ylabel("output tokens/s")
    a2.legend(loc="upper left")
    ax3.legend(loc="lower right")
    fig.suptitle(f"goodput sweep: {result.get('model_id', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_phases(result: dict, path: Path) -> Path:
    """Stacked bars: at each TTFT percentile, where the time to first token went (the server's
    traces: `pdcluster bench`'s ttft_phases)."""
    from router.tracing import TTFT_PHASES
    rows = result["ttft_phases"]["by_percentile"]
    cols = list(rows)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = np.zeros(len(cols))
    for k in TTFT_PHASES:
        ms = np.asarray([rows[c][k] for c in cols])
        ax.bar(cols, ms, bottom=bottom, label=k)
        bottom += ms
    ax.set_ylabel("ms")
    ax.set_xlabel("requests at this TTFT percentile (the server's TTFT)")
    ax.set_title(f"TTFT by phase ({result['ttft_phases']['requests']} traced requests)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
