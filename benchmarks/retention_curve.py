"""Held-out score against training steps: an eval of the gate snapshots a training run saved.

    kvcompress eval --methods "full,$(ls -d runs/train_retention/smollm2/steps/* | sed 's|.*|retention:checkpoint="&"|' | paste -sd, -)" \
        --ratios 0.25,0.5 --samples 4 --context-tokens 1024 --out runs/eval_retention_curve
    .venv/bin/python benchmarks/retention_curve.py runs/eval_retention_curve --out docs/figures/retention_curve.png

Reads the eval's results.json (rows named ``retention[checkpoint=.../steps/NNNNNN]``) and draws the
average score per ratio against the snapshot's step, with full's score as a line.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from kvcompress.eval.report import plt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the eval folder of the snapshots")
    parser.add_argument("--out", type=Path, default=Path("runs/retention_curve.png"))
    args = parser.parse_args()
    rows = [r for r in json.loads((args.run / "results.json").read_text())["rows"] if r["task"] == "all"]
    full = next(r["score"] for r in rows if r["method"] == "full")
    curves: dict[float, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        step = re.search(r"steps/(\d+)", r["method"])
        if step:
            curves[r["ratio"]].append((int(step.group(1)), r["score"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for ratio, points in sorted(curves.items()):
        steps, scores = zip(*sorted(points))
        ax.plot(steps, scores, marker="o", label=f"retention, ratio {ratio:g}")
        print(f"ratio {ratio:g}: " + ", ".join(f"step {s}: {v:.1f}" for s, v in zip(steps, scores)))
    ax.axhline(full, color="black", linestyle="--", label=f"full ({full:.1f})")
    ax.set_xlabel("training step (one 256–512-token sequence each)")
    ax.set_ylabel("score (0–100), mean over tasks")
    ax.set_title("held-out score against training steps", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
