"""The eval runner: prefill sharing changes nothing, rows follow the schema, files are written."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from common import toy_task_file
from conftest import tiny_config, tiny_tokenizer
from kvcompress.cli import main as cli_main
from kvcompress.eval.report import eval_markdown, plot_accuracy_vs_kr, plot_accuracy_vs_kr_by_task
from kvcompress.eval.runner import EvalSettings, method_grid, prediction_record, run_eval

ROW_KEYS = {"method", "budget", "ratio", "task", "n", "score", "kr", "cr", "kv_bytes", "kv_bytes_full", "entries_per_head",
            "prefill_s", "compress_s", "decode_ms_per_token"}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    model.generation_config.eos_token_id = None
    return model, tiny_tokenizer()


@pytest.fixture
def task_file(tmp_path):
    return toy_task_file(tmp_path / "tasks.jsonl")


def _settings(task_file, **kw):
    return EvalSettings(methods=["snapkv", "h2o", "adakv", "streamingllm"], budgets=[8, 24], tasks=[],
                        task_files=[str(task_file)], samples=3, max_new_tokens=6, **kw)


@pytest.mark.parametrize("query_aware", [False, True])
def test_shared_prefill_gives_identical_answers(tiny, task_file, query_aware):
    model, tokenizer = tiny
    _, shared, _ = run_eval(model, tokenizer, _settings(task_file, query_aware=query_aware), progress=False)
    _, alone, _ = run_eval(model, tokenizer, _settings(task_file, query_aware=query_aware, share_prefill=False), progress=False)
    assert [(p.id, p.method, p.budget, p.answer, p.kr) for p in shared] == [(p.id, p.method, p.budget, p.answer, p.kr) for p in alone]


def test_rows_follow_the_schema_and_average_tasks(tiny, task_file):
    model, tokenizer = tiny
    seen = []
    rows, predictions, _ = run_eval(model, tokenizer, _settings(task_file), progress=False, on_prediction=seen.append)
    assert len(predictions) == 3 * (1 + 4 * 2)
    assert seen == predictions  # each one as it came, in order
    assert all(ROW_KEYS <= set(r) for r in rows)
    full = next(r for r in rows if r["method"] == "full")
    assert full["n"] == 3 and full["kr"] > 1.0
    snap8 = next(r for r in rows if r["method"] == "snapkv" and r["budget"] == 8)
    snap24 = next(r for r in rows if r["method"] == "snapkv" and r["budget"] == 24)
    assert snap8["kr"] < snap24["kr"] < full["kr"]
    record = prediction_record(predictions[0])
    assert {"id", "task", "method", "budget", "ratio", "answer", "correct", "kr"} <= set(record)
    samples = {json.loads(line)["id"]: json.loads(line) for line in task_file.read_text().splitlines()}
    for p in predictions:  # every line can be audited: the question and the references its score is against
        line = prediction_record(p)
        assert line["question"] == samples[p.id]["question"] and line["references"] == samples[p.id]["answers"]
        assert line["prompt_tokens"] > 0 and 0 < line["cr"] <= 1.0 + 1e-9


def test_method_grid_runs_full_once_and_validates_up_front():
    grid = method_grid(EvalSettings(methods=["full", "snapkv", "adakv"], ratios=[0.1, 0.5]))
    assert [m.label for m in grid] == ["full", "snapkv@0.1", "snapkv@0.5", "adakv@0.1", "adakv@0.5"]
    with pytest.raises(ValueError, match="unknown method"):
        method_grid(EvalSettings(methods=["snap"], ratios=[0.1]))
    with pytest.raises(ValueError, match="ratio must be"):
        method_grid(EvalSettings(methods=["snapkv"], ratios=[1.5]))
    with pytest.raises(ValueError, match="unknown task"):
        EvalSettings(methods=["snapkv"], tasks=["niah"])


def test_method_specs_carry_options_and_keep_variants_apart():
    grid = method_grid(EvalSettings(methods=["keepkv", "keepkv:key_rule=votes:max_key_scale=inf", "gvote:p_nuc=0.9"], budgets=[64]))
    assert [m.variant for m in grid] == ["full", "keepkv", "keepkv[key_rule=votes,max_key_scale=inf]", "gvote[p_nuc=0.9]"]
    assert grid[2].fate.max_key_scale == float("inf") and grid[2].budget == 64 and grid[3].budget is None
    with pytest.raises(ValueError, match="has no option"):
        method_grid(EvalSettings(methods=["snapkv:windw=8"], budgets=[64]))
    with pytest.raises(ValueError, match="name:option=value"):
        method_grid(EvalSettings(methods=["snapkv:window"], budgets=[64]))


def test_report_table_and_plot(tmp_path):
    rows = [
        {"method": "full", "budget": None, "ratio": None, "task": "a", "n": 2, "score": 90.0, "kr": 1.0, "decode_ms_per_token": 5.0},
        {"method": "snapkv", "budget": None, "ratio": 0.25, "task": "a", "n": 2, "score": 50.0, "kr": 0.25, "decode_ms_per_token": 4.0},
        {"method": "snapkv", "budget": None, "ratio": 0.5, "task": "a", "n": 2, "score": 70.0, "kr": 0.5, "decode_ms_per_token": 4.5},
        {"method": "quest", "budget": None, "ratio": 0.25, "task": "a", "n": 2, "score": 85.0, "kr": 1.06, "cr": 0.26,
         "decode_ms_per_token": 4.5},
    ]
    table = eval_markdown(rows, "t")
    assert "| snapkv | 0.25 | 50.0 | 0.250 |  | 4.0 |" in table and table.index("| full") < table.index("| snapkv")
    assert "| quest | 0.25 | 85.0 | 1.060 | 0.260 | 4.5 |" in table
    plot_accuracy_vs_kr(rows, tmp_path / "p.png", "t")
    plot_accuracy_vs_kr(rows, tmp_path / "cr.png", "t", axis="cr")
    assert (tmp_path / "p.png").stat().st_size > 1000 and (tmp_path / "cr.png").stat().st_size > 1000


def test_adaptive_methods_show_their_kr_per_task(tmp_path):
    def row(method, task, score, kr, ratio=None):
        return {"method": method, "budget": None, "ratio": ratio, "task": task, "n": 2, "score": score, "kr": kr, "decode_ms_per_token": 1.0}

    rows = [row("full", t, 90.0, 1.0) for t in ("a", "b")]
    rows += [row("snapkv", t, s, r, r) for t in ("a", "b") for s, r in ((40.0, 0.25), (60.0, 0.5))]
    rows += [row("gvote", "a", 55.0, 0.2), row("gvote", "b", 70.0, 0.6)]
    table = eval_markdown(rows, "t")
    assert "| gvote | 0.200 | 0.600 |" in table and "| snapkv | 0.200" not in table
    plot_accuracy_vs_kr_by_task(rows, tmp_path / "tasks.png", "t")
    assert (tmp_path / "tasks.png").stat().st_size > 1000


@pytest.mark.slow
def test_cli_eval_writes_every_file(tmp_path):
    code = cli_main(["eval", "--methods", "snapkv", "--ratios", "0.5", "--tasks", "niah_single", "--samples", "1",
                     "--context-tokens", "300", "--out", str(tmp_path), "--quiet"])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert {"rows", "model", "seed", "version", "settings"} <= set(results)
    assert len((tmp_path / "predictions.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "results.md").exists() and (tmp_path / "accuracy_vs_kr.png").exists() and (tmp_path / "accuracy_vs_cr.png").exists()


def test_report_merges_comparable_runs_and_refuses_others(tmp_path, capsys):
    from kvcompress.eval.report import write_json

    def run(name, rows, model="m", **changed):
        settings = {"context_tokens": 1024, "samples": 8, "seed": 0, "query_aware": False, "max_new_tokens": None, **changed}
        (tmp_path / name).mkdir()
        write_json(tmp_path / name / "results.json", rows, model=model, seed=0, settings=settings)
        return str(tmp_path / name)

    def row(method, ratio, score, task="a"):
        return {"method": method, "budget": None, "ratio": ratio, "task": task, "n": 8, "score": score, "kr": ratio or 1.0,
                "decode_ms_per_token": 1.0}

    first = run("one", [row("full", None, 90.0), row("snapkv", 0.5, 40.0)])
    second = run("two", [row("full", None, 90.0), row("snapkv", 0.5, 45.0), row("gvote", None, 60.0)])
    other = run("three", [row("full", None, 80.0)], samples=2)
    out = tmp_path / "merged"
    assert cli_main(["report", first, second, "--out", str(out)]) == 0
    merged = json.loads((out / "results.json").read_text())["rows"]
    assert sorted((r["method"], r["score"]) for r in merged) == [("full", 90.0), ("gvote", 60.0), ("snapkv", 45.0)]
    assert (out / "accuracy_vs_kr.png").exists()
    assert json.loads((out / "results.json").read_text())["model"] == "m"  # the runs' model, not the default's name
    assert (out / "results.md").read_text().startswith("# eval: m,")
    assert cli_main(["report", first, other, "--out", str(out)]) == 2  # results are there: refused, untouched
    assert "already holds" in capsys.readouterr().err and json.loads((out / "results.json").read_text())["rows"] == merged
    assert cli_main(["report", first, other, "--out", str(out), "--overwrite"]) == 2
    assert "samples differ" in capsys.readouterr().err
    assert cli_main(["report", str(tmp_path / "missing"), "--out", str(out), "--overwrite"]) == 2
    another_model = run("four", [row("full", None, 90.0)], model="other")
    assert cli_main(["report", first, another_model, "--out", str(out), "--overwrite"]) == 2
    assert "different models" in capsys.readouterr().err


def test_sizes_given_on_the_command_line_replace_the_verbs_defaults():
    from kvcompress.cli import _sizes, build_parser

    parser = build_parser()
    assert _sizes(parser.parse_args(["diagnose"])) == ([64, 128, 256], None)
    assert _sizes(parser.parse_args(["diagnose", "--ratios", "0.1,0.5"])) == (None, [0.1, 0.5])
    assert _sizes(parser.parse_args(["bench", "--ratios", "0.25"])) == (None, [0.25])
    assert _sizes(parser.parse_args(["bench", "--budgets", "32"])) == ([32], None)
    with pytest.raises(SystemExit):
        parser.parse_args(["diagnose", "--ratios", "0.1", "--budgets", "64"])


def test_command_line_methods_take_the_default_size_only_when_they_need_one():
    from kvcompress.cli import _method

    assert _method("snapkv", default_ratio=0.25).ratio == 0.25
    assert _method("snapkv:window=8", budget=64, default_ratio=0.25).budget == 64
    assert _method("snapkv", budget=64, default_ratio=0.25).ratio is None
    gvote = _method("gvote:p_nuc=0.9", default_ratio=0.25)  # sizes itself: no default ratio forced on it
    assert gvote.ratio is None and gvote.budget is None and gvote.sizes.p_nuc == 0.9
    assert _method("full", default_ratio=0.25).ratio is None
    with pytest.raises(ValueError, match="chooses its own budget"):
        _method("gvote", ratio=0.5)  # a size given explicitly still reaches it, and is refused


def test_a_task_file_alone_runs_only_its_tasks_and_limit_cuts_files_not_samples(task_file):
    from kvcompress import cli
    from kvcompress.eval.runner import load_samples

    args = cli.build_parser().parse_args(["eval", "--task-file", str(task_file), "--samples", "1"])
    assert cli._tasks(args) == []  # only the file: no built-in task sneaks in
    assert cli._tasks(cli.build_parser().parse_args(["eval"])) == list(cli.BUILTIN_TASKS)
    assert cli._tasks(cli.build_parser().parse_args(["eval", "--tasks", "vt", "--task-file", str(task_file)])) == ["vt"]
    settings = EvalSettings(methods=["snapkv"], tasks=[], task_files=[str(task_file)], samples=1)
    assert len(load_samples(settings, tokenizer=None)) == 3  # --samples is per built-in task: the file runs whole
    limited = EvalSettings(methods=["snapkv"], tasks=[], task_files=[str(task_file)], samples=1, limit=2)
    assert [s.id for s in load_samples(limited, tokenizer=None)] == ["s0", "s1"]
    with pytest.raises(ValueError, match="limit must be ≥ 1"):
        EvalSettings(methods=["snapkv"], tasks=[], task_files=[str(task_file)], limit=0)


def test_cli_eval_on_a_task_file_states_the_real_prompt_lengths(tiny_checkpoint, tmp_path):
    path = tmp_path / "tasks.jsonl"
    with path.open("w") as handle:
        for i, n in enumerate((20, 35)):
            row = {"id": f"s{i}", "context": " ".join(["a"] * n), "question": "b", "answers": ["c"], "task": "toy",
                   "metric": "contains"}
            handle.write(json.dumps(row) + "\n")
    out = tmp_path / "out"
    code = cli_main(["eval", "--model", str(tiny_checkpoint()), "--methods", "snapkv", "--ratios", "0.5", "--task-file",
                     str(path), "--max-new-tokens", "2", "--out", str(out), "--quiet"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    low, high = results["prompt_tokens"]
    assert low < high and f"prompts of {low}–{high} tokens" in (out / "results.md").read_text()
    lines = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert {line["id"] for line in lines} == {"s0", "s1"} and {line["task"] for line in lines} == {"toy"}  # the file only


def _haystack_file(path, seed=0):
    """Six documents of prose with digits, separated by form feeds."""
    import random

    rng = random.Random(seed)
    docs = ["\n\n".join(f"Report {d} of {1900 + d}: the pier counted {rng.randrange(10, 99999)} crates,\nand "
                          f"{rng.randrange(2, 999)} gulls slept. Tide table {rng.randrange(10**8, 10**9)}." for _ in range(8))
            for d in range(6)]
    path.write_text("\n\f\n".join(docs) + "\n")
    return path


def test_eval_settings_name_the_haystack(tmp_path):
    import hashlib

    path = _haystack_file(tmp_path / "pier.txt")
    settings = EvalSettings(methods=["snapkv"], tasks=["vt"], haystack=path)
    assert settings.haystack == str(path) and settings.haystack_id == f"pier.txt:{hashlib.sha256(path.read_bytes()).hexdigest()[:8]}"
    assert EvalSettings(methods=["snapkv"]).haystack_id is None
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        EvalSettings(methods=["snapkv"], haystack=tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="--haystack fills the built-in tasks"):
        EvalSettings(methods=["snapkv"], tasks=[], task_files=["x.jsonl"], haystack=path)


def test_cli_eval_on_a_haystack_file(tiny_checkpoint, tmp_path, capsys):
    from kvcompress.eval.tasks import load_haystack

    path, other = _haystack_file(tmp_path / "pier.txt"), _haystack_file(tmp_path / "other.txt", seed=1)
    haystack = load_haystack(path)
    out = tmp_path / "out"
    flags = ["eval", "--model", str(tiny_checkpoint()), "--methods", "snapkv", "--ratios", "0.5", "--tasks", "niah_single,vt",
             "--samples", "2", "--context-tokens", "150", "--max-new-tokens", "2", "--out", str(out), "--quiet"]
    assert cli_main([*flags, "--haystack", str(path)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["haystack"] == str(path) and results["settings"]["haystack_id"] == haystack.id
    assert f"haystack {haystack.id}" in (out / "results.md").read_text().splitlines()[0]
    lines = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * 2 and all(f"-{haystack.tag}-0-" in line["id"] for line in lines)
    capsys.readouterr()
    assert cli_main([*flags, "--haystack", str(other), "--resume"]) == 2  # another haystack: never mixed in
    assert "haystack" in capsys.readouterr().err
    assert cli_main([*flags, "--resume"]) == 2  # nor the built-in prose
    assert cli_main([*flags, "--haystack", str(path), "--resume"]) == 0  # the same one: nothing left to run
    assert len((out / "predictions.jsonl").read_text().splitlines()) == 8
    default = tmp_path / "default"
    assert cli_main([*flags[:-2], str(default), "--quiet"]) == 0
    capsys.readouterr()
    assert cli_main(["report", str(out), str(default), "--out", str(tmp_path / "merged")]) == 2  # report refuses to merge them
    assert "haystack_id differ" in capsys.readouterr().err


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _rows(methods, tasks, sizes=(0.1, 0.25, 0.5)):
    rows = [{"method": "full", "budget": None, "ratio": None, "task": t, "n": 4, "score": 90.0, "kr": 1.0, "cr": 1.0} for t in tasks]
    for i, method in enumerate(methods):
        for ratio in sizes:
            rows += [{"method": method, "budget": None, "ratio": ratio, "task": t, "n": 4, "score": 100 * ratio - i, "kr": ratio,
                      "cr": ratio} for t in tasks]
    return rows


@pytest.mark.parametrize("tasks", [["a", "b", "c", "d", "e"], ["a", "b", "c"], ["a", "b", "c", "d", "e", "f"]])
def test_legends_never_cover_a_panel(tasks):
    from kvcompress.eval.report import accuracy_by_task_figure, accuracy_figure, plt

    rows = _rows([f"method{i}" for i in range(12)], tasks)
    for fig in (accuracy_by_task_figure(rows, "t"), accuracy_figure(rows + [dict(r, task="all") for r in rows if r["task"] == "a"], "t")):
        renderer = fig.canvas.get_renderer()
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
        assert len(legends) == 1
        box = legends[0].get_window_extent(renderer)
        panels = [ax for ax in fig.axes if ax.lines or ax.collections]
        assert panels and not any(_overlaps(box, ax.get_window_extent(renderer)) for ax in panels)
        plt.close(fig)


def test_error_per_layer_gives_each_method_one_color_and_each_size_a_style():
    from kvcompress.diagnose import layer_error_figure
    from kvcompress.eval.report import plt

    rows = [{"method": m, "budget": b, "ratio": None, "label": f"{m}@{b}", "rel_error_per_layer": [0.1 * (i + 1), 0.2]}
            for i, m in enumerate(["snapkv", "adakv", "h2o"]) for b in (64, 128, 256)]
    fig = layer_error_figure(rows, "t")
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    for method in ("snapkv", "adakv", "h2o"):
        assert len({lines[f"{method}@{b}"].get_color() for b in (64, 128, 256)}) == 1
        assert [lines[f"{method}@{b}"].get_linestyle() for b in (64, 128, 256)] == ["-", "--", ":"]
    assert len({lines[f"{m}@64"].get_color() for m in ("snapkv", "adakv", "h2o")}) == 3
    plt.close(fig)


def test_report_title_states_the_prompt_lengths_run_not_the_context_tokens_setting(tmp_path):
    from kvcompress.eval.report import write_json

    settings = {"context_tokens": 1536, "samples": 10, "seed": 0, "query_aware": False, "max_new_tokens": None, "tasks": [],
                "task_files": ["my.jsonl"]}
    rows = [{"method": "full", "budget": None, "ratio": None, "task": "toy", "n": 2, "score": 50.0, "kr": 1.0, "cr": 1.0,
             "decode_ms_per_token": 1.0}]

    def run(name, lengths=None, predictions=()):
        (tmp_path / name).mkdir()
        extra = {"prompt_tokens": lengths} if lengths else {}
        write_json(tmp_path / name / "results.json", rows, model="m", seed=0, settings=settings, **extra)
        (tmp_path / name / "predictions.jsonl").write_text("".join(json.dumps({"prompt_tokens": n}) + "\n" for n in predictions))
        return str(tmp_path / name)

    first, same = run("one", [561, 583]), run("two", predictions=[583, 561, 570])  # the second: lengths from its predictions
    assert cli_main(["report", first, same, "--out", str(tmp_path / "a")]) == 0
    title = (tmp_path / "a" / "results.md").read_text().splitlines()[0]
    assert "prompts of 561–583 tokens" in title and "1536" not in title and "differ" not in title
    saved = json.loads((tmp_path / "a" / "results.json").read_text())
    assert saved["prompt_tokens"] == [561, 583] and saved["prompt_tokens_by_run"] == [[561, 583], [561, 583]]
    longer = run("three", [900, 950])
    assert cli_main(["report", first, longer, "--out", str(tmp_path / "b")]) == 0
    title = (tmp_path / "b" / "results.md").read_text().splitlines()[0]
    assert "prompts of 561–950 tokens (the merged runs' prompt lengths differ)" in title
    assert cli_main(["report", str(tmp_path / "b"), "--out", str(tmp_path / "c")]) == 0  # a report of a report stays honest
    assert "differ" in (tmp_path / "c" / "results.md").read_text().splitlines()[0]


def test_context_label_names_the_setting_only_for_built_in_tasks():
    from kvcompress.eval.report import context_label

    assert context_label({"context_tokens": 1536, "task_files": []}, [[1540, 1560]]) == "1536 context tokens"
    assert context_label({"context_tokens": 1536, "task_files": ["f.jsonl"]}, [[570, 570]]) == "prompts of 570 tokens"
    assert context_label({"context_tokens": 1536, "task_files": ["f.jsonl"]}, [None]) == "prompt lengths unknown"
    assert "recorded by 1 of 2" in context_label({"task_files": ["f.jsonl"]}, [[500, 600], None])


def _colors(fig) -> dict[str, str]:
    """Each legend entry's color in a figure (lines and scattered points alike)."""
    from matplotlib.colors import to_hex

    colors = {}
    for ax in fig.axes:
        for line in ax.lines:
            colors[line.get_label()] = to_hex(line.get_color())
        for points in ax.collections:
            colors[points.get_label()] = to_hex(points.get_facecolor()[0])
    return colors


def test_a_method_has_one_color_in_every_plot_whatever_else_is_in_it():
    from kvcompress.diagnose import layer_error_figure
    from kvcompress.eval.report import accuracy_by_task_figure, accuracy_figure, plt

    first = accuracy_figure(_rows(["snapkv", "h2o"], ["all"]), "t")
    second = accuracy_by_task_figure(_rows(["quest", "snapkv", "adakv", "h2o"], ["a", "b"]), "t")
    third = accuracy_figure(_rows(["streamingllm", "snapkv"], ["all"]) + [
        {"method": "gvote", "budget": None, "ratio": None, "task": "all", "n": 4, "score": 60.0, "kr": 0.3, "cr": 0.3}], "t", axis="cr")
    rows = [{"method": m, "budget": 64, "ratio": None, "label": f"{m}@64", "rel_error_per_layer": [0.1, 0.2]}
            for m in ("adakv", "quest", "snapkv", "keepkv[key_rule=votes]")]
    fourth = layer_error_figure(rows, "t")
    seen: dict[str, set] = {}
    for fig in (first, second, third, fourth):
        for label, color in _colors(fig).items():
            seen.setdefault(label.split("@")[0], set()).add(color)
        plt.close(fig)
    assert {"snapkv", "h2o", "quest", "adakv", "gvote", "streamingllm"} <= set(seen)
    assert all(len(colors) == 1 for colors in seen.values()), seen
    assert len({next(iter(c)) for m, c in seen.items() if m != "keepkv[key_rule=votes]"}) == len(seen) - 1  # all distinct


def test_method_colors_follow_the_registry_and_variants_keep_their_base_color():
    from kvcompress.eval.report import method_color, method_style

    registered = __import__("kvcompress").available_methods()
    assert len({method_color(m) for m in registered}) == len(registered)  # every registered method its own color
    variant = method_style("keepkv[key_rule=votes]")
    assert variant["color"] == method_color("keepkv") and variant != method_style("keepkv")  # the base's color, its own line
    assert method_color("not-a-method") == method_color("not-a-method")  # a stable fallback
