"""Result folders: a taken --out is refused before any work, --overwrite replaces only the verb's own files,
an interrupted eval leaves a folder marked partial that `report` refuses, and --resume finishes it with the
results of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvcompress.cli import main as cli_main

TIMINGS = ("prefill_s", "compress_s", "decode_ms_per_token")


@pytest.fixture
def setup(tiny_checkpoint, tmp_path):
    """A tiny checkpoint and a task file of 24 samples (5 runs each: full, snapkv and h2o at budgets 8 and 24)."""
    gen = torch.Generator().manual_seed(0)
    tasks = tmp_path / "tasks.jsonl"
    with tasks.open("w") as handle:
        for i in range(24):
            words = [f"w{int(x)}" for x in torch.randint(2, 60, (90,), generator=gen)]
            row = {"id": f"s{i}", "context": " ".join(words), "question": "w5 w6", "answers": [words[40]], "task": "toy",
                   "metric": "contains"}
            handle.write(json.dumps(row) + "\n")
    return str(tiny_checkpoint()), str(tasks)


def _argv(setup, out, *extra):
    model, tasks = setup
    return ["eval", "--model", model, "--task-file", tasks, "--methods", "snapkv,h2o", "--budgets", "8,24",
            "--max-new-tokens", "4", "--out", str(out), "--quiet", *extra]


def _results(out) -> tuple[list, list]:
    """(predictions, rows) without the timings, which no two runs share."""
    predictions = [{k: v for k, v in json.loads(line).items() if k not in TIMINGS}
                   for line in (out / "predictions.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if k not in TIMINGS} for r in json.loads((out / "results.json").read_text())["rows"]]
    return predictions, rows


@pytest.mark.parametrize("verb", [["eval", "--tasks", "vt", "--samples", "1"], ["diagnose"], ["bench"]])
def test_a_taken_out_is_refused_before_any_work(verb, tmp_path, capsys, monkeypatch):
    import kvcompress.cli as cli

    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("the model was loaded before --out was checked"))
    out = tmp_path / "runs"
    out.mkdir()
    (out / "results.json").write_text("old results")
    (out / "notes.txt").write_text("mine")
    assert cli_main([*verb, "--methods", "snapkv", "--ratios", "0.5", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "already holds notes.txt, results.json" in error and "--overwrite" in error
    assert (out / "results.json").read_text() == "old results" and (out / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_only_the_verbs_own_files(setup, tmp_path):
    out = tmp_path / "runs"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "accuracy_vs_kr_by_task.png").write_text("a stale plot of another run")
    assert cli_main(_argv(setup, out, "--overwrite", "--limit", "2")) == 0
    assert (out / "notes.txt").read_text() == "mine"  # not ours: kept
    assert not (out / "accuracy_vs_kr_by_task.png").exists()  # ours, and this single-task run makes none: gone
    payload = json.loads((out / "results.json").read_text())
    assert payload["partial"] is False and payload["runs_done"] == payload["runs_total"] == 2 * 5
    assert not list(out.glob(".*partial*"))  # no temporary file left behind
    assert cli_main(_argv(setup, out, "--overwrite", "--resume")) == 2


def test_interrupted_eval_is_marked_partial_and_resume_completes_it_identically(setup, tmp_path, capsys, monkeypatch):
    import kvcompress.eval.runner as runner

    assert cli_main(_argv(setup, tmp_path / "whole")) == 0
    whole = _results(tmp_path / "whole")
    out = tmp_path / "cut"
    made = runner._prediction

    def stop_at_the_eighth(*args):
        stop_at_the_eighth.calls += 1
        if stop_at_the_eighth.calls == 8:
            raise KeyboardInterrupt
        return made(*args)

    stop_at_the_eighth.calls = 0
    monkeypatch.setattr(runner, "_prediction", stop_at_the_eighth)
    capsys.readouterr()
    assert cli_main(_argv(setup, out)) == 130
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and error.startswith("kvcompress: interrupted after 7 of 120 runs") and "--resume" in error
    payload = json.loads((out / "results.json").read_text())
    assert payload["partial"] is True and payload["runs_done"] == 7 and payload["runs_total"] == 120
    assert "PARTIAL: 7 of 120 runs" in (out / "results.md").read_text()
    assert len((out / "predictions.jsonl").read_text().splitlines()) == 7
    monkeypatch.setattr(runner, "_prediction", made)

    assert cli_main(["report", str(out), "--out", str(tmp_path / "merged")]) == 2  # a partial run is not merged
    assert "unfinished eval (7 of 120 runs)" in capsys.readouterr().err
    assert cli_main(_argv(setup, out)) == 2 and "--resume" in capsys.readouterr().err  # nor silently replaced
    argv = _argv(setup, out, "--resume")
    argv[argv.index("8,24")] = "8,16"
    assert cli_main(argv) == 2 and "made with another budgets" in capsys.readouterr().err

    with (out / "predictions.jsonl").open("a") as handle:  # the line a hard kill cut short
        handle.write('{"id": "s1", "task": "to')
    assert cli_main(_argv(setup, out, "--resume")) == 0
    assert _results(out) == whole  # every answer, score, size and row, in the same order
    assert json.loads((out / "results.json").read_text())["partial"] is False
    assert cli_main(["report", str(out), "--out", str(tmp_path / "merged")]) == 0


def test_ctrl_c_between_a_prediction_and_its_line_leaves_the_folder_consistent(setup, tmp_path, capsys, monkeypatch):
    import kvcompress.cli as cli

    line_of = cli._prediction_line

    def cut_at_the_third_line(prediction):  # the signal lands after the run is counted, before its line is written
        cut_at_the_third_line.calls += 1
        if cut_at_the_third_line.calls == 3:
            raise KeyboardInterrupt
        return line_of(prediction)

    cut_at_the_third_line.calls = 0
    monkeypatch.setattr(cli, "_prediction_line", cut_at_the_third_line)
    out = tmp_path / "cut"
    assert cli_main(_argv(setup, out)) == 130
    assert "interrupted after 3 of 120 runs" in capsys.readouterr().err
    payload = json.loads((out / "results.json").read_text())
    lines = (out / "predictions.jsonl").read_text().splitlines()
    assert payload["runs_done"] == len(lines) == sum(r["n"] for r in payload["rows"]) == 3
    monkeypatch.setattr(cli, "_prediction_line", line_of)
    assert cli_main(_argv(setup, out, "--resume")) == 0
    assert cli_main(_argv(setup, tmp_path / "whole")) == 0
    assert _results(out) == _results(tmp_path / "whole")


def test_ctrl_c_in_a_subprocess_ends_in_one_line_and_a_consistent_folder(setup, tmp_path):
    model, tasks = setup
    rows = Path(tasks).read_text().splitlines()
    # 360 runs (3 s on an AVX-512 EPYC, 9 s on a Zen 3): the signal, sent within 50 ms of the third prediction, comes long
    # before the end on a fast machine too
    longer = tmp_path / "longer.jsonl"
    longer.write_text("".join(json.dumps({**json.loads(r), "id": f"{json.loads(r)['id']}-{k}"}) + "\n" for k in range(3) for r in rows))
    setup = (model, str(longer))
    out = tmp_path / "cut"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # SIGINT as a terminal sends it; a background job inherits it ignored, and Python then installs no handler
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    process = subprocess.Popen([sys.executable, "-m", "kvcompress.cli", *_argv(setup, out)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, preexec_fn=default_sigint)
    predictions = out / "predictions.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (predictions.exists() and predictions.read_text().count("\n") >= 3):
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, error = process.communicate(timeout=120)
    assert process.returncode == 130, error
    assert "Traceback" not in error and error.strip().splitlines()[-1].startswith("kvcompress: interrupted after")
    payload = json.loads((out / "results.json").read_text())
    lines = predictions.read_text().splitlines()
    assert payload["partial"] is True and payload["runs_done"] == len(lines) < payload["runs_total"] == 3 * 5 * len(rows)  # full + 2 methods × 2 sizes
    assert sum(r["n"] for r in payload["rows"]) == len(lines)  # the tables hold exactly what was predicted
    assert cli_main(["report", str(out), "--out", str(tmp_path / "merged")]) == 2
    assert cli_main(_argv(setup, out, "--resume")) == 0
    assert cli_main(_argv(setup, tmp_path / "whole")) == 0
    assert _results(out) == _results(tmp_path / "whole")
