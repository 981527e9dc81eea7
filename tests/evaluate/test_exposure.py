"""Exposure of a structured secret (issue 70), on a lookup-table LM whose ranking is known."""

import math

import pytest

from gss.errors import GSSError
from gss.evaluate.exposure import exposure, format_size, same_format

from ..helpers import WORDS, word_tokenizer


def _ids(words: str) -> list[int]:
    return [WORDS.index(w) for w in words.split()]


def test_a_learned_secret_ranks_first_and_an_unknown_one_exposes_nothing(table_lm):
    tok = word_tokenizer()
    model = table_lm([_ids("w1 w2 w5 w6 w7")], len(WORDS), default=WORDS.index("w8"))
    learned = exposure(model, tok, _ids("w1 w2"), "w5 w6 w7", candidates=200, letters=False)
    assert learned.rank == 1 and learned.bits == pytest.approx(math.log2(201))
    assert learned.bits == pytest.approx(learned.ceiling)
    assert learned.space_bits == pytest.approx(math.log2(1000))
    # after a prompt the table does not hold, every string is as likely: rank last, 0 bits
    unknown = exposure(model, tok, _ids("w3 w4"), "w5 w6 w7", candidates=200, letters=False)
    assert unknown.rank == 201 and unknown.bits == pytest.approx(0.0)
    # the table's own continuation of that prompt (w8 w8 w8) is the likeliest there: any
    # secret shaped like it but for one digit ranks below it
    said = exposure(model, tok, _ids("w3 w4"), "w8 w8 w8", candidates=200, letters=False)
    assert said.rank == 1


def test_candidates_keep_the_format_and_never_equal_the_secret():
    made = same_format("SK-live-0042", 50, seed=1)
    assert len(made) == 50 and "SK-live-0042" not in made
    for s in made:
        assert len(s) == 12 and s[2] == "-" and s[7] == "-"
        assert s[:2].isupper() and s[3:7].islower() and s[8:].isdigit()
    assert same_format("ab-12", 5, seed=1, letters=False)[0].startswith("ab-")
    assert format_size("ab-12") == 26**2 * 100 and format_size("ab-12", letters=False) == 100


def test_unstructured_or_too_small_formats_are_refused():
    with pytest.raises(GSSError, match="no digit or letter to vary"):
        same_format("---", 3)
    with pytest.raises(GSSError, match="holds 10 strings, fewer than 10 candidates"):
        same_format("7", 10)
