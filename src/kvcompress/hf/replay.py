"""KVzip's replay: the prompt read again, teacher-forced, right after its prefill, to score each held entry.

After the prefill, the decoder runs over r = [a "repeat the previous context" prompt, the chat
template's turn to answer, the prompt's tokens], in chunks of ``Needs.replay`` tokens (each later
chunk after a prompt quoting the end of the chunk before it, as KVzip does for long contexts). Each
chunk's queries attend to every held entry and, causally, to the chunk; in each layer the session
keeps per entry the most attention any replay query of a KV head's group gives it
(``Session.replay_layer``); nothing the replay computes is stored (METHODS.md, "KVzip").
``CompressedCache`` runs it through transformers' decoder once a prefill whose method needs it is over; the
engine runs it through its own decoder (``engine/runner.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models import cache_kwargs
from ..session import Session
from .layers import HandOverCache, PositionsLayer

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
QUOTED = 8  # tokens of the chunk before that a later chunk's prompt quotes


@dataclass(frozen=True)
class ReplayPrompts:
    """Token ids of the replay's prompts: before the first chunk, before each later chunk, and the chat
    template's turn to answer (what closes the user's turn and opens the assistant's)."""

    first: list[int]
    later: list[int]
    turn: list[int]

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ReplayPrompts:
        turn_text = "\n"
        if getattr(tokenizer, "chat_template", None):
            marker = "\u2063kvcompress-replay\u2063"
            text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                                 add_generation_prompt=True)
            turn_text = text.split(marker, 1)[1]

        def ids(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False).input_ids)

        return cls(ids(FIRST_PROMPT), ids(NEXT_PROMPT), ids(turn_text))

    def inputs(self, prompt_ids: list[int], chunk: int) -> list[list[int]]:
        """The replay's inputs for a prompt of ``prompt_ids``: one per chunk of ``chunk`` tokens."""
        pieces = [prompt_ids[start : start + chunk] for start in range(0, len(prompt_ids), chunk)]
        inputs = []
        for i, piece in enumerate(pieces):
            lead = self.first if i == 0 else self.later + pieces[i - 1][-QUOTED:]
            inputs.append(lead + self.turn + piece)
        return inputs


class _ReplayCache(HandOverCache):
    """One replay chunk through the decoder: each layer's attention goes to ``Session.replay_layer``."""

    def __init__(self, session: Session, modules):
        self.session, self.attention_modules = session, modules
        super().__init__(layers=[PositionsLayer(lambda seen=layer.seen: seen) for layer in session.layers])

    def attend(self, layer_idx, module, query, key, value, mask, scaling, position_ids, hidden=None) -> torch.Tensor:
        return self.session.replay_layer(layer_idx, query, key, value, position_ids.expand(query.shape[0], -1))


ChunkForward = Callable[[torch.Tensor, torch.Tensor], None]  # (ids [B, c], positions [B, c]) → nothing; attends via replay_layer


def replay_through(decoder, session: Session, modules) -> ChunkForward:
    """transformers' decoder stack as a replay's chunk forward: each layer's attention goes to ``Session.replay_layer``."""
    return lambda ids, positions: decoder(input_ids=ids, position_ids=positions, **cache_kwargs(_ReplayCache(session, modules)))


@torch.inference_mode()
def run_replay(forward: ChunkForward, session: Session, prompts: ReplayPrompts, prompt_ids: torch.Tensor) -> None:
    """Run the replay of ``prompt_ids`` [B, n] (the ids just prefilled; rows of equal, unpadded length) chunk by
    chunk through ``forward`` (a decoder whose layers attend by ``Session.replay_layer``: ``replay_through``, or the
    engine's own) and let the session compress."""
    if prompt_ids is None:
        raise ValueError("this method replays the prompt's token ids after the prefill (KVzip): call the model with "
                         "input_ids, not inputs_embeds")
    if session.layers[0].tokens_seen.min() < prompt_ids.shape[1]:
        raise ValueError("this method replays one unpadded prompt per row (KVzip): prefill padded prompts one "
                         "cache at a time")
    start, seen = time.perf_counter(), session.layers[0].seen
    rows = [prompts.inputs(row, session.observe.replay) for row in prompt_ids.tolist()]
    for chunk in range(len(rows[0])):
        ids = torch.tensor([inputs[chunk] for inputs in rows], device=prompt_ids.device)
        forward(ids, torch.arange(seen, seen + ids.shape[1], device=ids.device).expand_as(ids))
    session.timings["replay_s"] = time.perf_counter() - start
    session.timings["compress_s"] += session.timings["replay_s"]  # the replay is part of what compressing costs
    session.finish_replay()


__all__ = ["FIRST_PROMPT", "NEXT_PROMPT", "ChunkForward", "ReplayPrompts", "replay_through", "run_replay"]
