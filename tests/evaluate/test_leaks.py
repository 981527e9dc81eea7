"""secrets_said: which strings a model says after their prompts, from a lookup-table LM."""

import pytest

from gss.errors import GSSError
from gss.evaluate.leaks import secrets_said

from ..helpers import WORDS, word_tokenizer


def _ids(words: str) -> list[int]:
    return [WORDS.index(w) for w in words.split()]


def test_each_secret_is_looked_for_in_its_prompts_continuation(table_lm):
    tok = word_tokenizer()
    # after "w1 w2" the model says "w5 w6 w7" then EOS (and w9 after it, never read); after
    # "w3 w4" it says "w8 w8 w8"
    paths = [_ids("w1 w2 w5 w6 w7 <eos> w9"), _ids("w3 w4 w8 w8 w8 w8 w8 w8")]
    model = table_lm(paths, len(WORDS), default=WORDS.index("w8"))
    prompts = [_ids("w1 w2"), _ids("w3 w4")]
    secrets = [["w6 w7", "w9", "w5 w7"], ["w8 w8"]]
    report = secrets_said(model, tok, prompts, secrets, max_new_tokens=5, batch_size=1)
    assert report.continuations == ("w5 w6 w7", "w8 w8 w8 w8 w8")
    w = {name: WORDS.index(name) for name in ("w5", "w6", "w7", "w8")}
    assert report.continuation_ids == ((w["w5"], w["w6"], w["w7"]), (w["w8"],) * 5)
    # "w8 w8 w8 w8 w8" holds two 4-grams, the second a repeat; "w5 w6 w7" has none
    assert report.repetition == 50.0 and report.to_dict()["repetition"] == 50.0
    # w9 comes after EOS; "w5 w7" is not verbatim
    assert report.said == ((True, False, False), (True,))
    assert report.secrets_leaked == pytest.approx(50.0)
    assert report.prompts_leaking == pytest.approx(100.0)
    assert report.to_dict()["said"] == [[True, False, False], [True]]
    # near-verbatim finds every verbatim one, and "w5 w7" shares only "w5w" (3 of 4 characters)
    assert report.near == report.said and report.to_dict()["near"] == [[True, False, False], [True]]
    # other case and spacing, or most of the secret in one run: near-verbatim, not verbatim
    bypass = secrets_said(model, tok, prompts, [["W6W7", "w5 w6 w7 0"], ["w8"]], max_new_tokens=5)
    assert bypass.said == ((False, False), (True,))
    assert bypass.near == ((True, True), (True,)) and bypass.secrets_leaked_near == 100.0
    assert report.others == (False, False) and report.prompts_saying_others == 0.0
    # prompt 0's continuation says prompt 1's secret ("w6"), not its own; a string both prompts
    # hold ("w8 w8") is each one's own
    swapped = secrets_said(model, tok, prompts, [["w9"], ["w6", "w8 w8"]], max_new_tokens=5)
    assert swapped.said == ((False,), (False, True)) and swapped.others == (True, False)
    assert swapped.prompts_saying_others == 50.0
    both = secrets_said(model, tok, prompts, [["w8 w8"], ["w8 w8"]], max_new_tokens=5)
    assert both.others == (False, False)
    # a prompt without secrets is not counted among the prompts
    none = secrets_said(model, tok, prompts, [[], ["w1"]], max_new_tokens=2)
    assert none.prompts_leaking == 0.0 and none.secrets_leaked == 0.0


def test_secrets_must_be_one_list_of_strings_per_prompt(table_lm):
    tok, model = word_tokenizer(), table_lm([], len(WORDS), default=4)
    with pytest.raises(GSSError, match="2 prompts but 1 lists of secrets"):
        secrets_said(model, tok, [[5], [6]], [["w1"]], max_new_tokens=2)
    with pytest.raises(GSSError, match="secrets of prompt 0 must be a list of non-empty strings"):
        secrets_said(model, tok, [[5]], ["w1 w2"], max_new_tokens=2)
    with pytest.raises(GSSError, match="non-empty strings"):
        secrets_said(model, tok, [[5]], [[""]], max_new_tokens=2)


def test_prompts_the_model_cannot_run_are_refused_before_decoding(make_model):
    model = make_model("gpt2")  # 128 learned positions
    with pytest.raises(
        GSSError,
        match="sequence 0 has 120 tokens, and 10 more to generate make 130, more than the 128",
    ):
        secrets_said(model, word_tokenizer(), [[5] * 120], [["w1"]], max_new_tokens=10)
