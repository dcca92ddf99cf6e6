"""Shared builders for tests: tiny random models and one-layer sessions filled with random entries."""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from kvcompress.methods import Needs, get_method
from kvcompress.session import Session
from kvcompress.store.slots import SlotPool


_GATES: dict[tuple, str] = {}


def tiny_gates(model) -> str:
    """A folder of untrained retention gates fitting ``model``'s layers, KV heads and width (c = 2, so that β
    differ between tokens), made once per shape."""
    import tempfile

    from kvcompress.methods.retention import RetentionGates

    config = model.config
    dims = (config.num_hidden_layers, config.num_key_value_heads, config.hidden_size)
    if dims not in _GATES:
        _GATES[dims] = tempfile.mkdtemp(prefix="kvcompress-gates-")
        RetentionGates(*dims, width=8, c_init=2.0, seed=1).save(_GATES[dims], model="tiny")
    return _GATES[dims]


_CODECS: dict[tuple, str] = {}


def tiny_codec(model, full_layers: tuple[int, ...] = ()) -> str:
    """A folder of an untrained DeltaKV codec fitting ``model`` (hidden width 16, a random decoder so that
    codes matter), made once per shape."""
    import tempfile

    from kvcompress.store.deltakv import DeltaKVWeights

    config = model.config
    dims = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim, full_layers)
    if dims not in _CODECS:
        _CODECS[dims] = tempfile.mkdtemp(prefix="kvcompress-deltakv-")
        weights = DeltaKVWeights(*dims[:3], model.model.rotary_emb.inv_freq, hidden=16, seed=1)
        with torch.no_grad():
            weights.decoder.copy_(torch.randn(weights.decoder.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
        weights.save(_CODECS[dims], model="tiny", full_layers=list(full_layers))
    return _CODECS[dims]


_HEAD_SCORES: dict[tuple, str] = {}


def tiny_head_scores(model) -> str:
    """A file of random head scores fitting ``model``'s layers and KV heads (for ``kvzip_head``), made once per shape."""
    import tempfile

    from kvcompress.methods.kvzip import write_head_scores

    config = model.config
    dims = (config.num_hidden_layers, config.num_key_value_heads)
    if dims not in _HEAD_SCORES:
        scores = torch.rand(dims, generator=torch.Generator().manual_seed(5))
        _HEAD_SCORES[dims] = str(write_head_scores(tempfile.mkdtemp(prefix="kvcompress-heads-"), scores, model="tiny"))
    return _HEAD_SCORES[dims]


def tiny_method(name: str, model, **options):
    """``get_method``, with learned parts that fit ``model`` for a method that learns them (retention, deltakv) or
    calibrates them (kvzip_head's head scores)."""
    if name == "retention" and "checkpoint" not in options:
        options["checkpoint"] = tiny_gates(model)
    if name == "deltakv" and "checkpoint" not in options:
        options["checkpoint"] = tiny_codec(model)
    if name == "kvzip_head" and "scores" not in options:
        options["scores"] = tiny_head_scores(model)
    return get_method(name, **options)


_TOKENIZER_DIR: list[str] = []


def tiny_tokenizer_dir() -> str:
    """A folder holding the tests' word-level tokenizer, made once: tiny models name it as their own, as a
    saved checkpoint would (KVzip writes its replay prompt with the model's tokenizer)."""
    import tempfile

    from conftest import tiny_tokenizer

    if not _TOKENIZER_DIR:
        _TOKENIZER_DIR.append(tempfile.mkdtemp(prefix="kvcompress-tokenizer-"))
        tiny_tokenizer().save_pretrained(_TOKENIZER_DIR[0])
    return _TOKENIZER_DIR[0]


def tiny_model(kind: str = "llama", layers: int = 2, seed: int = 0):
    """A randomly initialised Llama, Mistral, Qwen2 (q/k/v bias) or Qwen3 (q/k-norm) small enough for unit tests,
    with the tests' tokenizer beside it (``config.name_or_path``)."""
    torch.manual_seed(seed)
    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, pad_token_id=0,
    )
    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen2": Qwen2Config, "mistral": MistralConfig}[kind]
    config = config_class(head_dim=16, **common)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None  # random models would stop at random; always decode in full
    model.config._name_or_path = tiny_tokenizer_dir()
    return model


class TestLayer:
    """One layer of a session, driven by hand: a method's compress and decode steps applied as the
    session would, with the layer's state in reach (the seam method tests work through)."""

    __test__ = False  # not a pytest class

    def __init__(self, session: Session, layer_idx: int = 0, num_layers: int = 4):
        self.session, self.idx, self.num_layers = session, layer_idx, num_layers

    # ----- what a method sees ------------------------------------------------------------------
    def view(self):
        return self.session.view(self.idx)

    def context(self, query=None, positions=None, layer_idx=None):
        context = self.session.context(self.idx, query, positions)
        return dataclasses.replace(context, num_layers=self.num_layers,
                                   layer_idx=self.idx if layer_idx is None else layer_idx, notes=self.notes)

    @property
    def _state(self):
        return self.session.layers[self.idx]

    @property
    def state(self):
        return self._state.state

    @property
    def summary(self):
        return self._state.summary

    @property
    def notes(self):
        return self.session.notes

    @property
    def observations(self):
        return self._state.observations

    @property
    def tokens_seen(self):
        return self._state.tokens_seen

    @property
    def scaling(self) -> float:
        return self._state.scaling

    @property
    def counts(self):
        """What the method tallied (merges, drops, fallbacks)."""
        return self.session.counts

    def head_lengths(self) -> torch.Tensor:
        return self.session.lengths(self.idx)

    @property
    def num_entries(self) -> int:
        return int(self.head_lengths().sum())

    def nbytes(self) -> int:
        return self.session.layer_bytes(self.idx)

    # ----- acting ------------------------------------------------------------------------------
    def apply(self, edit) -> None:
        if edit is not None:
            self.session.apply(self.idx, edit)

    def compress(self, method, sizes=None, layer_idx=None) -> None:
        self.apply(method.compress(self.view(), self.context(layer_idx=layer_idx), sizes))

    def append(self, keys, values, positions) -> None:
        state = self._state
        self.session.table.append(self.session.pool, keys, values, positions, rows=self.session.rows(self.idx))
        state.seen += keys.shape[2]

    def decode_step(self, method, col_sums=None, query=None, positions=None) -> None:
        """After an ``append``: the method's decode step with the given column sums [B, H, L]."""
        self.apply(method.decode_step(self.view(), self.context(query, positions), col_sums))

    def clone(self) -> TestLayer:
        """An independent copy sharing the entries (a fork of this layer)."""
        session = self.session
        twin = Session(session.method, session.pool, num_layers=session.num_layers, num_kv_heads=session.num_kv_heads,
                       modules=session.modules, rotary=session.rotary, observe=session.observe, compress_on_prefill=False)
        twin.table, twin.batch_size = session.table.share(session.pool), session.batch_size
        twin.notes, twin.counts = set(session.notes), session.counts.copy()
        twin.layers = [None if layer is None else dataclasses.replace(layer, state=dict(layer.state)) for layer in session.layers]
        return TestLayer(twin, self.idx, self.num_layers)


def random_layer(batch=1, heads=2, group=2, length=64, dim=8, window=8, seed=0, lengths=None, key_scale=1.0,
                 attention_sums=False):
    """A one-layer session holding random entries at positions 0..length-1, prefilled with random queries
    (the last ``window`` are observed). ``lengths`` (per batch row) left-pads shorter rows: their first
    tokens are padding.

    Returns (layer, context, queries [B, H·G, length, d], positions [B, length], valid [B, length] or None).
    """
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, length, dim, generator=g) * key_scale
    values = torch.randn(batch, heads, length, dim, generator=g)
    queries = torch.randn(batch, heads * group, length, dim, generator=g) * 2
    valid = None
    if lengths is not None:
        valid = torch.arange(length)[None, :] >= (length - torch.tensor(lengths))[:, None]
    layer = layer_from(keys, values, queries, window, valid, attention_sums)
    return layer, layer.context(), queries, _positions(batch, length, valid), valid


def _positions(batch, length, valid):
    if valid is None:
        return torch.arange(length).expand(batch, length).clone()
    return (valid.long().cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded rows


def layer_from(keys, values, queries, window=8, valid=None, attention_sums=False) -> TestLayer:
    """A one-layer session prefilled with these entries [B, H, n, d] and queries [B, Hq, n, d] (``valid``
    [B, n]: left padding), observing the last ``window`` queries."""
    batch, heads, length, dim = keys.shape
    session = Session(get_method("full"), SlotPool(dim), num_layers=1, num_kv_heads=heads,
                      observe=Needs(window=window, attention_sums=attention_sums), compress_on_prefill=False)
    mask = None
    if valid is not None:
        mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    session.prefill(0, queries, keys, values, _positions(batch, length, valid), dim**-0.5, mask=mask, token_valid=valid)
    return TestLayer(session)


def kept_positions(layer) -> list[list[list[int]]]:
    """Per (row, head): the sorted original positions the layer holds."""
    view = layer.view()
    out = []
    for b, row in enumerate(view.lengths.tolist()):
        out.append([sorted(view.positions[b, h, :n].tolist()) for h, n in enumerate(row)])
    return out


def left_padded_batch(lengths: list[int], seed: int = 0, vocab: int = 128):
    """Random rows of the given lengths, left-padded into one batch: (rows, ids [B, n], mask [B, n])."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, vocab, (1, n), generator=gen) for n in lengths]
    width = max(lengths)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, width - row.shape[1] :] = row
        mask[i, width - row.shape[1] :] = 1
    return rows, batch, mask


def layers_of(cache) -> list[TestLayer]:
    """Every layer of a CompressedCache's session, as TestLayers."""
    session = cache.session
    return [TestLayer(session, i, session.num_layers) for i in range(session.num_layers)]


def shipped_folder(method: str, name: str, wanted: dict):
    """The folder shipped for ``method`` and the built-in model ``name``, checked to be the one found by the
    model's name and the one found by its shapes ``wanted``."""
    from types import SimpleNamespace

    from kvcompress.methods.shipped import shipped_checkpoint

    by_name = shipped_checkpoint(method, SimpleNamespace(_name_or_path=f"/somewhere/{name}"), wanted)
    by_shape = shipped_checkpoint(method, SimpleNamespace(_name_or_path="/somewhere/model.gguf"), wanted)
    assert by_name == by_shape and by_name.name == name
    return by_name


def toy_task_file(path, samples: int = 3):
    """A JSONL task file of ``samples`` toy samples (90 random words of the tiny vocabulary, one question) at ``path``."""
    import json

    gen = torch.Generator().manual_seed(0)
    with open(path, "w") as handle:
        for i in range(samples):
            words = " ".join(f"w{int(x)}" for x in torch.randint(2, 60, (90,), generator=gen))
            row = {"id": f"s{i}", "context": words, "question": "w5 w6", "answers": ["w7"], "task": "toy", "metric": "contains"}
            handle.write(json.dumps(row) + "\n")
    return path
