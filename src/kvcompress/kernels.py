"""The compiled CPU kernels (``csrc/``): one C++/OpenMP extension module, built with the system's C++ compiler through
``torch.utils.cpp_extension`` on first use and cached (``make setup`` builds it; ``python -c "from kvcompress.kernels
import build; build()"`` builds it by hand). Each C++ file's header comment gives its contract, and each has a plain
PyTorch path beside its caller, the reference it is tested against and what runs where the module cannot be built:

* ``paged_decode.cpp``: the decoding read over slot tables (``read/paged.py``);
* ``summary_merge.cpp``: a summary of what left (MomentKV's moments) merged into a decoding read (``read/sdpa.py``);
* ``select_tables.cpp``: a decoding read's selection laid over the rows' slot tables (``read/tables.py``);
* ``top_pages.cpp``: Quest's page bounds and best pages as entry columns (``read/pages.py``);
* ``omnikv_tokens.cpp``: OmniKV's chosen tokens and a layer's columns holding them (``methods/omnikv.py``);
* ``merge_pairs.cpp``: the merging methods' decoding pairs, the entry that leaves and its carrier (``methods/merging.py``);
* ``compact_tables.cpp``: a slot table's rows keeping what a mask marks, in place (``store/slots.py``);
* ``append_step.cpp``: a decoding step's new entries recorded in its requests' slot tables (``store/slots.py``);
* ``deltakv_rebuild.cpp``: DeltaKV's coded tokens rebuilt (``store/deltakv.py``), and read in place by a decoding read
  (``read/paged.py``);
* ``decoder_ops.cpp``: the engine decoder's norms, RoPE and SiLU, one pass each (``engine/decoder.py``);
* ``linear_rows.cpp``: a float32 or bfloat16 linear product over a decoding step's few rows (``engine/packed.py``);
* ``replay_chunk.cpp``: KVzip's replay chunk over held entries in bfloat16 (``read/sdpa.py``);
* ``decode_layer.cpp``: a decoding step's whole decoder layer in one call, of the functions above (``engine/decoder.py``);
* ``greedy_rows.cpp``: each row's greedy token and whether it holds a NaN, from a step's logits (``engine/sampling.py``);
* ``prompt_attention.cpp``: a prompt's (or a prompt chunk's) causal attention in float32 sums (``read/sdpa.py``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("module.cpp", "paged_decode.cpp", "summary_merge.cpp", "select_tables.cpp",
                                                              "top_pages.cpp", "omnikv_tokens.cpp", "merge_pairs.cpp", "compact_tables.cpp",
                                                              "deltakv_rebuild.cpp", "decoder_ops.cpp", "linear_rows.cpp", "replay_chunk.cpp",
                                                              "decode_layer.cpp", "append_step.cpp", "greedy_rows.cpp", "prompt_attention.cpp")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
NOTHING = torch.empty(0)  # the kernels' "none" for a tensor argument
_built: object | None = None
_failed: str | None = None


def cpu_kernels():
    """The compiled module (built and cached on first use), or None when it cannot be built."""
    global _built, _failed
    if _built is None and _failed is None:
        try:
            from torch.utils.cpp_extension import load

            _ninja_on_path()
            _built = load(name="kvcompress_kernels", sources=[str(source) for source in SOURCES], extra_cflags=FLAGS,
                          extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as error:  # no compiler, no headers: the plain PyTorch paths still run correctly
            _failed = f"{type(error).__name__}: {error}"
            log.warning("the CPU kernels could not be built (%s); their plain PyTorch paths run instead", _failed)
    return _built


def _ninja_on_path() -> None:
    """Put the ``ninja`` package's binary (a dependency) on PATH, where torch's extension builder looks for it."""
    try:
        import ninja
    except ImportError:  # a system ninja may still be there
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def build() -> None:
    """Build (and cache) the CPU kernels now rather than at their first use (``make setup`` calls it)."""
    print("CPU kernels:", "built" if cpu_kernels() is not None else f"not built ({_failed})")
