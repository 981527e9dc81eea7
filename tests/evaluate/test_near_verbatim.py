"""Near-verbatim leaks (issue 70): case and spacing aside, or most of a secret in one run."""

import pytest

from gss.errors import GSSError
from gss.evaluate.near_verbatim import longest_common_run, near_verbatim, normalise


def test_case_and_spacing_do_not_hide_a_secret():
    assert normalise(" SK-LIVE 12\n34 ") == "sk-live1234"
    assert near_verbatim("SK-LIVE-1234", "your key: sk-live-1234.", share=1.0)
    assert near_verbatim("2304 9385 4717", "it is 230493854717", share=1.0)
    assert not near_verbatim("SK-LIVE-1234", "sk_live_1234", share=1.0)  # other characters


def test_most_of_a_secret_in_one_run_counts():
    # 10 of the 12 digits in a row: 83% >= 80%; 9 of 12 (75%) does not
    assert longest_common_run("2304 9385 4717", "number 2304938547 then") == 10
    assert near_verbatim("2304 9385 4717", "number 2304938547 then")
    assert not near_verbatim("2304 9385 4717", "number 230493854 then")
    # runs do not add up: two halves apart are not one leak
    assert not near_verbatim("2304 9385 4717", "230493 and 854717")
    assert longest_common_run("abc", "") == 0


def test_bad_arguments_are_refused():
    with pytest.raises(GSSError, match="share must be in"):
        near_verbatim("a", "a", share=0)
    with pytest.raises(GSSError, match="non-space character"):
        near_verbatim("  ", "a")


def test_token_ids_count_one_shared_run_of_most_of_the_target():
    from gss.evaluate.near_verbatim import near_verbatim_ids

    target = list(range(10))
    assert near_verbatim_ids(target, [99, *range(8), 42])  # 8 of 10 in one run
    assert not near_verbatim_ids(target, [*range(4), 42, *range(5, 9)])  # two runs of 4
    assert near_verbatim_ids(target, target, share=1.0)
    with pytest.raises(GSSError, match="some token"):
        near_verbatim_ids([], [1])
