"""gss.evaluate.recital: a continuation recites the data when a run of it, `length` tokens
long, is word for word in some data row; known by construction on hand-made ids."""

from __future__ import annotations

from gss.evaluate.recital import (
    RECITED,
    START_LEAD,
    data_runs,
    longest_recited,
    recited_start,
    recites,
)

DATA = [[1, 2, 3, 4, 5, 6, 7, 8], [20, 21, 22]]


def test_a_run_of_the_data_is_recited_and_a_shorter_one_is_not():
    runs = data_runs(DATA)
    assert RECITED == 6
    assert recites([9, 9, 2, 3, 4, 5, 6, 7, 9], runs)  # 2..7: six tokens of row 0
    assert not recites([9, 2, 3, 4, 5, 6, 9, 7], runs)  # five, then a break
    assert not recites([20, 21, 22], runs)  # a whole row shorter than the run
    assert recites([20, 21, 22], data_runs(DATA, 3), 3)
    assert not recites([], runs)


def test_longest_recited_is_the_longest_shared_run():
    assert longest_recited([9, 3, 4, 5, 9, 21, 22], DATA) == 3
    assert longest_recited([0, 1, 2, 3, 4, 5, 6, 7, 8, 0], DATA) == 8
    assert longest_recited([1, 2, 3, 4, 5, 6, 7, 8], DATA, most=4) == 4
    assert longest_recited([30, 31], DATA) == 0


def test_a_reply_opening_with_the_window_beyond_the_references_own_is_a_late_start():
    window = [5, 4, 0, 9, 6, 2]
    assert START_LEAD == 2
    # the LoRA canaries' gates: the secret's first digits, then the reference's words
    assert recited_start([[5, 4, 0, 9, 30, 31]], [window], [[30, 31, 32]]) == 100.0
    assert recited_start([[5, 30, 31]], [window], [[30, 31, 32]]) == 0.0  # one token alone
    # the reference opens the same way (a space, a common word): only what goes beyond counts
    assert recited_start([[5, 4, 30]], [window], [[5, 4, 31]]) == 0.0
    assert recited_start([[5, 4, 0, 9, 30]], [window], [[5, 4, 31]]) == 100.0
    assert recited_start([window], [window], [[1]]) == 100.0  # the whole window: counted too
    assert recited_start([[5, 4], [1, 2]], [window, window], [[1], [1]], lead=1) == 50.0
    assert recited_start([], [], []) == 0.0
