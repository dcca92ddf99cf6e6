"""The leaderboard: every method × ratio × protocol × model on the built-in tasks, as one page and one plot.

``kvcompress leaderboard`` runs one eval per model × protocol into ``OUT/<model>/<protocol>/`` (each
resumable and shardable like any eval) and then ``write`` reads their results.json files and makes
the page (one table per model × protocol, the best score per size in bold, each score with its kr,
cr, compression cost ÷ prefill and decode ms/token ÷ full's) and ``leaderboard.png`` (score against
kr, one panel per model × protocol, each method in its colour of every plot the project draws).
Methods with no size (KIVI, DeltaKV, GVote) run once and are listed at the kr they reach.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .outdir import save_figure, write_text  # noqa: E402
from .report import draw_task, size_label  # noqa: E402

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b")
RATIOS = (0.05, 0.1, 0.25, 0.5)
# Every preset at its defaults, and the best composition measured (KVzip's ranking stored in 4-bit codes).
METHODS = ("streamingllm", "h2o", "snapkv", "pyramidkv", "adakv", "momentkv", "keepkv", "cam", "d2o", "gvote", "quest", "omnikv",
           "kivi", "deltakv", "retention", "expected_attention", "kvzip", "kvzip+kivi:bits=4")
PROTOCOLS = {"question-after": False, "question-compressed": True}  # name → query_aware
PROTOCOL_TITLES = {"question-after": "question after compression (query-agnostic)",
                   "question-compressed": "question compressed with the context (query-aware)"}


def cell_dir(out: Path, model: str, protocol: str) -> Path:
    """Where one model × protocol's eval lives (a model path becomes its folder's name)."""
    return out / Path(model).name / protocol


def load_cells(out: Path, models: list[str]) -> list[dict]:
    """``{"model", "protocol", "rows", "settings", "partial", "wall_s"}`` of every model × protocol eval in ``out``
    that has results."""
    cells = []
    for model in models:
        for protocol in PROTOCOLS:
            file = cell_dir(out, model, protocol) / "results.json"
            if file.is_file():
                payload = json.loads(file.read_text())
                cells.append({"model": Path(model).name, "protocol": protocol, "rows": payload["rows"],
                              "settings": payload["settings"], "partial": payload.get("partial", False),
                              "wall_s": payload.get("wall_s")})
    return cells


def table(rows: list[dict]) -> list[str]:
    """One model × protocol: a line per method × size (sizes in order, then methods with their own size), macro
    average over tasks; the best score of each size in bold."""
    overall = [r for r in rows if r["task"] == "all"] or rows
    full = next((r for r in overall if r["method"] == "full"), None)
    sized = sorted({r["ratio"] for r in overall if r["ratio"] is not None})
    groups = [[r for r in overall if r["ratio"] == ratio] for ratio in sized]
    groups.append([r for r in overall if r["ratio"] is None and r["budget"] is None and r["method"] != "full"])
    lines = ["| size | method | score | kr | cr | compress ÷ prefill | decode ÷ full | n |", "|---|---|---|---|---|---|---|---|"]
    if full is not None:
        lines.append(_line(full, full, bold=False))
    for group in groups:
        best = max((r["score"] for r in group if frees_memory(r)), default=None)
        for row in sorted(group, key=lambda r: (-r["score"], r["method"])):
            lines.append(_line(row, full, bold=frees_memory(row) and row["score"] == best))
    return lines


def frees_memory(row: dict) -> bool:
    """Whether a method holds less than the full cache (kr < 1); a selection method (Quest, OmniKV) keeps every entry
    and reads only its size's share per step, so it is listed at that size but not ranked there."""
    return row["kr"] < 1.0


def _line(row: dict, full: dict | None, bold: bool) -> str:
    size = "own" if row["ratio"] is None and row["budget"] is None and row["method"] != "full" else size_label(row)
    score = f"**{row['score']:.1f}**" if bold else f"{row['score']:.1f}"
    if row["method"] != "full" and not frees_memory(row):
        score += " †"
    compress = row["compress_s"] / row["prefill_s"] if row.get("prefill_s") else float("nan")
    decode = row["decode_ms_per_token"] / full["decode_ms_per_token"] if full and full.get("decode_ms_per_token") else float("nan")
    cr = row.get("cr")
    return (f"| {size} | {row['method']} | {score} | {row['kr']:.3f} | {'' if cr is None else f'{cr:.3f}'} | {compress:.2f} | "
            f"{decode:.2f} | {row['n']} |")


def markdown(cells: list[dict], command: str) -> str:
    """The page: how it was made, then a table per model × protocol."""
    lines = ["# Leaderboard", "",
             "Every method at its defaults on the built-in tasks (needles, variable tracking, aggregation, QA), "
             "scores 0–100 averaged over the tasks; kr = KV bytes held ÷ the full cache's; cr = entries read per "
             "decoding step ÷ full's; compress ÷ prefill = the compression's time over the prefill's; decode ÷ full = "
             "decode ms/token over the full cache's in the same run. Sizes are the share of the context kept; "
             "\"own\" marks methods that size themselves (placed by the kr they reach). The best score of each size "
             "among methods that free memory (kr < 1) is in bold; † marks a method holding the whole cache (kr ≥ 1), listed "
             "but not ranked: the selection methods (Quest, OmniKV) keep every entry and read only the size's share per "
             "decoding step. Decode ÷ full is timed on the "
             "machine as it was (each worker on one thread): other jobs running beside the eval skew it; compare it "
             "within one table only.", "", f"Regenerate: `{command}`", "", "![score against kr](leaderboard.png)", ""]
    for cell in cells:
        settings = cell["settings"]
        head = f"## {cell['model']}, {PROTOCOL_TITLES[cell['protocol']]}"
        lines += [head, "", f"{settings.get('context_tokens')} context tokens, samples per task: {settings.get('samples')}"
                  + (f", wall time {_duration(cell['wall_s'])}" if cell.get("wall_s") else "")
                  + (" — PARTIAL: finish with `--resume`" if cell["partial"] else "") + ".", ""]
        lines += table(cell["rows"]) + [""]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def figure(cells: list[dict]):
    """Score against kr, a panel per model × protocol, one legend for all."""
    models = list(dict.fromkeys(c["model"] for c in cells))
    fig, axes = plt.subplots(len(models), len(PROTOCOLS), figsize=(6.0 * len(PROTOCOLS), 4.2 * len(models)), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for cell in cells:
        ax = axes[models.index(cell["model"])][list(PROTOCOLS).index(cell["protocol"])]
        ax.axis("on")
        draw_task(ax, cell["rows"], "all" if any(r["task"] == "all" for r in cell["rows"]) else cell["rows"][0]["task"])
        ax.set_title(f"{cell['model']}, {cell['protocol'].replace('-', ' ')}", fontsize=10)
    handles: dict = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.tight_layout()
    fig.legend(list(handles.values()), list(handles), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=min(len(handles), 6))
    return fig


def write(out: Path, models: list[str], page: Path, command: str) -> list[dict]:
    """Write ``page`` (markdown) and ``leaderboard.png`` beside it from the evals in ``out``; returns the cells."""
    cells = load_cells(out, models)
    if not cells:
        raise ValueError(f"{out} holds no leaderboard evals yet: run `kvcompress leaderboard --out {out}` first")
    page.parent.mkdir(parents=True, exist_ok=True)
    write_text(page, markdown(cells, command))
    save_figure(figure(cells), page.with_name("leaderboard.png"), dpi=110)
    return cells


__all__ = ["METHODS", "MODELS", "PROTOCOLS", "RATIOS", "cell_dir", "frees_memory", "load_cells", "markdown", "table", "write"]
