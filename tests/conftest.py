"""Shared fixtures: the real embedded model (slow, loaded once) and tiny random checkpoints."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on the CPU (set before Triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from kvcompress.models import load_model

TINY_VOCAB = 64
_TINY_CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct; converts it on first use."""
    return load_model()


def tiny_config(model_type: str = "llama") -> PretrainedConfig:
    """A random-weights config: hidden 64, 2 layers, 4 query heads, 2 KV heads (head_dim 16)."""
    return _TINY_CONFIGS[model_type](
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=None,
        tie_word_embeddings=False,
    )


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over w0..w61, with an eos token and no pad token."""
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(TINY_VOCAB - 2)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Callable[[str], Path]:
    """Factory: save a tiny random model of the given model_type (and a tokenizer) to a dir."""

    def make(model_type: str = "llama") -> Path:
        torch.manual_seed(0)
        directory = tmp_path / model_type
        AutoModelForCausalLM.from_config(tiny_config(model_type)).save_pretrained(directory)
        tiny_tokenizer().save_pretrained(directory)
        return directory

    return make


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster for the scale-out tests (two CPUs, a short temp dir, token auth off, loopback), started
    once; yields the port of its metrics export (Ray's Prometheus endpoint)."""
    import os
    import shutil
    import socket
    import tempfile

    ray = pytest.importorskip("ray", reason="the scale-out tests need the ray extra (make setup installs it)")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # loopback only: no token to hand the clients
    temp = tempfile.mkdtemp(prefix="kvc-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=temp, log_to_driver=False,
             _metrics_export_port=port, _system_config={"metrics_report_interval_ms": 1000})
    yield port
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
