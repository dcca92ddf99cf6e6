"""diagnose: exact zeros where nothing is lost, errors that fall as the budget grows."""

import pytest

from kvcompress import available_methods, get_method
from kvcompress.diagnose import diagnose
from kvcompress.methods import REGISTRY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rows(embedded):
    model, tokenizer = embedded
    methods = [get_method(name, ratio=1.0) for name in available_methods() if REGISTRY[name].needs_budget]
    methods += [get_method("snapkv", budget=b) for b in (32, 96, 256)]
    return diagnose(model, tokenizer, methods, context_tokens=384, continuation_tokens=24, progress=False)


def test_full_and_ratio_one_have_exactly_zero_error(rows):
    for row in rows:
        if row["method"] == "full" or row["ratio"] == 1.0:
            assert row["rel_error"] == 0.0 and set(row["rel_error_per_layer"]) == {0.0}, row["method"]
            assert row["kl"] == pytest.approx(0.0, abs=1e-6) and row["ppl_ratio"] == pytest.approx(1.0, abs=1e-5)


def test_snapkv_error_falls_as_budget_grows(rows):
    snap = sorted((r for r in rows if r["method"] == "snapkv" and r["budget"]), key=lambda r: r["budget"])
    errors = [r["rel_error"] for r in snap]
    assert errors[0] > errors[1] > errors[2] > 0
    assert snap[0]["kl"] > snap[2]["kl"]
    assert len(snap[0]["rel_error_per_layer"]) == 30


def test_rows_follow_the_schema(rows):
    for row in rows:
        assert {"method", "budget", "ratio", "kr", "rel_error_per_layer", "rel_error", "kl", "ppl_ratio", "rel_error_at_merge"} <= set(row)
    assert rows[0]["method"] == "full" and rows[0]["rel_error_at_merge"] == 0.0


def test_short_text_is_refused(embedded):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match="give a longer --text"):
        diagnose(model, tokenizer, [], text="only a few words", context_tokens=100, continuation_tokens=8, progress=False)
