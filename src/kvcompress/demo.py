"""The built-in long prompt: a fact hidden in filler prose, and the demo that compares methods on it.

The filler (``data/haystack.txt``) is original prose with no digits, so a numeric answer
can only come from the hidden fact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from importlib import resources

HAYSTACK_FILE = "haystack.txt"


def haystack_text() -> str:
    """The project's filler prose (about 7.5k tokens of SmolLM2)."""
    return resources.files("kvcompress").joinpath("data", HAYSTACK_FILE).read_text(encoding="ascii")


@dataclass
class NeedlePrompt:
    context: str
    question: str
    answer: str


def needle_prompt(tokenizer, context_tokens: int = 1200, depth: float = 0.5, seed: int = 0) -> NeedlePrompt:
    """A context of about ``context_tokens`` filler tokens with one numeric fact at ``depth`` (0 = start)."""
    rng = random.Random(seed)
    code = str(rng.randint(1000, 9999))
    needle = f"The secret code for the blue door is {code}. "
    ids = tokenizer(haystack_text(), add_special_tokens=False).input_ids[:context_tokens]
    filler = tokenizer.decode(ids)
    cut = filler.rfind(". ", 0, max(int(len(filler) * depth), 1))
    cut = 0 if cut < 0 else cut + 2
    context = filler[:cut] + needle + filler[cut:]
    question = "What is the secret code for the blue door? Answer with the number only."
    return NeedlePrompt(context=context, question=question, answer=code)


def demo_table(prompt: NeedlePrompt, rows: list, ratio: float) -> str:
    """The demo's report: what was hidden and asked, then a line per finished run ``(method, query_aware,
    GenerateOutput)`` — kr, whether the answer holds the code, decode cost and the answer."""
    n = rows[0][2].stats["context_tokens"]
    lines = [f"\nBuilt-in prompt: a {n}-token context hides 'The secret code for the blue door is {prompt.answer}.'",
             f"Question: {prompt.question}\nMethods keep ratio={ratio} of the context's KV entries (full keeps all).\n",
             f"| {'method':12} | {'protocol':14} | {'kr':>5} | {'correct':7} | {'decode ms/tok':>13} | answer",
             f"|{'-' * 14}|{'-' * 16}|{'-' * 7}|{'-' * 9}|{'-' * 15}|{'-' * 30}"]
    for name, query_aware, out in rows:
        protocol = "query-aware" if query_aware else "query-agnostic"
        ok = "yes" if prompt.answer in out.text else "no"
        answer = out.text.replace("\n", " ")[:60]
        lines.append(f"| {name:12} | {protocol:14} | {out.stats['kr']:5.3f} | {ok:7} | {out.stats['decode_ms_per_token']:13.1f} | {answer}")
    lines.append("\nkr = KV bytes really held ÷ bytes of the full cache for the same tokens (full carries 4 bytes of "
                 "position per entry). query-agnostic: the context is compressed before the question is seen.")
    return "\n".join(lines)
