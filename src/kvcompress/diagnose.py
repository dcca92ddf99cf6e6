"""``kvcompress diagnose``: how faithfully a compressed cache reproduces the full one, on plain text.

Prefill ``context_tokens`` of text, compress, then teacher-force the next
``continuation_tokens`` tokens. Reported per method × budget (METHODS.md, "Metrics"):

* ``rel_error_per_layer``: ‖o − o_full‖ / ‖o_full‖ of each layer's attention output over the
  continuation, with every layer fed the full model's own queries and continuation entries,
  so that a layer's error is its compression's alone (errors do not compound). A method
  that selects what each step reads (Quest, OmniKV) is decoded one token at a time, as it
  runs, against the full cache decoded the same way;
* ``rel_error``: its mean over layers;
* ``kl``: mean KL(p_full ‖ p_method) of the next-token distributions, end to end;
* ``ppl_ratio``: perplexity of the continuation with the method ÷ with the full cache;
* ``rel_error_at_merge``: the error, right after compression, of the query the method
  compressed for (KeepKV fills it; None for methods without one, 0 for full).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .hf import CompressedCache
from .demo import haystack_text
from .methods import Policy
from .models import cache_kwargs


def text_ids(tokenizer, text: str | None, count: int) -> list[int]:
    """The first ``count`` tokens of ``text`` (default: the built-in prose), with a clear error if too short."""
    ids = tokenizer(text if text is not None else haystack_text(), add_special_tokens=False).input_ids
    if len(ids) < count:
        raise ValueError(f"the text has {len(ids)} tokens but {count} are needed (context + continuation); give a longer --text")
    return ids[:count]


@torch.inference_mode()
def diagnose(model, tokenizer, methods: list[Policy], *, text: str | None = None,
             context_tokens: int = 1536, continuation_tokens: int = 64, progress: bool = True) -> list[dict]:
    """Fidelity rows (DESIGN.md ``diagnose.json``) for ``full`` and each method."""
    if context_tokens < 1 or continuation_tokens < 2:
        raise ValueError("context_tokens must be ≥ 1 and continuation_tokens ≥ 2")
    ids = torch.tensor([text_ids(tokenizer, text, context_tokens + continuation_tokens)], device=model.device)
    context, continuation = ids[:, :context_tokens], ids[:, context_tokens:]
    shared = CompressedCache.shared(model, methods, tokenizer)
    model(context, **cache_kwargs(shared), logits_to_keep=1)

    full = shared.fork(shared.method)
    full.recorder = {}
    chunk_logits = model(continuation, **cache_kwargs(full)).logits[0, :-1].float()
    steps = [full.recorder[idx][:4] for idx in range(len(full.layers))]  # each layer's queries, keys, values, positions
    targets = continuation[0, 1:]
    references = {False: ([full.recorder[idx][4] for idx in range(len(full.layers))], chunk_logits,
                          F.cross_entropy(chunk_logits, targets))}

    rows = []
    for method in tqdm([shared.method, *methods], desc="diagnose", disable=not progress):
        stepwise = method.selects  # a chunk reads everything: a method that selects is decoded token by token
        if stepwise not in references:  # the full cache decoded the same way, so that nothing lost reads as 0
            outputs, logits = continuation_fidelity(model, shared.fork(shared.method), continuation, steps, stepwise)
            references[stepwise] = (outputs, logits, F.cross_entropy(logits, targets))
        compressed = shared.fork(method)
        stats = compressed.stats()
        outputs, logits = continuation_fidelity(model, compressed, continuation, steps, stepwise)
        if stepwise:  # the share of entries its decoding steps read
            stats["cr"] = compressed.stats()["cr"]
        full_outputs, full_logits, full_nll = references[stepwise]
        errors = [float((out.float() - ref.float()).norm() / ref.float().norm()) for out, ref in zip(outputs, full_outputs)]
        kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(full_logits, -1), log_target=True, reduction="batchmean")
        nll = F.cross_entropy(logits, targets)
        rows.append({
            "method": method.variant, "budget": method.budget, "ratio": method.ratio, "label": method.label,
            "kr": stats["kr"], "cr": stats["cr"],
            "rel_error_per_layer": errors, "rel_error": sum(errors) / len(errors),
            "kl": float(kl), "ppl_ratio": float(torch.exp(nll - full_nll)),
            "rel_error_at_merge": 0.0 if method.name == "full" else compressed.merge_error,
            **({"merge_counts": stats["merge_counts"]} if "merge_counts" in stats else {}),
        })
    return rows


def continuation_fidelity(model, compressed: CompressedCache, continuation: torch.Tensor, steps: list[tuple],
                          stepwise: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each layer's attention output for the full run's continuation queries and entries (``steps[layer]``;
    errors do not compound), then the teacher-forced logits [n − 1, vocab] float32 — in one chunk, or one
    token at a time (``stepwise``: how a method that selects what each step reads really decodes)."""
    session = compressed.session
    if stepwise:
        outputs = session.probe_steps(steps)
        logits = torch.stack([model(continuation[:, t:t + 1], **cache_kwargs(compressed)).logits[0, -1]
                              for t in range(continuation.shape[1] - 1)]).float()
    else:
        outputs = [session.probe(idx, *step) for idx, step in enumerate(steps)]
        logits = model(continuation, **cache_kwargs(compressed)).logits[0, :-1].float()
    return outputs, logits


def diagnose_markdown(rows: list[dict], title: str) -> str:
    """A table of the scalar metrics, one line per method × size."""
    lines = [f"# {title}", "", "| method | kr | rel_error | kl | ppl_ratio | rel_error_at_merge |", "|---|---|---|---|---|---|"]
    for r in rows:
        merge = "" if r["rel_error_at_merge"] is None else f"{r['rel_error_at_merge']:.2e}"
        lines.append(f"| {r['label']} | {r['kr']:.3f} | {r['rel_error']:.4f} | {r['kl']:.4f} | {r['ppl_ratio']:.3f} | {merge} |")
    lines += ["", "rel_error: mean over layers of ‖o − o_full‖/‖o_full‖ over the continuation (each layer fed the full "
              "run's queries); kl: mean next-token KL(full ‖ method); ppl_ratio: continuation perplexity ÷ full's."]
    return "\n".join(lines) + "\n"


def plot_layer_errors(rows: list[dict], path, title: str) -> None:
    """Relative attention-output error per layer, one line per method × size (log scale)."""
    from .eval.outdir import save_figure

    save_figure(layer_error_figure(rows, title), path)


def layer_error_figure(rows: list[dict], title: str):
    """One color per method (``method_color``: the same as in every other plot), one line style per size
    (smallest solid), a variant's own marker (``method_style``), legend beside the axes."""
    from .eval.report import method_style, plt

    rows = [r for r in rows if r["method"] != "full"]
    styles = ("-", "--", ":", "-.")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        sizes = sorted({(s["budget"] or 0, s["ratio"] or 0) for s in rows if s["method"] == r["method"]})
        style = styles[sizes.index((r["budget"] or 0, r["ratio"] or 0)) % len(styles)]
        look = method_style(r["method"])
        marker = "." if look["linestyle"] == "-" else look["marker"]
        ax.plot(range(len(r["rel_error_per_layer"])), r["rel_error_per_layer"], marker=marker, color=look["color"],
                linestyle=style, label=r["label"])
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative attention-output error")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2 if len(rows) > 12 else 1, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig
