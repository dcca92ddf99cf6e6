"""One request's failure is its own: a method, a codec or the sampler that raises fails that request alone,
frees its slots, and the engine keeps serving the others with the tokens they would have had anyway."""

from dataclasses import dataclass
from typing import ClassVar

import pytest

from kvcompress.engine import SamplingParams
from kvcompress.methods import get_method
from kvcompress.methods import Policy
from kvcompress.methods.decoding import Evict
from kvcompress.methods.fates import Drop
from kvcompress.methods.snapkv import SnapKV
from test_llm import make_llm, prompts_of, reference, sharp_model


@dataclass
class BrokenAtPrefill(Drop):
    """A fate whose prefill edit raises (a method's bug)."""

    name: ClassVar[str] = "broken_prefill"

    def evict(self, policy, view, context, ranking, per_head, budgets):
        raise RuntimeError("a method's bug at the prefill")


@dataclass
class BrokenWhileDecoding(Drop):
    """A fate that raises from its ``fail_at``-th decoding call on."""

    fail_at: int = 3
    name: ClassVar[str] = "broken_decode"

    def decode(self, policy, view, context, col_sums, budgets, slack):
        calls = self.__dict__.setdefault("_calls", [0])
        calls[0] += 1
        if calls[0] >= self.fail_at:
            raise RuntimeError("a method's bug while decoding")
        return None


def _assert_idle(llm):
    assert llm.pool.used_bytes == 0 and not llm.has_unfinished()


@pytest.mark.parametrize("step_tokens", [2048, 16])
def test_a_method_that_raises_at_the_prefill_fails_its_request_alone(step_tokens):
    """Prefilled alone, packed beside the others or chunked (16 tokens a step): the others keep their tokens."""
    model = sharp_model()
    llm = make_llm(model, max_num_batched_tokens=step_tokens)
    prompts = prompts_of([30, 41, 25])
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params, method=[None, Policy(score=SnapKV(window=4), fate=BrokenAtPrefill(), budget=16), None])
    assert outs[1].finish_reason == "error" and "a method's bug at the prefill" in outs[1].error
    for i in (0, 2):
        assert outs[i].finish_reason == "length" and outs[i].token_ids == reference(model, prompts[i], 6)
    _assert_idle(llm)
    assert llm.generate(prompts[0], params)[0].token_ids == reference(model, prompts[0], 6)  # and it goes on


def test_a_method_that_raises_in_a_batched_decoding_step_fails_alone_and_the_others_keep_their_tokens():
    model = sharp_model()
    llm = make_llm(model)
    prompts = prompts_of([30, 41, 25, 50], seed=3)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    snap = get_method("snapkv", budget=16, window=4)
    methods = [None, Policy(score=SnapKV(window=4), fate=BrokenWhileDecoding(fail_at=3), decoding=Evict(), budget=16), snap, None]
    outs = llm.generate(prompts, params, method=methods)
    assert outs[1].finish_reason == "error" and "while decoding" in outs[1].error
    assert outs[0].token_ids == reference(model, prompts[0], 8)
    assert outs[3].token_ids == reference(model, prompts[3], 8)
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == 8
    _assert_idle(llm)


def test_a_sampling_failure_fails_its_request_alone(monkeypatch):
    import kvcompress.engine.llm as engine

    model = sharp_model()
    llm = make_llm(model)
    real = engine.sample

    def flaky(logits, params, generator, prompt_ids=(), output_ids=()):
        if params.seed == 13 and len(output_ids) == 2:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params, generator, prompt_ids, output_ids)

    monkeypatch.setattr(engine, "sample", flaky)
    prompts = prompts_of([20, 20])
    a = llm.add_request(prompts[0], SamplingParams(max_tokens=5, seed=13, temperature=0.7, ignore_eos=True))  # drawn by sample
    b = llm.add_request(prompts[1], SamplingParams(max_tokens=5, seed=14, ignore_eos=True))  # greedy: drawn with the step's rows
    while llm.has_unfinished():
        llm.step()
    failed, fine = llm.output(a), llm.output(b)
    assert failed.finish_reason == "error" and "probability tensor" in failed.error and len(failed.token_ids) == 2
    assert fine.finish_reason == "length" and fine.token_ids == reference(model, prompts[1], 5)
    _assert_idle(llm)


def test_nan_logits_fail_the_request_instead_of_drawing_garbage(monkeypatch):
    model = sharp_model()
    llm = make_llm(model)
    real = llm.runner.step

    def broken(requests, pieces):
        logits, finals = real(requests, pieces)
        return logits * float("nan"), [None if row is None else row * float("nan") for row in finals]

    monkeypatch.setattr(llm.runner, "step", broken)
    out = llm.generate(prompts_of([12])[0], SamplingParams(max_tokens=3))[0]
    assert out.finish_reason == "error" and "NaN" in out.error
    _assert_idle(llm)


@pytest.mark.parametrize("field,value", [("temperature", float("nan")), ("temperature", float("inf")), ("top_p", float("nan")),
                                         ("top_p", 0.0), ("presence_penalty", float("-inf")), ("frequency_penalty", 2.5),
                                         ("repetition_penalty", 0.0), ("top_k", -2), ("top_k", 1.5), ("n", 0), ("logprobs", 21),
                                         ("logprobs", True), ("max_tokens", "8"), ("seed", 1.0), ("stop", 5), ("stop", [""]),
                                         ("ignore_eos", "yes"), ("temperature", "0")])
def test_sampling_params_refuse_wrong_types_and_non_finite_numbers_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
