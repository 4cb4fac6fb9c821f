"""The statistics of ``clusterformer longctx``'s summary: Wilson intervals, the exact McNemar test
and the paired counts against dense, on hand-built records (no model needed)."""

from __future__ import annotations

import math

import pytest

from clusterformer.apps.longctx import markdown, mcnemar_exact_p, summarize, wilson_interval


@pytest.mark.parametrize(("correct", "n", "expected"), [
    (0, 10, (0.0, 0.2775)), (10, 10, (0.7225, 1.0)), (2, 10, (0.0567, 0.5098)), (9, 10, (0.5958, 0.9821))])
def test_wilson_interval_matches_published_values(correct, n, expected):
    """95% Wilson score intervals as tabulated (e.g. Newcombe 1998: 0/10 -> 0-0.2775)."""
    lo, hi = wilson_interval(correct, n)
    assert lo == pytest.approx(expected[0], abs=1e-4) and hi == pytest.approx(expected[1], abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize(("correct", "n"), [(14, 30), (28, 30), (1, 30), (7, 9)])
def test_wilson_interval_is_the_score_tests_acceptance_region(correct, n):
    """The interval's ends are the roots of (p - k/n)^2 = z^2 p (1 - p) / n, solved as a quadratic in p."""
    z, observed = 1.959964, correct / n
    a, b, c = 1 + z * z / n, -(2 * observed + z * z / n), observed * observed
    root = math.sqrt(b * b - 4 * a * c)
    assert wilson_interval(correct, n) == pytest.approx(((-b - root) / (2 * a), (-b + root) / (2 * a)), abs=1e-12)


@pytest.mark.parametrize(("lost", "gained", "p"), [
    (0, 0, 1.0), (5, 0, 2 / 32), (0, 5, 2 / 32), (3, 1, 2 * 5 / 16), (2, 2, 1.0), (10, 0, 2 / 1024)])
def test_mcnemar_exact_p_is_a_two_sided_sign_test_on_the_discordant_pairs(lost, gained, p):
    assert mcnemar_exact_p(lost, gained) == pytest.approx(p, rel=1e-12)


def _record(scores: dict[str, float]) -> dict:
    return {"methods": {m: {"score": v, "s_per_token": 0.1} for m, v in scores.items()}}


def test_summary_pairs_each_method_with_dense_sample_by_sample():
    """Four samples: dense exact on 0-2; the method exact on 0 and 3, half right on 1 (two answers, one found: not
    exact). So it kept 1 of dense's 3, gained 1, lost 2 (p = 1.0); a sample only dense ran is not paired."""
    samples = {
        "niah/2048/0": _record({"dense": 1.0, "m": 1.0}),
        "niah/2048/1": _record({"dense": 1.0, "m": 0.5}),
        "niah/2048/2": _record({"dense": 1.0, "m": 0.0}),
        "niah/2048/3": _record({"dense": 0.0, "m": 1.0}),
        "niah/2048/4": _record({"dense": 1.0}),
    }
    row = summarize({"samples": samples})["accuracy"]["niah"]["2048"]
    assert row["dense"]["correct"] == 4 and row["dense"]["n"] == 5 and "kept" not in row["dense"]
    m = row["m"]
    assert (m["correct"], m["n"], m["mean"]) == (2, 4, pytest.approx(2.5 / 4))
    assert (m["dense_correct"], m["kept"], m["gained"]) == (3, 1, 1)
    assert m["mcnemar_p"] == pytest.approx(1.0)
    assert m["wilson"] == pytest.approx(wilson_interval(2, 4))
    table = markdown(summarize({"samples": samples}), ["dense", "m"])
    assert "| niah | 2048 | 4/5 (" in table and "; 1 of 3 +1 (p 1)" in table
