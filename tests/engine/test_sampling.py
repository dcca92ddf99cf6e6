"""Sampling as vLLM defines it: penalties, top-k, n answers, logprobs equal to transformers' logits; the
engine's interfaces a vLLM user expects (one string, chat, method specs)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompress as kvc
from conftest import tiny_tokenizer
from kvcompress.engine import SamplingParams
from kvcompress.engine.sampling import greedy_tokens, penalize, sample
from test_llm import make_llm, prompts_of, reference, sharp_model


def penalized_reference(logits, prompt, output, presence, frequency, repetition):
    """vLLM's penalties written out token by token in float64."""
    out = logits.double().clone()
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), prompt=st.lists(st.integers(0, 31), max_size=12), output=st.lists(st.integers(0, 31), max_size=12),
       presence=st.floats(-2, 2), frequency=st.floats(-2, 2), repetition=st.floats(0.1, 3))
def test_penalties_equal_vllms_definition(seed, prompt, output, presence, frequency, repetition):
    logits = torch.randn(32, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)
    got = penalize(logits, params, prompt, output)
    want = penalized_reference(logits, prompt, output, presence, frequency, repetition)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.lists(st.sampled_from(["greedy", "penalized", "sampled"]), min_size=1, max_size=6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_greedy_tokens_are_what_sample_draws_for_plain_greedy_rows_and_none_for_the_others(seed, rows, dtype):
    logits = (torch.randn(len(rows), 50, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype).float()
    kinds = {"greedy": SamplingParams(), "penalized": SamplingParams(repetition_penalty=1.5),
             "sampled": SamplingParams(temperature=0.8, seed=1)}
    params = [kinds[row] for row in rows]
    tokens, has_nan = greedy_tokens(logits, params)
    assert has_nan == [False] * len(rows)
    for row, kind, p, token in zip(logits, rows, params, tokens):
        assert (token == sample(row, p, None, [1, 2], [3])) if kind == "greedy" else token is None


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 6), width=st.sampled_from([7, 50, 49152]), data=st.data())
def test_greedy_tokens_flag_exactly_the_rows_holding_a_nan(seed, rows, width, data):
    """NaN anywhere in a row (beside ±inf or not) is found as ``isnan().any()`` finds it, and every other row's token is its
    argmax (the first of tied values), whether the compiled pass or ATen's argmax finds them."""
    logits = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 4
    if data.draw(st.booleans()):
        logits = logits.round()  # ties: the first of the largest, as argmax takes it
    for _ in range(data.draw(st.integers(0, 4))):
        row, column = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, width - 1))
        logits[row, column] = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    tokens, has_nan = greedy_tokens(logits, [SamplingParams()] * rows)
    assert has_nan == torch.isnan(logits).any(dim=-1).tolist()
    assert [t for t, nan in zip(tokens, has_nan) if not nan] == [int(r.argmax()) for r, nan in zip(logits, has_nan) if not nan]


def test_no_penalty_leaves_the_logits_untouched():
    logits = torch.randn(32)
    assert penalize(logits, SamplingParams(), [1, 2], [3, 3]) is logits


def test_top_k_draws_only_among_the_k_most_likely_and_top_k_1_is_greedy():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0))
    allowed = set(logits.topk(5).indices.tolist())
    gen = torch.Generator().manual_seed(1)
    drawn = {sample(logits, SamplingParams(temperature=1.5, top_k=5), gen) for _ in range(300)}
    assert drawn <= allowed and len(drawn) > 1
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1), gen) == int(logits.argmax())


def test_penalties_apply_under_greedy_decoding_too():
    logits = torch.tensor([5.0, 4.9, 0.0])
    assert sample(logits, SamplingParams(), None) == 0
    assert sample(logits, SamplingParams(frequency_penalty=0.5), None, [], [0]) == 1
    assert sample(logits, SamplingParams(repetition_penalty=1.2), None, [0], []) == 1


def test_logprobs_equal_log_softmax_of_the_models_logits():
    model = sharp_model()
    llm = make_llm(model)
    prompt = prompts_of([23])[0]
    out = llm.generate(prompt, SamplingParams(max_tokens=6, logprobs=5, ignore_eos=True))[0]
    assert out.token_ids == reference(model, prompt, 6) and len(out.logprobs) == 6
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :].float()
    want = torch.log_softmax(logits, dim=-1)
    for step, entry in enumerate(out.logprobs):
        assert entry.token_id == out.token_ids[step]
        assert entry.logprob == pytest.approx(float(want[step, entry.token_id]), abs=1e-4)
        top = want[step].topk(5)
        assert [i for i, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_logprobs_zero_gives_the_drawn_tokens_alone_and_none_gives_nothing():
    llm = make_llm(sharp_model())
    prompt = prompts_of([10])[0]
    out = llm.generate(prompt, SamplingParams(max_tokens=3, logprobs=0, ignore_eos=True))[0]
    assert [len(e.top) for e in out.logprobs] == [0, 0, 0]
    assert llm.generate(prompt, SamplingParams(max_tokens=3))[0].logprobs is None


def test_n_answers_per_prompt_in_order_each_reproducible_from_its_seed():
    llm = make_llm(sharp_model())
    prompts = prompts_of([12, 20])
    params = SamplingParams(max_tokens=5, temperature=1.0, n=3, seed=7, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.index for o in outs] == [0, 1, 2, 0, 1, 2]
    assert [o.prompt_token_ids for o in outs] == [prompts[0]] * 3 + [prompts[1]] * 3
    alone = llm.generate(prompts[1], SamplingParams(max_tokens=5, temperature=1.0, seed=8, ignore_eos=True))[0]
    assert outs[4].token_ids == alone.token_ids  # answer 1 draws with seed + 1
    assert llm.pool.used_bytes == 0


def test_generate_takes_one_string_and_refuses_what_is_not_a_prompt():
    llm = make_llm(sharp_model())
    params = SamplingParams(max_tokens=2)
    assert len(llm.generate("w1 w2 w3", params)) == 1
    for bad in ([], None, 5, [1.5, 2], ["w1", 3]):
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(bad, params)


def test_chat_applies_the_template_for_one_conversation_or_many():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1 {% endif %}"
    model = sharp_model()
    llm = kvc.LLM(model_and_tokenizer=(model, tokenizer), kv_memory="4MiB")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    conversation = [{"role": "user", "content": "w5 w6 w7"}]
    one = llm.chat(conversation, params)
    assert len(one) == 1 and one[0].prompt_token_ids == tokenizer("w5 w6 w7 w1", add_special_tokens=False).input_ids
    assert one[0].token_ids == llm.generate("w5 w6 w7 w1", params)[0].token_ids
    assert len(llm.chat([conversation, [{"role": "user", "content": "w9"}]], params)) == 2
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "w5"}], params)


def test_chat_without_a_template_says_to_use_generate():
    llm = make_llm(sharp_model())
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "w5"}])


def test_a_prompt_that_is_not_unicode_text_is_refused_before_anything_is_queued():
    llm = make_llm(sharp_model())
    with pytest.raises(ValueError, match="not valid Unicode"):
        llm.generate("w1 \ud800 w2", SamplingParams(max_tokens=2))
    assert not llm.has_unfinished()


def test_method_specs_work_everywhere_a_method_is_taken():
    model = sharp_model()
    llm = make_llm(model)
    prompt = prompts_of([60])[0]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    by_spec = llm.generate(prompt, params, method="snapkv:window=8:ratio=0.25")[0]
    by_object = llm.generate(prompt, params, method=kvc.get_method("snapkv", window=8, ratio=0.25))[0]
    assert by_spec.token_ids == by_object.token_ids and by_spec.stats["kv_bytes"] == by_object.stats["kv_bytes"]
    assert kvc.get_method("snapkv:window=16", ratio=0.1).score.window == 16


@pytest.mark.parametrize("spec,message", [("snapk:window=16", "unknown method 'snapk' in the spec"),
                                          ("snapkv:window", "bad option 'window'"),
                                          ("snapkv:window=1:window=2", "sets window twice"),
                                          ("snapkv:windw=4", "has no option windw"),
                                          ("snapkv:ratio=0.5", "gives its own size")])
def test_a_bad_spec_says_what_is_wrong_in_it(spec, message):
    with pytest.raises(ValueError, match=message):
        kvc.get_method(spec, ratio=0.25)


def test_a_prompt_no_longer_than_what_a_method_always_keeps_is_kept_whole():
    model = sharp_model()
    llm = make_llm(model)
    prompt = prompts_of([6])[0]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    snap = llm.generate(prompt, params, method="snapkv:ratio=0.25")[0]  # window 32 ≥ 6 tokens
    full = llm.generate(prompt, params)[0]
    assert snap.token_ids == full.token_ids == reference(model, prompt, 5)
    assert snap.stats["kv_bytes"] == full.stats["kv_bytes"]
    cache = kvc.CompressedCache(model, kvc.get_method("snapkv", ratio=0.25))
    model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    assert any("kept whole" in note for note in cache.stats()["notes"])
    longer = prompts_of([80])[0]
    assert llm.generate(longer, params, method="snapkv:ratio=0.25:window=8")[0].stats["kr"] < 0.5  # a long one is cut



@pytest.mark.parametrize("params", [SamplingParams(temperature=5e-324), SamplingParams(temperature=1.0, top_p=5e-324),
                                    SamplingParams(temperature=1.0, repetition_penalty=5e-324),
                                    SamplingParams(temperature=1.0, repetition_penalty=3.4028235677973366e38)])
def test_extreme_but_valid_settings_still_draw_a_token(params):
    """Below float32's range these would divide by zero or keep nothing: a tiny temperature is greedy (vLLM's rule),
    top-p always keeps the most likely token, penalized logits stay finite."""
    logits = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 4
    token = sample(logits, params, torch.Generator().manual_seed(0), prompt_ids=[1, 2, 3], output_ids=[4])
    assert 0 <= token < 64
    if params.repetition_penalty == 1:
        assert token == int(logits.argmax())


def test_seeds_and_budgets_beyond_their_integer_range_are_refused():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**70)
    assert SamplingParams(seed=-(2**62)).seed == -(2**62)
    with pytest.raises(ValueError, match="beyond any context"):
        kvc.get_method("snapkv", budget=10**20)


def test_gvote_keeps_a_one_token_prompt_whole():
    llm = make_llm(sharp_model())
    out = llm.generate([5], SamplingParams(max_tokens=3, ignore_eos=True), method="gvote")[0]
    assert out.finish_reason == "length" and out.stats["kr"] > 0.99
