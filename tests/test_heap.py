"""A forward's short-lived buffers kept on the heap once freed (``heap.py``): after ``keep_freed_buffers`` a round of
tensors of a few MB, allocated together and freed, reuses the same pages instead of faulting in new ones; the engine sets
it on the CPU."""

import platform
import subprocess
import sys

import pytest

from common import tiny_model
from conftest import tiny_tokenizer
import kvcompress as kvc
from kvcompress import heap
from kvcompress.engine import runner

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
PAGES_A_ROUND = 3 * (12 << 20) // 4096  # three 12 MiB tensors alive at once

ROUNDS = """
import resource, sys, torch
from kvcompress.heap import keep_freed_buffers
if sys.argv[1] == "keep":
    assert keep_freed_buffers() and keep_freed_buffers()  # set once, then already set
def round_():
    held = [torch.ones(3 << 20) for _ in range(3)]
    del held
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_over_ten_rounds(mode: str) -> int:
    """Minor page faults of ten rounds after a first, in a fresh process (glibc's thresholds are the process's)."""
    run = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True, timeout=120)
    return int(run.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_kept_buffers_fault_in_fewer_pages_than_one_round_takes():
    kept = faults_over_ten_rounds("keep")
    assert kept < PAGES_A_ROUND, f"{kept} page faults over ten rounds, with the buffers kept"


def test_elsewhere_nothing_is_set(monkeypatch):
    monkeypatch.setattr(heap, "_kept", False)
    monkeypatch.setattr(heap.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert heap.keep_freed_buffers() is False


def test_the_engine_keeps_them_on_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "keep_freed_buffers", lambda: calls.append(True))
    kvc.LLM(model_and_tokenizer=(tiny_model(), tiny_tokenizer()), kv_memory="4MiB")
    assert calls == [True]
