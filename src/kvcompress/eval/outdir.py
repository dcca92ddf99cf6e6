"""Result folders (``--out``): checked before any work, and never left inconsistent.

* ``check_out`` runs before a model is loaded: a file in the way, a folder that cannot be made,
  or a folder that already holds something (unless ``--overwrite`` or ``--resume``) is a one-line
  error, and nothing has been touched.
* ``start`` makes the folder when the work begins and, with ``--overwrite``, removes the verb's
  own old result files (never anything else), so that no stale table sits beside new results.
* ``write_text`` and ``save_figure`` write under a temporary name and rename: a file in the folder
  is either the old one or the complete new one, never half of either.

An eval also marks its results.json ``"partial": true`` from its first moment until it is
complete (``eval/runner.py`` appends predictions.jsonl as it goes, so ``--resume`` can finish it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

OUTPUTS = {
    "eval": ("results.json", "results.md", "predictions.jsonl", "accuracy_vs_kr.png", "accuracy_vs_cr.png",
             "accuracy_vs_kr_by_task.png"),
    "report": ("results.json", "results.md", "accuracy_vs_kr.png", "accuracy_vs_cr.png", "accuracy_vs_kr_by_task.png"),
    "diagnose": ("diagnose.json", "diagnose.md", "error_per_layer.png"),
    "bench": ("bench.json",),
    "train": ("run.json", "state.pt", "model.safetensors", "config.json", "steps"),
}


def check_out(out: Path, *, overwrite: bool = False, resume: bool = False) -> Path:
    """``out`` if results can be written there; a ValueError naming the problem and the fix otherwise.
    Touches nothing."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a directory for the results")
    if out.is_dir():
        held = sorted(p.name for p in out.iterdir())
        if held and not (overwrite or resume):
            shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
            raise ValueError(f"--out {out} already holds {shown}: choose a new folder, or add --overwrite to replace "
                             "the results there" + (" (or --resume to finish an interrupted eval)" if "predictions.jsonl" in held else ""))
        if not os.access(out, os.W_OK):
            raise ValueError(f"--out {out}: the folder is not writable")
        return out
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ValueError(f"--out {out}: cannot make the folder ({parent} is not a writable directory)")
    return out


def start(out: Path, verb: str, *, overwrite: bool = False) -> None:
    """Make ``out``; with ``overwrite``, remove the old result files and folders of ``verb`` (only those)."""
    out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        for name in OUTPUTS[verb]:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)


def _temporary(path: Path | str) -> Path:
    path = Path(path)
    return path.with_name(f".{path.stem}.partial{path.suffix}")  # same suffix: matplotlib picks the format from it


def write_text(path: Path | str, text: str) -> None:
    """Write ``text`` to ``path`` under a temporary name, then rename it into place."""
    tmp = _temporary(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def save_figure(fig, path: Path | str, dpi: int = 120) -> None:
    """Save a matplotlib figure to ``path`` the same way (whole legend included), and close it."""
    import matplotlib.pyplot as plt

    tmp = _temporary(path)
    try:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(fig)
    os.replace(tmp, path)
