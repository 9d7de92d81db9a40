"""One PNG for a sweep: speedup vs batch size, accept-length histogram, per-category table."""
from __future__ import annotations

from typing import List


def require_matplotlib():
    """Fails before a sweep starts rather than after its first run."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    return matplotlib


def plot(result: dict, path: str) -> str:
    """Draws what `result` holds so far: called after every run of a sweep."""
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: List[dict] = result["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [1, 1, 1.3]})
    _speedup(axes[0], rows, result.get("peers") or [])
    _hist(axes[1], rows)
    _categories(axes[2], result.get("categories") or [])
    draft = result.get("draft_label", "")
    partial = " [partial]" if result.get("partial") else ""
    fig.suptitle(f"jaxspec-bench{partial}: {result.get('model_label')} on "
                 f"{result.get('dataset')} ({result.get('device')}, {result.get('dtype')}; "
                 f"draft: {draft}; temperature "
                 f"{result['args'].get('temperature')}, {result['args'].get('max_tokens')} "
                 "new tokens)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _speedup(ax, rows, peers):
    batches = sorted({r["batch"] for r in rows})
    for label in dict.fromkeys(r["mode"] for r in rows):
        pts = [(r["batch"], r["speedup"]) for r in rows if r["mode"] == label]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=label, linestyle="--" if label == "plain" else "-")
    for p in peers:
        if p.get("speedup") is not None:
            ax.scatter([p["batch"]], [p["speedup"]], marker="x", s=60, label=p["mode"])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches])
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s over plain decoding")
    ax.set_title("speedup vs batch size")
    ax.legend(fontsize=8)


def _hist(ax, rows):
    spec = [r for r in rows if r.get("accept_hist")]
    if not spec:
        ax.text(0.5, 0.5, "no speculative runs", ha="center", va="center")
        ax.set_axis_off()
        return
    b0 = min(r["batch"] for r in spec)
    sel = [r for r in spec if r["batch"] == b0]
    width = 0.8 / len(sel)
    for i, r in enumerate(sel):
        h = r["accept_hist"]
        total = max(sum(h), 1)
        xs = [k + 1 + (i - (len(sel) - 1) / 2) * width for k in range(len(h))]
        ax.bar(xs, [c / total for c in h], width=width,
               label=f"{r['mode']} (mean {r['accept_len']:.2f})")
    ax.set_xticks(range(1, max(len(r["accept_hist"]) for r in sel) + 1))
    ax.set_xlabel("tokens per cycle (accepted + bonus)")
    ax.set_ylabel("fraction of cycles")
    ax.set_title(f"accept length, batch {b0}")
    ax.legend(fontsize=8)


def _categories(ax, cats):
    ax.set_axis_off()
    ax.set_title("per category (smallest batch)")
    if not cats:
        ax.text(0.5, 0.5, "no categories", ha="center", va="center")
        return
    modes = [k for k in cats[0] if k not in ("category", "requests")]
    header = ["category", "n"] + [f"{m}\ntok/s" for m in modes] + \
        [f"{m}\naccept / speedup" for m in modes if m != "plain"]
    cells = []
    for c in cats:
        row = [c["category"], str(c["requests"])]
        row += [f"{c[m]['tokens_per_s']:.1f}" for m in modes]
        for m in modes:
            if m == "plain":
                continue
            acc = c[m]["accept_len"]
            row.append(f"{acc:.2f} / {c[m]['speedup']:.2f}x" if acc is not None else "-")
        cells.append(row)
    t = ax.table(cellText=cells, colLabels=header, loc="center", cellLoc="center")
    t.auto_set_font_size(False)
    t.set_fontsize(7)
    t.scale(1, 1.6)
