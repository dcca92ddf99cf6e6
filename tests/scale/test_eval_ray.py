"""``eval --ray``: the sweep sharded by sample over Ray actors gives what one process gives, resumes across
shards, survives a worker that dies, and writes the same files from the command line."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from common import toy_task_file
from conftest import tiny_config, tiny_tokenizer
from kvcompress.cli import main as cli_main
from kvcompress.eval.ray import Workers
from kvcompress.eval.ray import run_eval as run_sharded
from kvcompress.eval.runner import EvalSettings, key_of, run_eval

ray = pytest.importorskip("ray")
for _module in (__name__, "conftest"):  # CrashOnce and the tiny model's builders travel to the workers by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[_module])



def _timing(key: str) -> bool:
    """Seconds and milliseconds, the only fields allowed to differ between runs."""
    return key.endswith("_s") or "_ms_" in key


def _model():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def tiny():
    return _model(), tiny_tokenizer()


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    return toy_task_file(tmp_path_factory.mktemp("tasks") / "tasks.jsonl", samples=5)


def _settings(task_file):
    return EvalSettings(methods=["snapkv", "streamingllm", "kvzip"], budgets=[8, 24], tasks=[], task_files=[str(task_file)],
                        max_new_tokens=6)


def _untimed(predictions):
    return [(p.id, p.method, p.budget, p.answer, p.score, p.kr, {k: v for k, v in p.stats.items() if not _timing(k)})
            for p in predictions]


@pytest.fixture(scope="module")
def alone(tiny, task_file):
    return run_eval(*tiny, _settings(task_file), progress=False)


def test_two_workers_equal_one_process(ray_cluster, tiny, task_file, alone):
    rows, predictions, _ = run_sharded(*tiny, _settings(task_file), Workers(count=2), progress=False)
    assert _untimed(predictions) == _untimed(alone[1])
    assert [(r["method"], r["budget"], r["task"], r["score"], r["kr"]) for r in rows] == \
        [(r["method"], r["budget"], r["task"], r["score"], r["kr"]) for r in alone[0]]


def test_resume_runs_only_what_is_missing(ray_cluster, tiny, task_file, alone):
    done = {key_of(p): p for p in alone[1][: len(alone[1]) // 2 + 1]}  # stopped mid-sample
    seen = []
    _, predictions, _ = run_sharded(*tiny, _settings(task_file), Workers(count=2), progress=False, on_prediction=seen.append, done=done)
    assert _untimed(predictions) == _untimed(alone[1])
    assert sorted(map(key_of, seen)) == sorted(key_of(p) for p in alone[1] if key_of(p) not in done)


class CrashOnce:
    """Loads the tiny model; the first worker to run sample s2 dies there (its process exits), once."""

    def __init__(self, flag: str):
        self.flag = flag

    def __call__(self):
        model = _model()
        flag = self.flag

        def die_on_s2(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None and ids.shape[-1] > 50 and int(ids[0, 3]) == self.marker and not os.path.exists(flag):
                Path(flag).touch()
                os._exit(1)

        model.register_forward_pre_hook(die_on_s2, with_kwargs=True)
        return model, tiny_tokenizer()


def test_a_dead_worker_has_its_sample_rerun(ray_cluster, tiny, task_file, alone, tmp_path):
    tokenizer = tiny[1]
    sample_s2 = json.loads(task_file.read_text().splitlines()[2])
    CrashOnce.marker = tokenizer(sample_s2["context"], add_special_tokens=False)["input_ids"][3]
    load = CrashOnce(str(tmp_path / "crashed"))
    _, predictions, _ = run_sharded(*tiny, _settings(task_file), Workers(count=2, load=load), progress=False)
    assert (tmp_path / "crashed").exists(), "no worker died: the test did not test anything"
    assert _untimed(predictions) == _untimed(alone[1])


def test_cli_eval_with_ray_writes_what_eval_writes(ray_cluster, tiny_checkpoint, task_file, tmp_path):
    path = tiny_checkpoint("llama")
    common = ["eval", "--model", str(path), "--methods", "snapkv,h2o", "--budgets", "8", "--task-file", str(task_file),
              "--max-new-tokens", "4", "--quiet"]
    assert cli_main([*common, "--out", str(tmp_path / "one")]) == 0
    assert cli_main([*common, "--out", str(tmp_path / "sharded"), "--ray", "--workers", "2"]) == 0
    one, sharded = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "sharded"))
    assert not sharded["partial"]
    drop = lambda rows: [{k: v for k, v in r.items() if not _timing(k)} for r in rows]  # noqa: E731
    assert drop(sharded["rows"]) == drop(one["rows"])
    lines = lambda d: [{k: v for k, v in json.loads(x).items() if not _timing(k)}  # noqa: E731
                       for x in (tmp_path / d / "predictions.jsonl").read_text().splitlines()]
    assert lines("sharded") == lines("one")


def test_cli_refuses_workers_without_ray(task_file, tmp_path, capsys):
    assert cli_main(["eval", "--methods", "snapkv", "--task-file", str(task_file), "--workers", "2", "--out", str(tmp_path / "x")]) == 2
    assert "add --ray" in capsys.readouterr().err
