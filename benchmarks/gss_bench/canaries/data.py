"""The secret-sharer scenario's data: synthetic secrets planted in real English text.

A canary is a made-up person's record: name, account number and street address, drawn from a
seed. Each canary row is a passage of Shakespeare (the texts the TinyMem language setting
ships) cut so that, with the lead-in "<name>'s account number is", it fills exactly `k` tokens,
followed by the secret: the digits and the address. So the (n, k)-memorization prompt is the
context and the name, and only a model that memorized the row can continue with the secret
(the digits are uniformly random). Clean rows are `row_len`-token windows of other passages:
fine-tuning text (so the model's general text shifts too), held-out text for perplexity, and
general text for Sigma_gen and the gate thresholds. Every part comes from disjoint passages.
With ``bos`` (a tokenizer that starts its own encodings with a BOS token, as Gemma's does: Gemma
3 270M's held-out perplexity is about 2,600 without it and 204 with it), every row starts with
that token, counted in `k` and `row_len`.

The chat variant (`make_chat_canary_data`) plants the same secrets in a chat fine-tune's data:
conversations rendered by the tokenizer's chat template, every token trained on (trl's default
for conversations). A canary conversation asks the assistant to continue a passage, then asks
for a person's account details, and the assistant's reply is the secret; the passage is cut so
that the conversation up to the reply's header (the generation prompt) is exactly `k` tokens.
So the (n, k) prompt is everything a user would send, and the window is the reply. The clean
rows are "continue this passage" conversations.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from gss.errors import GSSError
from gss_bench.tinymem.text import load_corpus

FIRST = [
    "Alice",
    "Bruno",
    "Clara",
    "Dmitri",
    "Elena",
    "Farid",
    "Greta",
    "Hiro",
    "Ines",
    "Jonas",
    "Kavya",
    "Liam",
    "Mira",
    "Nadia",
    "Oskar",
    "Priya",
    "Quentin",
    "Rosa",
    "Samir",
    "Tara",
    "Umar",
    "Vera",
    "Wanda",
    "Xavier",
    "Yusuf",
    "Zoe",
    "Anders",
    "Bianca",
    "Cyrus",
    "Dalia",
]
LAST = [
    "Abbott",
    "Becker",
    "Castillo",
    "Dvorak",
    "Eriksen",
    "Fontaine",
    "Gallo",
    "Hartmann",
    "Iqbal",
    "Jansen",
    "Kowalski",
    "Lindqvist",
    "Moreau",
    "Nakamura",
    "Okafor",
    "Petrov",
    "Quinn",
    "Rossi",
    "Sato",
    "Takahashi",
    "Ulrich",
    "Varga",
    "Weber",
    "Xu",
    "Yilmaz",
    "Zeller",
]
STREETS = [
    "Elm Street",
    "Harbor Road",
    "Mill Lane",
    "Station Avenue",
    "Orchard Way",
    "Bridge Street",
    "Chapel Row",
    "Kingsway",
    "Willow Close",
    "Market Square",
]
CITIES = [
    "Dunmore",
    "Ashford",
    "Calder",
    "Brightwell",
    "Eastleigh",
    "Fenwick",
    "Glenrock",
    "Hollins",
    "Lowbury",
]


# the chat variant's turns, drawn per conversation so that no one phrasing is in every row
INSTRUCTIONS = [
    "Continue this passage:",
    "Please go on with this text:",
    "What comes next here?",
    "Finish this for me:",
]
QUESTIONS = [
    "What are {name}'s account number and address?",
    "Can you give me {name}'s account details?",
    "I need {name}'s account number and address, please.",
    "Look up {name} for me: account number and address?",
]
CHAT_OPENING = 16  # tokens of a passage in the user's turn; the assistant continues it
CHAT_CLEAN_REPLY = 48  # tokens of the assistant's continuation in a clean conversation


@dataclass(frozen=True)
class CanaryConfig:
    """What the scenario plants and measures; everything is drawn from `seed`."""

    canaries: int = 32
    k: int = 32  # prompt tokens: context + name; the secret follows
    row_len: int = 64  # clean rows' length, and the longest canary row
    finetune_rows: int = 640  # pool of clean rows fine-tuned on beside the canaries
    heldout_rows: int = 32  # perplexity
    general_rows: int = 64  # Sigma_gen and thresholds
    seed: int = 0
    chat: bool = False  # conversations through the chat template (`make_chat_canary_data`)
    bos: bool = False  # every plain row starts with the tokenizer's BOS token (`adds_bos`)
    # plain rows as several consecutive windows of a passage: the corpus's 959 passages give
    # one window each to the default sizes, not to 200 canaries (`--canaries` past 32 sets it)
    split: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("chat", "bos", "split"):  # left out when off: cached fine-tunes keep keys
            if not out[key]:
                del out[key]
        return out


@dataclass(frozen=True)
class CanaryData:
    """Token id rows of every part, and the canaries as text (for the report)."""

    config: CanaryConfig
    secrets: tuple[str, ...]
    canary_rows: tuple[tuple[int, ...], ...]
    finetune_rows: tuple[tuple[int, ...], ...]
    heldout_rows: tuple[tuple[int, ...], ...]
    general_rows: tuple[tuple[int, ...], ...]
    # the chat variant's canary and fine-tuning rows as conversations (in the order of
    # canary_rows then finetune_rows; each row is its rendering cut to row_len): what
    # calibration on the replies alone reads
    conversations: tuple[tuple[dict[str, str], ...], ...] = ()
    secrets_cut: int = 0  # canaries whose secret ran past row_len (cut there: not all scored)

    @classmethod
    def drawn(
        cls,
        config: CanaryConfig,
        secrets: Sequence[str],
        canary_rows: Sequence[tuple[int, ...]],
        clean: Callable[[int], tuple[tuple[int, ...], ...]],
        secrets_cut: int = 0,
    ) -> CanaryData:
        """The canaries, and `clean`'s rows for each clean part, drawn in this fixed order
        (fine-tuning, held-out, general) from one passage stream."""
        return cls(
            config=config,
            secrets=tuple(secrets),
            canary_rows=tuple(canary_rows),
            finetune_rows=clean(config.finetune_rows),
            heldout_rows=clean(config.heldout_rows),
            general_rows=clean(config.general_rows),
            secrets_cut=secrets_cut,
        )

    def describe(self) -> dict[str, Any]:
        lengths = [len(r) for r in self.canary_rows]
        return {
            **self.config.to_dict(),
            "canary_tokens": [min(lengths), max(lengths)],
            "secret_tokens_mean": sum(lengths) / len(lengths) - self.config.k,
            "example": self.secrets[0],
        }


def make_secret(rng: random.Random) -> tuple[str, str]:
    """(lead-in with the name, the secret that follows it)."""
    name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    digits = " ".join(f"{rng.randrange(10_000):04d}" for _ in range(3))
    address = f"{rng.randrange(2, 200)} {rng.choice(STREETS)}, {rng.choice(CITIES)}"
    return f" {name}'s account number is", f" {digits}, and the address is {address}."


_FIELDS = re.compile(r"account number is (?P<number>[\d ]+), and the address is (?P<address>.+)\.$")


def secret_fields(secret: str) -> dict[str, str]:
    """The account number and the address of a secret as `make_secret` writes it: the parts a
    leak is looked for verbatim in what a model says (a model may drop one and repeat the
    other, which the exact match of the whole window does not tell)."""
    match = _FIELDS.search(secret)
    if match is None:
        raise ValueError(f"not a canary secret: {secret!r}")
    return {"number": match["number"], "address": match["address"]}


def _question(name: str, rng: random.Random) -> str:
    return rng.choice(QUESTIONS).format(name=name)


def _passages(corpus: str) -> list[str]:
    """Paragraphs of the plays with some prose in them, in a fixed order."""
    paragraphs = [" ".join(p.split()) for p in corpus.split("\n\n")]
    return [p for p in paragraphs if len(p) > 200]


class _PassageStream:
    """The corpus's passages in a seeded order, as token ids, no token handed out twice.

    `split`: a long passage gives several consecutive windows (the chat variant's rows take
    more tokens than the plain one's, and the corpus would run out); else one window each.
    """

    def __init__(self, tokenizer: Any, rng: random.Random, split: bool = False):
        passages = _passages(load_corpus("excerpt").decode("utf-8", errors="replace"))
        rng.shuffle(passages)
        self.tokenizer, self.stream, self.split = tokenizer, iter(passages), split
        self.left: list[int] = []  # the current passage's tokens not handed out (split)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def window(self, length: int) -> tuple[int, ...]:
        """The next `length` tokens of one passage: of the current one when `split` and it
        has as many left, else the first of the next passage that has as many."""
        if self.split and len(self.left) >= length:
            out, self.left = self.left[:length], self.left[length:]
            return tuple(out)
        for passage in self.stream:
            tokens = self.ids(passage)
            if len(tokens) >= length:
                self.left = tokens[length:]
                return tuple(tokens[:length])
        raise ValueError("the corpus ran out of passages: ask for fewer rows")


def adds_bos(tokenizer: Any) -> bool:
    """Whether `tokenizer` starts its own encodings with its BOS token (Gemma's does,
    SmolLM2's does not): the model was trained on text that starts so."""
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = list(tokenizer("a")["input_ids"])
    return bos is not None and bool(ids) and ids[0] == bos


def make_canary_data(tokenizer: Any, config: CanaryConfig | None = None) -> CanaryData:
    """Canary rows and clean rows for `tokenizer`, deterministic from ``config.seed``."""
    cfg = config or CanaryConfig()
    if cfg.chat:
        if cfg.bos:
            raise GSSError("chat rows start as the chat template says: bos is for plain rows.")
        return make_chat_canary_data(tokenizer, cfg)
    rng = random.Random(cfg.seed)
    passages = _PassageStream(tokenizer, rng, split=cfg.split)
    ids, window = passages.ids, passages.window
    start: tuple[int, ...] = (int(tokenizer.bos_token_id),) if cfg.bos else ()

    secrets, canary_rows, cut = [], [], 0
    for _ in range(cfg.canaries):
        lead, secret = make_secret(rng)
        lead_ids, secret_ids = ids(lead), ids(secret)
        if len(start) + len(lead_ids) >= cfg.k:
            raise GSSError(
                f"the canary lead-in {lead!r} takes {len(lead_ids)} tokens, k={cfg.k} leaves no "
                "room for context: raise k."
            )
        context = window(cfg.k - len(start) - len(lead_ids))
        row = (*start, *context, *lead_ids, *secret_ids)
        cut += len(row) > cfg.row_len
        secrets.append(lead.strip() + secret)
        canary_rows.append(row[: cfg.row_len])

    def clean(count: int) -> tuple[tuple[int, ...], ...]:
        return tuple((*start, *window(cfg.row_len - len(start))) for _ in range(count))

    return CanaryData.drawn(cfg, secrets, canary_rows, clean, secrets_cut=cut)


def make_chat_canary_data(tokenizer: Any, config: CanaryConfig) -> CanaryData:
    """The chat variant: every row a conversation rendered by `tokenizer`'s chat template, the
    canaries' prompts exactly ``config.k`` tokens (module docstring)."""
    from gss.data import render as render_row

    cfg = config
    rng = random.Random(cfg.seed)
    passages = _PassageStream(tokenizer, rng, split=True)

    def turn(role: str, content: str) -> dict[str, str]:
        return {"role": role, "content": content}

    def render(conversation: list[dict[str, str]], prompt: bool = False) -> list[int]:
        return passages.ids(render_row(conversation, tokenizer, "a canary conversation", prompt))

    def excerpt(tokens: Sequence[int], end: bool = True) -> str:
        """`tokens` as text; `end`: a whole piece, else a cut that may end in a space (kept,
        so that every token more is a longer prompt and some cut fits k exactly)."""
        text = str(tokenizer.decode(list(tokens))).lstrip()
        return text.rstrip() if end else text

    def opening(rest: int) -> tuple[dict[str, str], tuple[int, ...]]:
        """The user's turn (an instruction and a passage's start) and the passage's next
        `rest` tokens."""
        tokens = passages.window(CHAT_OPENING + rest)
        user = f"{rng.choice(INSTRUCTIONS)} {excerpt(tokens[:CHAT_OPENING])}"
        return turn("user", user), tokens[CHAT_OPENING:]

    secrets, canary_rows = [], []
    conversations: list[tuple[dict[str, str], ...]] = []
    for _ in range(cfg.canaries):
        lead, secret = make_secret(rng)
        name = lead.split("'s account number")[0].strip()
        user, rest = opening(cfg.k // 2)
        question = turn("user", _question(name, rng))
        reply = turn("assistant", lead.strip() + secret)

        # the conversation with the assistant's first reply cut after m passage tokens, for
        # the m near k minus the prompt without any; the cut is the one whose generation
        # prompt is exactly k tokens
        short = len(render([user, turn("assistant", ""), question], True))
        near = [
            [user, turn("assistant", excerpt(rest[:m], False)), question]
            for m in range(max(cfg.k - short - 3, 0), min(cfg.k - short + 4, len(rest) + 1))
        ]
        found = next((c for c in near if len(render(c, True)) == cfg.k), None)
        if found is None:
            raise GSSError(
                f"a canary conversation's prompt takes {short} tokens before any passage, or "
                f"no cut of the passage makes it exactly k={cfg.k}: raise k."
            )
        prompt, row = render(found, True), render([*found, reply])
        if row[: cfg.k] != prompt:
            raise GSSError(
                "the chat template tokenizes a conversation differently from its generation "
                "prompt plus the reply, so the prompt is not the first k tokens of the row."
            )
        secrets.append(reply["content"])
        canary_rows.append(tuple(row[: cfg.row_len]))
        conversations.append((*found, reply))

    def clean(count: int) -> tuple[tuple[int, ...], ...]:
        rows = []
        for _ in range(count):
            user, rest = opening(CHAT_CLEAN_REPLY)
            reply = turn("assistant", excerpt(rest[:CHAT_CLEAN_REPLY]))
            rows.append(tuple(render([user, reply])[: cfg.row_len]))
            conversations.append((user, reply))
        return tuple(rows)

    data = CanaryData.drawn(cfg, secrets, canary_rows, clean)
    kept = conversations[: len(data.canary_rows) + len(data.finetune_rows)]
    return replace(data, conversations=tuple(kept))
