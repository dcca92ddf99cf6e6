"""Method options are checked against their declared types and ranges; sizes go where they belong."""

import pytest

from kvcompress.methods import REGISTRY, get_method


@pytest.mark.parametrize("spec,size,message", [
    ("momentkv:correction=maybe", {"ratio": 0.5}, "option correction='maybe' must be True or False"),
    ("snapkv:window=abc", {"ratio": 0.5}, "option window='abc' must be a whole number"),
    ("snapkv:window=8.5", {"ratio": 0.5}, "option window=8.5 must be a whole number"),
    ("snapkv:kernel=-3", {"ratio": 0.5}, "kernel .* must be ≥ 1"),
    ("snapkv+pyramid:pyramid_ratio=0.5", {"ratio": 0.5}, "pyramid_ratio .* must be ≥ 1"),
    ("snapkv:pyramid_ratio=2", {"ratio": 0.5}, "snapkv has no option pyramid_ratio; its options are: chunk_size"),
    ("snapkv+pyramid:alpha=2", {"ratio": 0.5}, "the pyramid part has no option alpha; its options are: pyramid_ratio"),
    ("snapkv+threshold:tau=inf", {"ratio": 0.5}, "tau must be a finite number"),
    ("h2o+threshold", {"ratio": 0.5}, "threshold sizing is for policies that compress the prompt once"),
    ("snapkv:ratio=0.5+kivi:budget=8", {}, "gives the policy's size twice"),
    ("cam:similarity_threshold=-3", {"ratio": 0.5}, r"must be in \[-1, 1\]"),
    ("omnikv:filters=(1,'x')", {"ratio": 0.5}, "must be a tuple of whole numbers"),
    ("snapkv:pooling=3", {"ratio": 0.5}, "option pooling=3 must be text"),
    ("snapkv:window=None", {"ratio": 0.5}, "option window cannot be None"),
    ("full", {"ratio": 0.5}, "full takes no size: it keeps every entry"),
    ("kivi", {"budget": 64}, "kivi takes no size"),
    ("gvote", {"ratio": 0.5}, "chooses its own budget"),
])
def test_bad_options_name_the_option_the_value_and_what_is_expected(spec, size, message):
    with pytest.raises(ValueError, match=message):
        get_method(spec, **size)


def test_well_typed_options_are_accepted_and_normalized():
    assert get_method("snapkv", ratio=1).ratio == 1.0 and isinstance(get_method("snapkv", ratio=1).ratio, float)
    assert get_method("omnikv:filters=[1,3]", ratio=0.5).reads.filters == (1, 3)
    assert get_method("keepkv:similarity_threshold=None", ratio=0.5).fate.similarity_threshold is None
    assert get_method("keepkv:window=8", ratio=0.5).score.window == get_method("keepkv:window=8", ratio=0.5).fate.window == 8
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\].*got .0.5."):
        get_method("snapkv", ratio="0.5")  # from Python: a string is not a ratio


def test_every_registered_method_builds_with_its_defaults():
    for name, cls in REGISTRY.items():
        method = get_method(name, **({"ratio": 0.5} if cls.needs_budget else {}))
        assert method.variant == name


def test_a_size_in_the_spec_runs_once_and_clashes_with_a_size_flag():
    from kvcompress.cli import _method
    from kvcompress.eval.runner import EvalSettings, method_grid

    grid = method_grid(EvalSettings(methods=["snapkv:budget=16", "snapkv"], ratios=[0.1, 0.25]))
    assert [m.label for m in grid] == ["full", "snapkv@16", "snapkv@0.1", "snapkv@0.25"]
    assert _method("snapkv:budget=16", default_ratio=0.25).budget == 16
    with pytest.raises(ValueError, match="give the size once"):
        _method("snapkv:budget=16", budget=32)


def test_a_method_list_splits_at_commas_outside_quotes_and_brackets():
    from kvcompress.methods import split_method_list

    text = 'full, deltakv:full_layers=(1,2,16),retention:checkpoint="runs/a,b"+kivi,omnikv:filters=[2,8]'
    assert split_method_list(text) == ["full", "deltakv:full_layers=(1,2,16)", 'retention:checkpoint="runs/a,b"+kivi',
                                       "omnikv:filters=[2,8]"]
    assert get_method(split_method_list(text)[1]).storage.full_layers == (1, 2, 16)


def test_compositions_build_the_parts_they_name_and_labels_say_so():
    policy = get_method("kvzip+adaptive:alpha=0.3+kivi:bits=4", ratio=0.25)
    assert (policy.score.name, policy.sizes.name, policy.sizes.alpha, policy.storage.bits) == ("kvzip", "adaptive", 0.3, 4)
    assert policy.label == "kvzip@0.25+adaptive[alpha=0.3]+kivi[bits=4]" and policy.variant == "kvzip+adaptive[alpha=0.3]+kivi[bits=4]"
    assert get_method("snapkv+adaptive", ratio=0.5).variant == "snapkv+adaptive"  # adakv's parts, written out
    assert get_method("retention+keepkv", budget=8).fate.name == "keepkv"
    assert get_method("recency+evict:slack=4", budget=8).label == "recency@8+evict[slack=4]"  # no preset: parts only
