"""The engine: exact tokens against transformers and the single-request cache, continuous batching,
admission by compressed size, preemption, sampling, bad input, pool accounting."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common import tiny_codec, tiny_method, tiny_model
from conftest import tiny_tokenizer
import kvcompress as kvc
from kvcompress import hugepages
from kvcompress.engine import SamplingParams
from kvcompress.engine.packed import can_pack, packs

# Batched fp32 matrix products round differently from batch-1 ones (≈1e-6 relative), so a random
# tiny model — whose next-token logits are nearly tied — could pick another token. The output layer
# is sharpened (×40) so that every greedy choice has a margin far above that rounding.
SHARP = 40.0


def sharp_model(seed=1, layers=2):
    model = tiny_model(seed=seed, layers=layers)
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARP)
    return model


def make_llm(model, kv_memory="4MiB", max_num_seqs=8, **kw):
    return kvc.LLM(model_and_tokenizer=(model, tiny_tokenizer()), kv_memory=kv_memory, max_num_seqs=max_num_seqs, **kw)


def prompts_of(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]


def reference(model, prompt, new, method=None):
    cache = None if method is None else kvc.CompressedCache(model, method)
    out = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_staggered(llm, prompts, params, method=None, every=2):
    """Requests arrive one every ``every`` steps (joining the running batch between decoding steps)."""
    ids, pending, steps = [], list(prompts), 0
    while pending or llm.has_unfinished():
        if pending and steps % every == 0:
            ids.append(llm.add_request(pending.pop(0), params, method))
        llm.step()
        steps += 1
    return [llm.output(i) for i in ids]


@pytest.mark.parametrize("pack_weights", [True, False])
def test_full_equals_model_generate_for_mixed_lengths_arriving_at_different_steps(pack_weights):
    """The engine's own forward, its products fused over packed copies or each module's own, gives transformers'
    tokens; the copies' bytes are what it reports."""
    model = sharp_model()
    llm = make_llm(model, pack_weights=pack_weights)
    weight_bytes = {name: m.weight.numel() * m.weight.element_size() for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear)}
    assert llm.packed_weight_bytes == (sum(weight_bytes.values()) if pack_weights and can_pack(model.lm_head)
                                      and packs(model.lm_head.weight.dtype) else 0)
    prompts = prompts_of([40, 95, 12, 70, 33])
    outs = run_staggered(llm, prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(model, prompt, 12) and out.finish_reason == "length"
        assert out.prompt_token_ids == prompt
    assert llm.stats()["max_concurrent"] >= 3
    assert llm.pool.num_used == 0 and llm.stats()["pool_used_bytes"] == 0


def test_the_engine_moves_the_weights_onto_huge_pages_and_keeps_transformers_tokens():
    """The engine streams every weight each decoding step: they move, all of them, into one mapping on huge pages
    (``hugepages.move_parameters``), the embedding first at a huge page's start; the tokens stay transformers'."""
    model = tiny_model(seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARP)
    prompts = prompts_of([30, 55], seed=2)
    expected = [reference(model, prompt, 8) for prompt in prompts]
    llm = make_llm(model, kv_memory="8MiB")
    first = model.model.embed_tokens.weight.data_ptr()
    assert (first % hugepages.HUGE_PAGE == 0) == hugepages.advises()
    if hugepages.advises():  # every parameter after the first, within the one mapping
        size = sum(p.numel() * p.element_size() + hugepages.ALIGN for p in model.parameters())
        assert all(first <= p.data_ptr() < first + size for p in model.parameters())
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [out.token_ids for out in outs] == expected


def spy_pieces(llm) -> list[tuple[int, int]]:
    """(first token, tokens) of every prompt piece the engine's steps prefill, as they run."""
    seen, real = [], llm.runner.step

    def step(requests, pieces):
        seen.extend((p.start, p.count) for p in pieces)
        return real(requests, pieces)

    llm.runner.step = step
    return seen


def test_chunked_prefill_mixed_with_decoding_equals_model_generate():
    """A step of 16 tokens: long prompts come in chunks beside the decoding requests (several prompts in one
    forward when they fit); the tokens are transformers' own."""
    model = sharp_model()
    llm = make_llm(model, max_num_batched_tokens=16)
    pieces = spy_pieces(llm)
    prompts = prompts_of([40, 95, 12, 70, 3, 33])
    outs = run_staggered(llm, prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(model, prompt, 12) and out.finish_reason == "length"
    assert any(start > 0 for start, _ in pieces)  # chunked
    assert max(count for _, count in pieces) <= 16 and sum(count for _, count in pieces) == sum(map(len, prompts))
    assert llm.pool.num_used == 0


@pytest.mark.parametrize("step_tokens", [2048, 24])
@pytest.mark.parametrize("name", ["snapkv", "adakv", "streamingllm", "h2o", "momentkv", "keepkv", "cam", "gvote", "retention",
                                  "kvzip", "expected_attention"])
def test_compressing_methods_equal_the_single_request_cache(name, step_tokens):
    """Whole prompts packed in a step, or chunked (24 tokens a step): the single-request cache's tokens (GVote and
    KVzip, which need their prompt in one forward, are prefilled alone)."""
    model = sharp_model(seed=2)
    options = {"budget": 20, **({"window": 8} if name not in ("streamingllm", "h2o", "retention", "kvzip", "expected_attention") else {}),
               **({"slack": 4} if name == "retention" else {})}
    method = kvc.get_method(name) if name == "gvote" else tiny_method(name, model, **options)
    llm = make_llm(model, max_num_batched_tokens=step_tokens)
    prompts = prompts_of([64, 90, 41], seed=3)
    outs = run_staggered(llm, prompts, SamplingParams(max_tokens=10, ignore_eos=True), method, every=3)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(model, prompt, 10, method), name
        assert out.stats["kr"] < 1.0 or name == "gvote"
    assert llm.pool.num_used == 0


@pytest.mark.parametrize("spec", ["snapkv:window=8", "h2o", "quest:page_size=4:recent=4:sinks=2:dense_layers=0"])
def test_the_engine_counts_the_entries_read_as_the_single_request_cache(spec):
    """cr (entries read per decoding step ÷ full's): counted once per step for a method that only reads
    (``Session.begin_step``), per layer for one that acts or selects; either way as the single-request cache counts."""
    model = sharp_model(seed=2)
    method = kvc.get_method(spec, budget=20)
    prompt = prompts_of([90], seed=3)[0]
    cache = kvc.CompressedCache(model, method)
    model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=10, do_sample=False, pad_token_id=0)
    out = make_llm(model).generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True), method=method)[0]
    assert 0 < cache.stats()["cr"] < 1
    assert out.stats["cr"] == pytest.approx(cache.stats()["cr"], rel=1e-9)


def test_admission_by_compressed_size_fits_more_requests():
    model = sharp_model()
    per_token = 2 * 2  # layers × KV heads
    memory = 128 * per_token * 260  # slots of 2·16·4 bytes: room for about two 100-token prompts in full
    prompts = prompts_of([100] * 6, seed=4)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    full = make_llm(model, kv_memory=memory)
    full.generate(prompts, params)
    snap = make_llm(model, kv_memory=memory)
    outs = snap.generate(prompts, params, method=kvc.get_method("snapkv", budget=12, window=4))
    assert full.stats()["max_concurrent"] == 2 and full.stats()["preemptions"] == 0
    assert snap.stats()["max_concurrent"] == 6
    assert all(len(o.token_ids) == 8 for o in outs) and snap.pool.num_used == 0


@pytest.mark.parametrize("spec", ["kivi:bits=4:group_size=16:residual=8", 'snapkv:budget=40:window=8+kivi:bits=2:group_size=16:residual=8',
                                  "deltakv:recent=8:chunk=8", 'omnikv:ratio=0.5:filters=(0,)+deltakv:recent=8:chunk=8:checkpoint=CODEC'])
def test_coded_requests_equal_the_single_request_cache(spec):
    """Coded storage in the engine (KIVI, DeltaKV, each alone and under another method): the same tokens as the
    single-request cache with the same codec, entries coded as they arrive (prompts and answers span several
    blocks and chunks), every block and reference released at the end."""
    from kvcompress.methods import get_method

    model = sharp_model(seed=2)
    codec = tiny_codec(model)
    method = get_method(spec.replace("CODEC", codec) + ("" if "CODEC" in spec or "deltakv" not in spec else f':checkpoint="{codec}"'))
    llm = make_llm(model)
    prompts = prompts_of([64, 90, 41], seed=3)
    outs = run_staggered(llm, prompts, SamplingParams(max_tokens=24, ignore_eos=True), method, every=3)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(model, prompt, 24, method), spec
        assert out.stats["kr"] < 0.8  # coded (under OmniKV its filter layer, half of this model, stays raw: 0.75)
    assert llm.pool.used_bytes == 0 and llm.pool.tiers and all(int(t.refs.sum()) == 0 for t in llm.pool.tiers)


def test_coded_requests_fit_more_in_the_same_budget_and_never_exceed_it():
    """The pool is one byte budget for plain slots and coded blocks: 2-bit KIVI runs more requests at once
    than the full cache in the same kv_memory, and the bytes held never pass it."""
    model = sharp_model()
    memory = 128 * 4 * 400  # 400 tokens' worth of plain slots: one 300-token prompt in full
    prompts = prompts_of([300] * 4, seed=4)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    full = make_llm(model, kv_memory=memory)
    full.generate(prompts, params)
    kivi = make_llm(model, kv_memory=memory)
    held = []
    kivi.scheduler.make_room = lambda make_room=kivi.scheduler.make_room: held.append(kivi.pool.used_bytes) or make_room()
    outs = kivi.generate(prompts, params, method=kvc.get_method("kivi", bits=2, group_size=16, residual=8))
    assert full.stats()["max_concurrent"] == 1
    assert kivi.stats()["max_concurrent"] >= 3 and kivi.stats()["preemptions"] == 0
    assert max(held) > full.stats()["pool_peak_bytes"] / 2  # the coded requests filled the same budget
    assert kivi.stats()["pool_peak_bytes"] <= kivi.pool.capacity_bytes == full.pool.capacity_bytes
    assert kivi.pool.allocated_bytes < kivi.stats()["pool_allocated_bytes"]  # idle: the coded tiers gave their memory back
    assert all(o.token_ids == reference(model, p, 8, kvc.get_method("kivi", bits=2, group_size=16, residual=8))
               for p, o in zip(prompts, outs))


def test_preempted_requests_are_recomputed_and_complete():
    """A method that keeps more than estimated (GVote reserves the prompt, but full decoding grows): with a
    tight pool the newest request is preempted, recomputed, and still answers exactly as alone."""
    model = sharp_model(seed=3)
    per_token = 4
    llm = make_llm(model, kv_memory=128 * per_token * 150)
    prompts = prompts_of([60, 60, 60], seed=5)
    llm.scheduler.growth = lambda request: 0  # reserve nothing for decoding: the pool must run short
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert llm.stats()["preemptions"] > 0
    assert any(o.stats["preemptions"] > 0 for o in outs)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(model, prompt, 20)  # full: recomputing changes nothing
    assert llm.pool.num_used == 0


def test_a_prompt_that_can_never_fit_fails_alone():
    model = sharp_model()
    llm = make_llm(model, kv_memory=128 * 4 * 120)
    prompts = prompts_of([20, 200, 30], seed=6)
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "KV slots" in outs[1].error and "kv_memory" in outs[1].error and outs[1].token_ids == []
    assert llm.pool.num_used == 0


def test_bad_input_raises_before_anything_is_queued():
    model = sharp_model()
    llm = make_llm(model)
    used = llm.pool.num_used
    for prompts, params, match in [
        ([[]], SamplingParams(), "empty prompt"),
        ([[5] * 600], SamplingParams(max_tokens=4), "exceeds the model's 512 positions"),
        ([[5] * 10, [500]], SamplingParams(), r"token ids must be in \[0, 128\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompts, params)
        assert not llm.has_unfinished() and llm.pool.num_used == used
    with pytest.raises(ValueError, match="budget must be a positive"):
        llm.generate([[5] * 10], SamplingParams(), method=kvc.get_method("snapkv", budget=0))
    for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"seed": "x"}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="2 methods for 1 prompts"):
        llm.generate([[5] * 10], method=[kvc.get_method("full"), kvc.get_method("full")])
    with pytest.raises(ValueError, match="cannot read memory size"):
        make_llm(model, kv_memory="lots")
    for tokens in (4, 0, 16.0):  # a step must hold a token of every decoding request
        with pytest.raises(ValueError, match="max_num_batched_tokens must be a whole number ≥ max_num_seqs"):
            make_llm(model, max_num_seqs=8, max_num_batched_tokens=tokens)


def test_sampling_is_reproducible_per_request_alone_or_batched():
    model = tiny_model(seed=4)
    llm = make_llm(model)
    prompts = prompts_of([30, 50, 20], seed=7)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=123, ignore_eos=True)
    batched = llm.generate(prompts, params)
    alone = [llm.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    other = llm.generate(prompts[:1], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True))
    greedy = llm.generate(prompts[:1], SamplingParams(max_tokens=12, ignore_eos=True))
    assert other[0].token_ids != batched[0].token_ids and greedy[0].token_ids != batched[0].token_ids
    nucleus = llm.generate(prompts[:1], SamplingParams(max_tokens=12, temperature=5.0, top_p=1e-6, seed=9, ignore_eos=True))
    assert nucleus[0].token_ids == greedy[0].token_ids  # a vanishing nucleus holds only the top token


def test_stop_strings_and_end_of_sequence_finish_a_request():
    model = sharp_model()
    llm = make_llm(model)
    prompt = prompts_of([30], seed=8)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    words = full.text.split()
    stop = words[2]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and stop not in out.text and full.text.startswith(out.text)
    eos = tiny_tokenizer().eos_token_id
    if eos in full.token_ids:
        ended = llm.generate([prompt], SamplingParams(max_tokens=12))[0]
        assert ended.finish_reason == "stop" and ended.token_ids[-1] == eos


def test_a_stop_string_spanning_two_tokens_ends_the_request_at_the_token_that_completes_it():
    model = sharp_model()
    llm = make_llm(model)
    tokenizer = tiny_tokenizer()
    prompt = prompts_of([30], seed=8)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    words = full.text.split()
    stop = f"{words[0][-1]} {words[1][:2]}"  # the end of one token's word, the space and the start of the next's
    out = llm.generate([prompt], SamplingParams(max_tokens=12, stop=["absent", stop], ignore_eos=True))[0]
    taken = next(count for count in range(1, 13) if stop in tokenizer.decode(full.token_ids[:count], skip_special_tokens=True))
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop)]
    assert out.token_ids == full.token_ids[:taken]


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(3, 90), min_size=1, max_size=6), max_tokens=st.lists(st.integers(1, 12), min_size=6, max_size=6),
       memory=st.sampled_from([128 * 4 * 120, 128 * 4 * 260, 128 * 4 * 2000]), abort=st.integers(-1, 5), seed=st.integers(0, 100),
       step_tokens=st.sampled_from([4, 20, 2048]))
def test_pool_accounting_never_leaks(lengths, max_tokens, memory, abort, seed, step_tokens):
    """Random arrivals, lengths, lengths of answers, methods, aborts, pool sizes (preemptions included) and step
    sizes (chunked prefills): the slots in use are always exactly those the running requests hold, and all come back."""
    model = MODEL
    llm = make_llm(model, kv_memory=memory, max_num_seqs=4, max_num_batched_tokens=step_tokens)
    methods = [kvc.get_method("snapkv", budget=8, window=4), None, kvc.get_method("h2o", budget=10),
               kvc.get_method("keepkv", budget=9, window=4), kvc.get_method("kivi", bits=2, group_size=16, residual=8),
               tiny_method("deltakv", model, recent=8, chunk=8)]
    prompts = prompts_of(lengths, seed=seed)
    ids = []
    for step in range(200):
        if step < len(prompts):
            params = SamplingParams(max_tokens=max_tokens[step], ignore_eos=True)
            ids.append(llm.add_request(prompts[step], params, methods[step % len(methods)]))
        if step == 2 and 0 <= abort < len(ids):
            llm.abort(ids[abort])
        llm.step()
        sessions = [r.session for r in llm.scheduler.running if r.session is not None]
        assert llm.pool.used_bytes == sum(llm.pool.held_bytes(s.table.held_slots()) for s in sessions) <= memory
        if step >= len(prompts) and not llm.has_unfinished():
            break
    assert not llm.has_unfinished()
    assert llm.pool.used_bytes == 0 and int(llm.pool.refs.sum()) == 0 and all(int(t.refs.sum()) == 0 for t in llm.pool.tiers)
    for i in ids:
        out = llm.output(i)
        assert out.finish_reason in ("length", "abort", "error")


MODEL = sharp_model(seed=5)


@settings(max_examples=12, deadline=None)
@given(length=st.integers(20, 300), which=st.integers(0, 3))
def test_the_admission_estimate_of_coded_bytes_bounds_what_a_prompt_holds(length, which):
    """What the scheduler counts for a coded request's prompt (``held``) is never less than the bytes its
    session really holds after the prefill, and close to it for long prompts."""
    from kvcompress.engine.request import Request

    specs = [kvc.get_method("kivi", bits=2, group_size=16, residual=8), kvc.get_method("kivi", bits=4, group_size=16, residual=8),
             tiny_method("deltakv", MODEL, recent=8, chunk=8), kvc.get_method("snapkv:window=8+kivi:group_size=16:residual=8", budget=40)]
    llm = make_llm(MODEL)
    prompt = prompts_of([length], seed=length)[0]
    request = Request(0, prompt, SamplingParams(max_tokens=1), specs[which])
    llm.runner.prefill(request)
    estimate = llm.scheduler.held(request, llm.scheduler.kept(request)) * llm.pool.bytes_per_slot
    assert llm.pool.used_bytes <= estimate
    if length >= 200:
        assert estimate <= 1.35 * llm.pool.used_bytes + 40 * llm.scheduler.per_token * llm.pool.bytes_per_slot
    request.session.release()
    assert llm.pool.used_bytes == 0
