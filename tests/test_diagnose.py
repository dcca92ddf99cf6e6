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
    methods += [get_method("quest", ratio=0.1, page_size=4), get_method("omnikv", ratio=0.1)]
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


def test_selection_is_measured_as_it_decodes(rows):
    """A chunk of tokens reads everything; Quest and OmniKV are decoded token by token, so reading a
    tenth shows an error (at ratio 1.0 they read everything: exactly 0, checked above)."""
    for name in ("quest", "omnikv"):
        row = next(r for r in rows if r["method"].startswith(name) and r["ratio"] == 0.1)
        assert row["rel_error"] > 0.01 and row["kl"] > 1e-4, name
        assert row["cr"] < 0.5, name


def test_rows_follow_the_schema(rows):
    for row in rows:
        assert {"method", "budget", "ratio", "kr", "rel_error_per_layer", "rel_error", "kl", "ppl_ratio", "rel_error_at_merge"} <= set(row)
    assert rows[0]["method"] == "full" and rows[0]["rel_error_at_merge"] == 0.0


def test_short_text_is_refused(embedded):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match="give a longer --text"):
        diagnose(model, tokenizer, [], text="only a few words", context_tokens=100, continuation_tokens=8, progress=False)
