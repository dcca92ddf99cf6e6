"""Result files: JSON with the DESIGN.md schema, Markdown tables and plots."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .. import __version__  # noqa: E402


def write_json(path: Path, rows: list[dict], *, model: str, seed: int, settings: dict, **extra) -> None:
    """``{"rows": [...], "model", "seed", "version", "settings", ...}`` (DESIGN.md, "Command line")."""
    payload = {"rows": rows, "model": model, "seed": seed, "version": __version__, "settings": settings, **extra}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w") as handle:
        for record in records:
            handle.write(json.dumps(record, default=str) + "\n")


def size_label(row: dict) -> str:
    if row["budget"] is not None:
        return str(row["budget"])
    return f"{row['ratio']:g}" if row["ratio"] is not None else "—"


def _order(rows: list[dict]) -> list[tuple]:
    """Configurations in a stable order: full first, then by method, then by size."""
    configs = {(r["method"], r["budget"], r["ratio"]) for r in rows}
    return sorted(configs, key=lambda c: (c[0] != "full", c[0], c[1] or 0, c[2] or 0))


def eval_markdown(rows: list[dict], title: str) -> str:
    """One line per method × size: score per task, the macro average, kr and decode cost."""
    tasks = sorted({r["task"] for r in rows} - {"all"})
    index = {(r["method"], r["budget"], r["ratio"], r["task"]): r for r in rows}
    has_all = any(r["task"] == "all" for r in rows)
    head = ["method", "size", *tasks] + (["average"] if has_all else []) + ["kr", "decode ms/tok"]
    lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, budget, ratio in _order(rows):
        per_task = [index.get((method, budget, ratio, t)) for t in tasks]
        summary = index.get((method, budget, ratio, "all")) or per_task[0]
        cells = [method, size_label(summary)]
        cells += [f"{r['score']:.1f}" if r else "" for r in per_task]
        if has_all:
            cells.append(f"{summary['score']:.1f}")
        cells += [f"{summary['kr']:.3f}", f"{summary['decode_ms_per_token']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    n = max(r["n"] for r in rows if r["task"] != "all")
    lines += ["", f"Scores are 0–100 over {n} samples per task; kr = KV bytes held ÷ full cache bytes."]
    return "\n".join(lines) + "\n"


def plot_accuracy_vs_kr(rows: list[dict], path: Path, title: str) -> None:
    """Average score against kr: a line per fixed-budget method, points for adaptive ones, a star for full."""
    task = "all" if any(r["task"] == "all" for r in rows) else rows[0]["task"]
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        if r["task"] == task:
            series[r["method"]].append((r["kr"], r["score"]))
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for method, points in sorted(series.items()):
        points.sort()
        xs, ys = zip(*points)
        if method == "full":
            ax.scatter(xs, ys, marker="*", s=180, color="black", label="full", zorder=3)
        elif len(points) == 1:
            ax.scatter(xs, ys, s=50, label=method, zorder=3)
        else:
            ax.plot(xs, ys, marker="o", label=method)
    ax.set_xlabel("kr (KV bytes held ÷ full)")
    ax.set_ylabel("score (0–100)" + (", mean over tasks" if task == "all" else f", {task}"))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
