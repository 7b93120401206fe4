"""A learnable synthetic setting for drafters: a small probabilistic grammar of "diary" documents
with a word-level vocabulary, and the exact log-probability of every document it writes.

A document is `<bos> step S .` followed by clauses in a fixed cycle (the first one random):

    count c c+S c+2S ... .            k numbers, k uniform in {3..6}; c continues from the last
                                      count (mod 100); S (1 or 2) is stated in the header
    on DAY NAME VERB the NOUN .       DAY = the day after the previous `on` clause's day; NAME
                                      uniform; VERB uniform; NOUN ~ the world's preference of VERB
                                      (the favourite with probability FAVOURITE)
    NAME is ADJ and NAME2 is ADJ2 .   NAME = the previous `on` clause's name (uniform when none
                                      came yet), NAME2 uniform; ADJ = the world's adjective of
                                      the name (deterministic)

A `World` (seeded) fixes the clause cycle, the verb -> noun preferences and the name ->
adjective map; a second world (`World(seed=1)`) is the *shifted* distribution a fine-tuned
target moves to (another cycle, other preferences, other adjectives, stride 3 allowed).

Most tokens are determined by the context (numbers continue by the stride, the day follows the
previous day, the adjective follows the name, the clause words follow the cycle), but not by
a verbatim earlier occurrence: a bigram seen before in the document is rarely followed by the
same token again, so n-gram lookup does not solve it, while a model that learned the rules
(the target, and a head reading its features) does. The free choices (the start, each k,
names, verbs, nouns) carry the entropy: `Document.log_prob` is the exact log-probability of the
choices the generator made, so `entropy_per_token` (the mean of -log p over the mean length
of whole documents) is an unbiased Monte-Carlo estimate of the corpus entropy rate, with exact
per-document terms.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

SPECIALS = ("<pad>", "<bos>", "<eos>")
NUMBERS = tuple(str(i) for i in range(100))
DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy",
         "mallory", "oscar")
VERBS = ("reads", "paints", "cooks", "fixes", "buys", "sells", "plays", "writes")
NOUNS = ("book", "wall", "soup", "bike", "car", "house", "piano", "letter", "poem", "fence",
         "cake", "radio", "boat", "song", "map", "lamp")
ADJECTIVES = ("happy", "tired", "brave", "calm", "clever", "quiet", "proud", "kind")
WORDS = ("step", "one", "two", "three", "count", "on", "the", "is", "and", ".")
VOCAB = SPECIALS + NUMBERS + DAYS + NAMES + VERBS + NOUNS + ADJECTIVES + WORDS
PAD, BOS, EOS = 0, 1, 2
CLAUSES = ("count", "on", "is")
STRIDES = {"one": 1, "two": 2, "three": 3}
FAVOURITE = 0.7


@dataclasses.dataclass(frozen=True)
class World:
    """The fixed rules of one corpus distribution (see the module docstring)."""

    seed: int = 0

    @property
    def _rng(self) -> np.random.Generator:
        return np.random.default_rng([1234, self.seed])

    @property
    def cycle(self) -> tuple[str, ...]:
        return CLAUSES if self.seed % 2 == 0 else tuple(reversed(CLAUSES))

    @property
    def strides(self) -> tuple[str, ...]:
        return ("one", "two") if self.seed == 0 else ("two", "three")

    @property
    def favourite_noun(self) -> tuple[int, ...]:
        """The favourite noun index of each verb."""
        return tuple(int(i) for i in self._rng.permutation(len(NOUNS))[: len(VERBS)])

    @property
    def adjective(self) -> tuple[int, ...]:
        """The adjective index of each name."""
        rng = self._rng
        rng.permutation(len(NOUNS))  # the draw favourite_noun uses
        return tuple(int(i) for i in rng.integers(0, len(ADJECTIVES), size=len(NAMES)))

    def noun_probs(self, verb: int) -> np.ndarray:
        p = np.full(len(NOUNS), (1 - FAVOURITE) / (len(NOUNS) - 1))
        p[self.favourite_noun[verb]] = FAVOURITE
        return p


@dataclasses.dataclass(frozen=True)
class Document:
    words: tuple[str, ...]
    log_prob: float  # natural log of the probability of the generator's choices

    @property
    def ids(self) -> list[int]:
        return encode(self.words)


_INDEX = {w: i for i, w in enumerate(VOCAB)}


def encode(words) -> list[int]:
    return [_INDEX[w] for w in words]


def decode(ids) -> list[str]:
    return [VOCAB[int(i)] for i in ids]


def generate_document(world: World, rng: np.random.Generator, min_tokens: int) -> Document:
    """One document of whole clauses, at least min_tokens words long."""
    logp = 0.0

    def uniform(n: int) -> int:
        nonlocal logp
        logp -= math.log(n)
        return int(rng.integers(0, n))

    stride_word = world.strides[uniform(len(world.strides))]
    stride = STRIDES[stride_word]
    words = ["<bos>", "step", stride_word, "."]
    counter, day, name = uniform(100), uniform(len(DAYS)), None
    clause = uniform(len(world.cycle))
    adjective = world.adjective
    while len(words) < min_tokens:
        kind = world.cycle[clause % len(world.cycle)]
        clause += 1
        if kind == "count":
            k = 3 + uniform(4)
            words += ["count", *(NUMBERS[(counter + j * stride) % 100] for j in range(k)), "."]
            counter = (counter + k * stride) % 100
        elif kind == "on":
            name, verb = uniform(len(NAMES)), uniform(len(VERBS))
            p = world.noun_probs(verb)
            noun = int(rng.choice(len(NOUNS), p=p))
            logp += math.log(p[noun])
            words += ["on", DAYS[day], NAMES[name], VERBS[verb], "the", NOUNS[noun], "."]
            day = (day + 1) % len(DAYS)
        else:
            first = uniform(len(NAMES)) if name is None else name
            second = uniform(len(NAMES))
            words += [NAMES[first], "is", ADJECTIVES[adjective[first]], "and", NAMES[second], "is",
                      ADJECTIVES[adjective[second]], "."]
    return Document(tuple(words), logp)


def documents(world: World, count: int, min_tokens: int, seed: int) -> list[Document]:
    rng = np.random.default_rng([seed, world.seed])
    return [generate_document(world, rng, min_tokens) for _ in range(count)]


def entropy_per_token(docs: list[Document]) -> float:
    """Nats per token: mean -log p(document) / mean document length (tokens after <bos>)."""
    return float(np.mean([-d.log_prob for d in docs]) / np.mean([len(d.words) - 1 for d in docs]))


def token_windows(docs: list[Document], seq_len: int) -> np.ndarray:
    """`[N, seq_len]` int32: each document's first seq_len ids (documents are made that long)."""
    rows = [d.ids[:seq_len] for d in docs]
    if min(map(len, rows)) < seq_len:
        raise ValueError(f"documents shorter than seq_len {seq_len}")
    return np.asarray(rows, np.int32)


def tokenizer_json() -> str:
    """A Hugging Face `tokenizers` WordLevel tokenizer (whitespace split) of VOCAB."""
    import tokenizers  # the tokenizer library the model loader uses
    from tokenizers import decoders, models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(list(SPECIALS))
    return tok.to_str()


#: the chat template of the synthetic target: the messages' text, as is (a prompt is a document prefix)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def write_tokenizer(folder: str | Path) -> None:
    """tokenizer.json + tokenizer_config.json (bos/eos/pad, the plain chat template)."""
    folder = Path(folder)
    (folder / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
              "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
