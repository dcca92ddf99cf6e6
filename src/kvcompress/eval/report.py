"""Result files: JSON with the DESIGN.md schema, Markdown tables and plots."""

from __future__ import annotations

import json
import zlib
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .. import __version__  # noqa: E402
from ..methods import available_methods  # noqa: E402
from .outdir import save_figure, write_text  # noqa: E402


def write_json(path: Path, rows: list[dict], *, model: str, seed: int, settings: dict, **extra) -> None:
    """``{"rows": [...], "model", "seed", "version", "settings", ...}`` (DESIGN.md, "Command line")."""
    payload = {"rows": rows, "model": model, "seed": seed, "version": __version__, "settings": settings, **extra}
    write_text(path, json.dumps(payload, indent=2, default=str) + "\n")


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
    head = ["method", "size", *tasks] + (["average"] if has_all else []) + ["kr", "cr", "decode ms/tok"]
    lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, budget, ratio in _order(rows):
        per_task = [index.get((method, budget, ratio, t)) for t in tasks]
        summary = index.get((method, budget, ratio, "all")) or per_task[0]
        cells = [method, size_label(summary)]
        cells += [f"{r['score']:.1f}" if r else "" for r in per_task]
        if has_all:
            cells.append(f"{summary['score']:.1f}")
        cr = summary.get("cr")
        cells += [f"{summary['kr']:.3f}", "" if cr is None else f"{cr:.3f}", f"{summary['decode_ms_per_token']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    n = max(r["n"] for r in rows if r["task"] != "all")
    lines += ["", f"Scores are 0–100 over {n} samples per task; kr = KV bytes held ÷ full cache bytes; cr = entries "
              "read per decoding step ÷ a full cache's (below kr for methods that select what to read)."]
    adaptive = sorted({m for m, b, r in _order(rows) if m != "full" and b is None and r is None})
    if adaptive and tasks:
        lines += ["", "Realized kr per task (methods that choose their own budget):", "",
                  "| method | " + " | ".join(tasks) + " |", "|" + "---|" * (len(tasks) + 1)]
        for method in adaptive:
            cells = [f"{index[(method, None, None, t)]['kr']:.3f}" if (method, None, None, t) in index else "" for t in tasks]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_accuracy_vs_kr(rows: list[dict], path: Path, title: str, axis: str = "kr") -> None:
    """Average score against kr (bytes held; ``axis="cr"``: entries read per decoding step, the twin
    plot where dynamic selection shows): a line per fixed-budget method, points for adaptive ones, a
    star for full. The legend sits beside the axes, never over the data."""
    save_figure(accuracy_figure(rows, title, axis), path)


def accuracy_figure(rows: list[dict], title: str, axis: str = "kr"):
    task = "all" if any(r["task"] == "all" for r in rows) else rows[0]["task"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    draw_task(ax, rows, task, axis)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def plot_accuracy_vs_kr_by_task(rows: list[dict], path: Path, title: str) -> None:
    """One panel per task: there an adaptive method's point sits at the kr it chose for that task."""
    save_figure(accuracy_by_task_figure(rows, title), path, dpi=110)


def accuracy_by_task_figure(rows: list[dict], title: str):
    """The panels, and one legend for all of them: in the grid's spare cell when there is one (5 tasks
    in 2 × 3), else below the grid — never over a panel."""
    tasks = sorted({r["task"] for r in rows} - {"all"})
    cols = min(3, len(tasks))
    grid_rows = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(grid_rows, cols, figsize=(4.2 * cols, 3.4 * grid_rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        draw_task(ax, rows, task)
        ax.set_title(task, fontsize=10)
    spare = list(axes.flat)[len(tasks):]
    for ax in spare:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if spare:
        spare[0].legend(handles, labels, fontsize=8, loc="center", ncol=2 if len(labels) > 8 else 1)
    else:
        fig.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(labels), 5))
    return fig


# One color per registered method, in the registry's order (full: black), the same in every plot the
# project draws: tab10, then five of tab20b's (quest's gold stays clear of snapkv's green, which it often
# selects over). Names not in the registry (or past the palette) take one of tab20's light shades by a
# stable hash of the name.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
           "#393b79", "#e7ba52", "#7b4173", "#637939", "#843c39")
EXTRA = ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5")
VARIANT_LINES = ("--", "-.", ":")
VARIANT_MARKERS = ("s", "^", "v", "P", "X", "h")


def method_color(name: str) -> str:
    """The color of a method (a result row's ``method``) in every plot: fixed by its place in the registry;
    a variant (``keepkv[key_rule=votes]``) takes its base method's color and ``method_style`` tells it apart."""
    base = name.split("[", 1)[0]
    if base == "full":
        return "#000000"
    names = [m for m in available_methods() if m != "full"]
    if base in names and names.index(base) < len(PALETTE):
        return PALETTE[names.index(base)]
    return EXTRA[zlib.crc32(base.encode()) % len(EXTRA)]


def method_style(name: str) -> dict:
    """``color``, ``linestyle`` and ``marker`` of a method's line: a base method is solid with round
    markers; each variant of it has its base's color with a dashed line and a marker of its own (stable:
    chosen by a hash of its options)."""
    base, _, options = name.partition("[")
    if not options:
        return {"color": method_color(name), "linestyle": "-", "marker": "o"}
    code = zlib.crc32(options.encode())
    return {"color": method_color(base), "linestyle": VARIANT_LINES[code % len(VARIANT_LINES)],
            "marker": VARIANT_MARKERS[code // len(VARIANT_LINES) % len(VARIANT_MARKERS)]}


def draw_task(ax, rows: list[dict], task: str, axis: str = "kr") -> None:
    """One panel: a task's (or ``"all"``'s) score against ``axis``, a line or point per method in its own style."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        if r["task"] == task:
            series[r["method"]].append((r.get(axis, r["kr"]), r["score"]))
    for method, points in sorted(series.items()):  # a method has the same color in every plot (method_style)
        points.sort()
        xs, ys = zip(*points)
        style = method_style(method)
        if method == "full":
            ax.scatter(xs, ys, marker="*", s=180, color="black", label="full", zorder=3)
        elif len(points) == 1:  # adaptive methods: one point at the kr they chose (a variant: its own marker)
            marker = "D" if style["linestyle"] == "-" else style["marker"]
            ax.scatter(xs, ys, marker=marker, s=60, color=style["color"], edgecolors="black", label=method, zorder=4)
        else:
            ax.plot(xs, ys, label=method, **style)
    ax.set_xlabel("kr (KV bytes held ÷ full)" if axis == "kr" else "cr (entries read per decoding step ÷ full)")
    ax.set_ylabel("score (0–100)" + (", mean over tasks" if task == "all" else f", {task}"))
    ax.grid(alpha=0.3)


COMPARABLE = ("context_tokens", "samples", "limit", "seed", "query_aware", "max_new_tokens", "tasks", "task_files", "haystack_id")


def merge_results(paths: list[Path]) -> tuple[list[dict], dict, list, str | None]:
    """Rows of several ``results.json`` files of comparable eval runs (one model; same context length,
    samples, seed, protocol, tasks and haystack), later files winning on the same method × size × task;
    their settings; the prompt lengths each run recorded (``run_prompt_tokens``, for ``context_label``); and
    the model they were run on."""
    merged: dict[tuple, dict] = {}
    settings: dict | None = None
    lengths: list = []
    models: set[str] = set()
    for path in paths:
        file = path / "results.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"{file} does not exist: give eval output directories or results.json files")
        payload = json.loads(file.read_text())
        if payload.get("partial"):
            raise ValueError(f"{file} holds an unfinished eval ({payload.get('runs_done', 0)} of {payload.get('runs_total', '?')} "
                             f"runs): finish it with `kvcompress eval ... --resume --out {file.parent}` (the same flags), "
                             "or leave it out")
        theirs = payload.get("settings", {})
        if settings is None:
            settings = theirs
        differing = [k for k in COMPARABLE if theirs.get(k) != settings.get(k)]
        if differing:
            raise ValueError(f"{file} is not comparable with {paths[0]}: its {', '.join(differing)} differ; "
                             "merge runs with the same context length, samples, seed, protocol, tasks and haystack")
        for row in payload["rows"]:
            merged[(row["method"], row["budget"], row["ratio"], row["task"])] = row
        lengths += run_prompt_tokens(file, payload)
        models |= {payload["model"]} if payload.get("model") else set()
    if len(models) > 1:
        raise ValueError(f"the runs are of different models ({', '.join(sorted(models))}): report each model's runs apart")
    return list(merged.values()), settings or {}, lengths, next(iter(models), None)


def run_prompt_tokens(file: Path, payload: dict) -> list:
    """The prompt lengths a ``results.json`` records, as a list of ``[low, high]`` ranges (one per eval run: a
    merged report keeps its runs' in ``prompt_tokens_by_run``); from the ``predictions.jsonl`` beside it when
    the file has none; ``[None]`` when neither says."""
    if payload.get("prompt_tokens_by_run"):
        return payload["prompt_tokens_by_run"]
    if payload.get("prompt_tokens"):
        return [payload["prompt_tokens"]]
    predictions = file.parent / "predictions.jsonl"
    found = [json.loads(line).get("prompt_tokens") for line in predictions.read_text().splitlines()] if predictions.is_file() else []
    found = [n for n in found if n]
    return [[min(found), max(found)]] if found else [None]


def context_label(settings: dict, prompt_tokens: list | None) -> str:
    """What a title says of the context length: the settings' context tokens when only built-in tasks ran
    (they are generated at that length); with task files, whose contexts have their own lengths, the prompt
    lengths really run, from ``prompt_tokens``: one ``[low, high]`` range per run (None: not recorded). A
    merge of runs whose lengths differ says so."""
    if not settings.get("task_files"):
        return f"{settings.get('context_tokens')} context tokens"
    known = [r for r in prompt_tokens or [] if r]
    if not known:
        return "prompt lengths unknown"
    low, high = prompt_span(known)
    label = f"prompts of {low}–{high} tokens" if low != high else f"prompts of {low} tokens"
    if len({tuple(r) for r in known}) > 1:
        label += " (the merged runs' prompt lengths differ)"
    if len(known) < len(prompt_tokens):
        label += f" (recorded by {len(known)} of {len(prompt_tokens)} merged runs)"
    return label


def prompt_span(prompt_tokens: list) -> list[int] | None:
    """``[shortest, longest]`` over runs' ``[low, high]`` prompt-length ranges (None where none is known)."""
    known = [r for r in prompt_tokens if r]
    return [min(r[0] for r in known), max(r[1] for r in known)] if known else None
