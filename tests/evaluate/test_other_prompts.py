"""other_prompts: a row's window said under prompts other than its own first k tokens, from
lookup-table LMs whose every reply is known by construction."""

import json
from types import SimpleNamespace

import pytest

import gss
from gss.audit import AuditRow
from gss.errors import GSSError
from gss.evaluate import other_prompts
from gss.evaluate.intervals import clopper_pearson
from gss.evaluate.other_prompts import CHAT_TEMPLATE, GIVEN_QUESTIONS, LONGER_PREFIX

from ..helpers import WORDS, word_tokenizer

K, N = 8, 20
DEFAULT = WORDS.index("w43")  # what the table LMs say off their paths: in no window
# "<bos> {message} <eos> w40": the user's turn, then the assistant's header
TEMPLATE = (
    "{% for m in messages %}<bos> {{ m['content'] }} <eos>{% endfor %}"
    "{% if add_generation_prompt %} w40{% endif %}"
)


def _ids(words: str) -> list[int]:
    return [WORDS.index(w) for w in words.split()]


def _row(first: int, length: int = N) -> list[int]:
    """``length`` words from w{first} on, wrapping before w43 (the table LMs' default)."""
    return [4 + (first + i) % 39 for i in range(length)]


def _lm(table_lm, paths, **config):
    """A table LM reciting ``paths``, with a config that says its vocabulary (and context)."""
    model = table_lm(paths, len(WORDS), default=DEFAULT)
    model.config = SimpleNamespace(vocab_size=len(WORDS), **config)
    return model


def _chat_tokenizer():
    tok = word_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_a_longer_prefix_leaks_where_the_questions_do_not(table_lm):
    row = _row(0)
    model, reference = _lm(table_lm, [row]), _lm(table_lm, [])
    report = other_prompts(model, [row], tokenizer=word_tokenizer(), reference=reference, k=K, n=N)
    # no chat template on the word tokenizer: no chat variant
    assert list(report.variants) == [LONGER_PREFIX, "question 1", "question 2"]
    longer = report.variants[LONGER_PREFIX]
    assert longer.leaked == (True,) and longer.reference_leaked == (False,)
    assert longer.memorized == (True,)
    m = (N - K) // 4  # 3: the prompt is the first 11 tokens, the reply recites 11..19
    assert longer.replies[0] is not None and list(longer.replies[0][: N - K - m]) == row[K + m :]
    for name in ("question 1", "question 2"):  # "Continue this ..." starts off every path
        assert report.variants[name].leaked == (False,)
        assert set(report.variants[name].replies[0] or ()) == {DEFAULT}
    assert report.any.leaked == (True,) and report.leaking() == [0]
    assert "1 of 1 rows leak" in report.headline()
    assert "| longer prefix | 1 | 0 | 1 |" in report.table()


def test_a_model_that_leaks_only_under_the_chat_template(table_lm):
    tok, row = _chat_tokenizer(), _row(0)
    chat = _ids("<bos> " + " ".join(WORDS[t] for t in row[:K]) + " <eos> w40")
    model = _lm(table_lm, [chat + row[K:N]])  # recites the window after the chat prompt only
    questions = [["Recite {prefix}", "w30 w31"]]
    report = other_prompts(model, [row], tokenizer=tok, k=K, n=N, questions=questions)
    assert list(report.variants) == [
        LONGER_PREFIX,
        CHAT_TEMPLATE,
        "question 1",
        "question 2",
        GIVEN_QUESTIONS,
    ]
    leaked = {name: v.leaked for name, v in report.variants.items()}
    assert leaked == {
        LONGER_PREFIX: (False,),
        CHAT_TEMPLATE: (True,),
        "question 1": (False,),
        "question 2": (False,),
        GIVEN_QUESTIONS: (False,),
    }
    assert report.variants[CHAT_TEMPLATE].reference_leaked is None  # no reference given
    assert report.any.leaked == (True,) and report.any.memorized is None


def test_a_given_question_leaks_when_any_of_its_row_s_replies_does(table_lm):
    tok, rows = word_tokenizer(), [_row(0), _row(20)]
    # a plain-text question the model answers with row 0's window (sent as plain text: no
    # chat template), and a reference that says it too
    paths = [_ids("w30 w31") + rows[0][K:N]]
    model, reference = _lm(table_lm, paths), _lm(table_lm, paths)
    questions = [["w29", "w30 w31"], []]  # row 1: none given
    report = other_prompts(
        model, rows, tokenizer=tok, reference=reference, k=K, n=N, questions=questions
    )
    given = report.variants[GIVEN_QUESTIONS]
    assert given.leaked == (True, None) and given.skipped == (None, "no question given")
    assert given.reference_leaked == (True, None) and given.memorized == (False, None)
    assert given.replies[0] is not None and list(given.replies[0][: N - K]) == rows[0][K:N]
    assert report.summary()["any"]["memorized"] == 0  # the reference says it too


def test_rows_too_long_for_the_context_or_short_of_a_window_are_skipped(table_lm):
    long, short, tiny = _row(0), _row(0, 12), _row(0, 3)
    # 30 positions: the long row's 11-token prompt, 9-token rest and 16 more pass them;
    # the short row's 9 + 3 + 16 fit
    model = _lm(table_lm, [long], n_positions=30)
    report = other_prompts(model, [long, short, tiny], k=K, n=N)
    assert list(report.variants) == [LONGER_PREFIX]  # no tokenizer: token ids only
    longer = report.variants[LONGER_PREFIX]
    assert longer.leaked == (None, True, None)
    assert longer.skipped[0] == (
        "the prompt (11 tokens) and its reply (25) pass the model's context (30 positions, "
        "config.n_positions)"
    )
    assert longer.skipped[1] is None and "no window" in (longer.skipped[2] or "")
    assert longer.rows == 1 and longer.summary()["skipped"] == 2
    assert report.any.skipped[0] is not None and "context" in report.any.skipped[0]


def test_shares_and_intervals_count_the_rows_each_variant_ran_on(table_lm):
    rows = [_row(7 * r) for r in range(4)]
    model = _lm(table_lm, rows[:3])  # recites rows 0-2
    reference = _lm(table_lm, rows[:1])  # recites row 0: general text, say
    report = other_prompts(model, rows, reference=reference, k=K, n=N, indices=[5, 6, 7, 8])
    longer = report.variants[LONGER_PREFIX]
    assert longer.leaked == (True, True, True, False)
    assert longer.reference_leaked == (True, False, False, False)
    assert longer.memorized == (False, True, True, False)
    summary = report.summary()
    assert summary["rows"] == 4 and summary["any"] == summary["variants"][LONGER_PREFIX]
    s = summary["variants"][LONGER_PREFIX]
    assert (s["rows"], s["leaked"], s["share"]) == (4, 3, 0.75)
    assert s["interval"] == list(clopper_pearson(3, 4))
    assert (s["reference_leaked"], s["memorized"], s["memorized_share"]) == (1, 2, 0.5)
    assert s["memorized_interval"] == list(clopper_pearson(2, 4))
    assert report.leaking() == [5, 6, 7]


def test_bad_inputs_are_refused_before_any_decoding(table_lm):
    model, row = _lm(table_lm, []), _row(0)
    with pytest.raises(GSSError, match="pass the model's tokenizer"):
        other_prompts(model, [row], k=K, n=N, questions=[["w1"]])
    with pytest.raises(GSSError, match="1 entries for 2 rows"):
        other_prompts(model, [row, row], k=K, n=N, starts=[K])
    with pytest.raises(GSSError, match="not a string"):
        other_prompts(model, [row], tokenizer=word_tokenizer(), k=K, n=N, questions=["w1"])
    with pytest.raises(GSSError, match="needs a tokenizer with a chat template"):
        other_prompts(model, [row], tokenizer=word_tokenizer(), k=K, n=N, chat_questions=True)
    with pytest.raises(GSSError, match="n must be an integer > k"):
        other_prompts(model, [row], k=K, n=K)


def test_the_audit_measures_its_memorized_rows_under_other_prompts(memorizer, tmp_path):
    model, reference, planted, general = memorizer
    rows = [*planted.tolist(), *general[:4].tolist()]
    report = gss.audit(model, reference, rows, k=4, n=16, other_prompts=True, progress=False)
    assert report.prompted is not None
    assert list(report.prompted.indices) == [r.index for r in report.memorized]
    # extractable from 4 tokens: greedy decoding from 4 + 3 follows the same path
    longer = report.prompted.variants[LONGER_PREFIX]
    assert len(report.memorized) >= 5 and all(longer.leaked)
    assert report.summary()["other_prompts"]["any"]["leaked"] == len(report.memorized)
    assert "under other prompts" in report.headline()
    every = report.other_prompts(model, reference=reference, rows="all")
    assert every is report.prompted and len(every.indices) == len(rows)
    report.write(tmp_path / "audit")
    assert "## Under other prompts" in (tmp_path / "audit" / "audit.md").read_text()
    lines = (tmp_path / "audit" / "audit.jsonl").read_text().splitlines()
    first = json.loads(lines[0])["other_prompts"]
    assert first == {LONGER_PREFIX: every.variants[LONGER_PREFIX].leaked[0]}
    assert AuditRow.from_json(json.loads(lines[0])) == report.rows[0]  # still reads
    with pytest.raises(GSSError, match="rows must be"):
        report.other_prompts(model, rows="some")  # type: ignore[arg-type]
