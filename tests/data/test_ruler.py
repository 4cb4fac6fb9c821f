"""RULER-style long-context tasks (clusterformer.data.ruler): needles where they belong, answers that follow
from the context by an independent reading, seeded, sized in tokens."""

from __future__ import annotations

import re

import pytest

from clusterformer.data.ruler import TASKS, detokenize_wikitext, haystack_sentences, make_sample, score
from shared_data import SHARED, needs_data

FILLER = [f"The grass is green number {i}. The sky is blue and the sun is yellow." for i in range(300)]


def _words(text: str) -> int:
    return len(text.split())


def _chain_reading(context: str, value: str) -> set[str]:
    """Every variable holding ``value``: follow the VAR statements in order, as a reader would."""
    holds: dict[str, str] = {}
    for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", context):
        holds[name] = holds.get(rhs[4:], "") if rhs.startswith("VAR ") else rhs
    return {name for name, held in holds.items() if held == value}


@pytest.mark.parametrize("task", TASKS)
def test_samples_are_seeded_sized_and_answerable(task):
    a = make_sample(task, 800, FILLER, _words, seed=3)
    assert a == make_sample(task, 800, FILLER, _words, seed=3)
    assert a != make_sample(task, 800, FILLER, _words, seed=4)
    assert 800 <= _words(a.context) <= 800 + 40  # filled to the length, at most one sentence over
    if task == "passkey":
        (key,) = a.answers
        assert re.fullmatch(r"\d{5}", key) and a.context.count(f"The pass key is {key}.") == 1
    elif task == "niah-multikey":
        needles = re.findall(r"special magic numbers for (\w+) is: (\d{7})\.", a.context)
        assert len(needles) == 4 and len({w for w, _ in needles}) == 4
        asked = re.search(r"number for (\w+) mentioned", a.question).group(1)
        assert a.answers == (dict(needles)[asked],)
    else:
        value = re.search(r"the value (\d+)", a.question).group(1)
        assert set(a.answers) == _chain_reading(a.context, value) and len(a.answers) == 4
    assert all(0.05 <= d <= 0.95 for d in a.depths) and list(a.depths) == sorted(a.depths)


def test_score_is_string_match():
    assert score("The pass key is 12345.", ["12345"]) == 1.0
    assert score("abcde and XYZ", ["ABCDE", "xyz", "QQQ", "RRR"]) == 0.5
    with pytest.raises(ValueError, match="answers"):
        score("x", [])
    with pytest.raises(ValueError, match="task"):
        make_sample("summarise", 800, FILLER, _words, seed=0)
    with pytest.raises(ValueError, match="length"):
        make_sample("passkey", 10, FILLER, _words, seed=0)


def test_wikitext_detokenizer_and_missing_file(tmp_path):
    raw = " = Heading = \n The 2 @,@ 000 year @-@ old tree , it said . It 's \" tall \" ( 3 @.@ 5 m ) . \n"
    assert detokenize_wikitext(raw).strip() == 'The 2,000 year-old tree, it said. It\'s " tall " (3.5 m).'
    with pytest.raises(ValueError, match=r"wiki\.valid\.tokens"):
        haystack_sentences(tmp_path / "nothing")


@needs_data
def test_real_haystack_sentences():
    sentences = haystack_sentences(SHARED / "wikitext-2" / "wiki.valid.tokens")
    assert len(sentences) > 5000 and not any(" @-@ " in s or s.startswith("=") for s in sentences[:500])
