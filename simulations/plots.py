"""PNG plots of a simulation (matplotlib, headless): TTFT CDF, prefix reuse and per-worker load per policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOT_FILES = ("ttft_cdf.png", "reuse.png", "worker_load.png")


def write_plots(directory: str | Path, outcomes: dict[str, Any], title: str) -> list[Path]:
    """Write the three plots into ``directory`` (created if needed); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    metadata = {"Software": None}  # no version string in the file: same inputs, same bytes

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, outcome in outcomes.items():
        ttft = outcome.ttft_ms
        if ttft:
            ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
            ax.step(ttft, ys, where="post", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"TTFT CDF\n{title}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    written.append(_save(fig, out / PLOT_FILES[0], metadata))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(outcomes)
    realised = [outcomes[p].summary["prefix_reuse"] for p in names]
    bars = ax.bar(names, realised, color="tab:blue", label="realised (cached at admission)")
    predicted = [outcomes[p].summary.get("overlap", {}).get("predicted_reuse") for p in names]
    if any(v is not None for v in predicted):
        xs = [i for i, v in enumerate(predicted) if v is not None]
        ax.scatter(xs, [predicted[i] for i in xs], color="tab:orange", zorder=3, label="router-predicted")
    for bar, value in zip(bars, realised, strict=True):
        ax.annotate(f"{value:.3f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
    ax.set_ylabel("prompt tokens served from cache / all prompt tokens")
    ax.set_ylim(0, max([*realised, *(v for v in predicted if v is not None), 0.1]) * 1.2)
    ax.set_title(f"Prefix reuse per policy\n{title}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    written.append(_save(fig, out / PLOT_FILES[1], metadata))
    plt.close(fig)

    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.6 * len(names)), sharex=True, squeeze=False)
    for ax, policy in zip(axes[:, 0], names, strict=True):
        for label, series in outcomes[policy].load_series.items():
            if series:
                xs = [t for t, _ in series]
                ys = [v for _, v in series]
                ax.step(xs, ys, where="post", linewidth=0.8, label=label)
        ax.set_ylabel("requests")
        ax.set_title(f"{policy}: requests on each worker (running + queued, max per second)", fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("virtual time (s)")
    if len(outcomes[names[0]].load_series) <= 16:
        axes[0, 0].legend(fontsize=6, ncol=8, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    written.append(_save(fig, out / PLOT_FILES[2], metadata))
    plt.close(fig)
    return written


def _save(fig: Any, path: Path, metadata: dict[str, Any]) -> Path:
    fig.savefig(path, dpi=110, metadata=metadata)
    return path
