"""kvcompress: compress the KV cache of long-context LLM inference, and measure it honestly.

    import kvcompress as kvc
    model, tokenizer = kvc.load_model()                 # embedded SmolLM2-135M-Instruct
    method = kvc.get_method("snapkv", budget=128)       # or ratio=0.25; or "kvzip+adaptive+kivi:bits=4"
    out = kvc.generate(model, tokenizer, context=..., question=..., method=method)
    cache = kvc.CompressedCache(model, method)          # model.generate(..., past_key_values=cache)
    llm = kvc.LLM(kv_memory="1GiB")                     # serving: many prompts, one KV pool
    outs = llm.generate(prompts, kvc.SamplingParams(max_tokens=64), method=method)
"""

from .hf import CompressedCache
from .engine import LLM, RequestOutput, SamplingParams
from .generate import GenerateOutput, generate
from .methods import Policy, available_methods, available_parts, get_method
from .models import load_model

__version__ = "0.1.0"

__all__ = ["LLM", "CompressedCache", "GenerateOutput", "Policy", "RequestOutput", "SamplingParams", "available_methods",
           "available_parts", "generate", "get_method", "load_model", "__version__"]
