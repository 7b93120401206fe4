"""Tokenizer: a `tokenizers.Tokenizer` plus chat template and end-of-turn ids.

    tok = Tokenizer.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # or Tokenizer.from_hf_dir(dir)
    text = tok.apply_chat_template("What is 2 + 2?")               # ChatML, generation prompt
    ids = tok.encode(text)                                         # list[int]
    tok.decode(ids); tok.eos_token_ids; tok.stop_sequences(["\\n\\n"])

A GGUF carries no tokenizer.json: for byte-level BPE vocabularies (`tokenizer.ggml.model` =
"gpt2", which covers SmolLM2, Llama 3, Qwen) it is rebuilt from `tokenizer.ggml.tokens`,
`.merges`, `.token_type` and the pre-tokenizer named by `tokenizer.ggml.pre`, which must split
text exactly as the vocabulary was trained: SmolLM2 ("smollm", like StarCoder) splits every digit
on its own before the GPT-2 split, which keeps a whitespace run before a number whole
("x  1" -> "x", "ĠĠ", "1").
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from specjax.models.checkpoint import CheckpointError
from specjax.models.gguf_reader import read_gguf

# Strings that end a turn or a document in common vocabularies; all that exist become eos ids.
END_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|end|>",
    "</s>",
    "<end_of_turn>",
)

Messages = str | Sequence[Mapping[str, Any]]


def end_token_ids(
    vocab: Sequence[str] | Mapping[str, int], declared: Iterable[int | None] = ()
) -> tuple[int, ...]:
    """Declared eos ids (None skipped), then the ids of the END_TOKENS in vocab; deduplicated."""
    if isinstance(vocab, Mapping):
        index = {t: vocab[t] for t in END_TOKENS if t in vocab}
    else:
        wanted = set(END_TOKENS)
        index = {t: i for i, t in enumerate(vocab) if t in wanted}
    ids = [int(i) for i in declared if i is not None]
    ids += [index[t] for t in END_TOKENS if t in index]
    return tuple(dict.fromkeys(ids))


# ---------------------------------------------------------------------------------------------
# Byte-level BPE from GGUF metadata
# ---------------------------------------------------------------------------------------------

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (extra split before the byte-level step, or None = GPT-2's own split;
#                        whether BPE skips merging words that are whole vocabulary entries)
_DIGITS = "digits"
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (None, False),
    "gpt2": (None, False),
    "gpt-2": (None, False),
    "olmo": (None, False),
    "mpt": (None, False),
    "jais": (None, False),
    "smollm": (_DIGITS, False),
    "starcoder": (_DIGITS, False),
    "refact": (_DIGITS, False),
    "codeshell": (_DIGITS, False),
    "command-r": (_DIGITS, False),
    "exaone": (_DIGITS, False),
    "llama-bpe": (_LLAMA3_SPLIT, True),
    "llama3": (_LLAMA3_SPLIT, True),
    "llama-v3": (_LLAMA3_SPLIT, True),
    "smaug-bpe": (_LLAMA3_SPLIT, True),
    "qwen2": (_QWEN2_SPLIT, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _pre_tokenizer(split: str | None) -> pre_tokenizers.PreTokenizer:
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == _DIGITS:
        first = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence(
            [first, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    first = pre_tokenizers.Split(Regex(split), behavior="isolated")
    return pre_tokenizers.Sequence(
        [first, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _bos_processor(bos: str, bos_id: int) -> processors.PostProcessor:
    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )


def byte_level_bpe(metadata: Mapping[str, Any], path: str) -> tokenizers.Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from GGUF `tokenizer.ggml.*` metadata."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            path,
            f"tokenizer model {kind!r} cannot be rebuilt from GGUF metadata (only byte-level "
            "BPE, 'gpt2', is supported): load the model from a Hugging Face folder with "
            "tokenizer.json",
        )
    tokens = list(metadata.get("tokenizer.ggml.tokens") or ())
    merges = metadata.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise CheckpointError(
            path, "missing metadata 'tokenizer.ggml.tokens' / 'tokenizer.ggml.merges'"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        warnings.warn(
            f"{path}: unknown tokenizer.ggml.pre {pre!r}; using the GPT-2 split", stacklevel=2
        )
    split, ignore_merges = PRE_TOKENIZERS.get(pre, (None, False))
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(
        models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    )
    backend.pre_tokenizer = _pre_tokenizer(split)
    backend.decoder = decoders.ByteLevel()
    types = list(metadata.get("tokenizer.ggml.token_type", ()))
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types)
        if k == _CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types)
        if k == _USER_DEFINED
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user)
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        backend.post_processor = _bos_processor(tokens[bos_id], int(bos_id))
    return backend


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """A Hugging Face style chat template in a sandboxed Jinja environment."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
    return env.from_string(source)


def as_messages(messages: Messages, system: str | None = None) -> list[dict[str, Any]]:
    """A user string or a message list -> message dicts; `system` prepended if given and absent."""
    out = (
        [{"role": "user", "content": messages}]
        if isinstance(messages, str)
        else [dict(m) for m in messages]
    )
    if system is not None and not (out and out[0].get("role") == "system"):
        out.insert(0, {"role": "system", "content": system})
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def _token_text(value) -> str | None:
    """tokenizer_config.json spells special tokens as strings or {"content": ...} dicts."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(path, f"unreadable JSON: {e}") from None


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """Encode/decode, chat template and stop ids of one model."""

    backend: tokenizers.Tokenizer
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    special_tokens: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    source: str = ""
    default_system: str | None = None  # system prompt used when a conversation has none

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], path: str = "<gguf>") -> Tokenizer:
        backend = byte_level_bpe(metadata, path)
        tokens = metadata["tokenizer.ggml.tokens"]
        ids = {
            k: metadata.get(f"tokenizer.ggml.{k}_token_id")
            for k in ("bos", "eos", "eot", "eom", "unknown", "padding")
        }
        names = {
            "bos": "bos_token",
            "eos": "eos_token",
            "unknown": "unk_token",
            "padding": "pad_token",
        }
        return cls(
            backend=backend,
            chat_template=metadata.get("tokenizer.chat_template"),
            bos_token_id=ids["bos"],
            eos_token_ids=end_token_ids(tokens, (ids["eos"], ids["eot"], ids["eom"])),
            special_tokens={
                v: tokens[ids[k]] if ids[k] is not None else None for k, v in names.items()
            },
            source=path,
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        return cls.from_gguf_metadata(read_gguf(path).metadata, str(path))

    @classmethod
    def from_hf_dir(cls, directory: str | os.PathLike) -> Tokenizer:
        """From tokenizer.json, tokenizer_config.json (+ chat_template.jinja, generation_config)."""
        root = Path(directory)
        if not (root / "tokenizer.json").exists():
            raise CheckpointError(root, "missing tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:
            raise CheckpointError(root / "tokenizer.json", f"unreadable tokenizer: {e}") from None
        config = _read_json(root / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        if template is None and (root / "chat_template.jinja").exists():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        special = {
            k: _token_text(config.get(k))
            for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        vocab = backend.get_vocab(with_added_tokens=True)
        declared = [vocab.get(special["eos_token"])] if special["eos_token"] else []
        declared += _as_ids(_read_json(root / "generation_config.json").get("eos_token_id"))
        declared += _as_ids(_read_json(root / "config.json").get("eos_token_id"))
        bos = special["bos_token"]
        return cls(
            backend=backend,
            chat_template=template,
            bos_token_id=vocab.get(bos) if bos else None,
            eos_token_ids=end_token_ids(vocab, declared),
            special_tokens=special,
            source=str(root),
        )

    def replace(self, **changes) -> Tokenizer:
        return dataclasses.replace(self, **changes)

    # -- tokens ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text. Special-token strings in text (`<|im_start|>`) map to their ids;
        `add_special_tokens` adds the tokenizer's own (e.g. a BOS) — off by default because chat
        templates already write them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        return [
            e.ids
            for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        ]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def stop_sequences(self, stops: Iterable[str]) -> tuple[tuple[int, ...], ...]:
        """Token-id sequences of stop strings (each encoded alone, no special tokens added).

        A stop string can tokenize differently inside running text (merges across its border);
        callers that need exactness also check the decoded text.
        """
        seqs = (tuple(self.encode(s)) for s in stops if s)
        return tuple(dict.fromkeys(s for s in seqs if s))

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        *,
        system: str | None = None,
        chat_template: str | None = None,
        **template_vars: Any,
    ) -> str:
        """The prompt text for `messages` (a user string or [{"role", "content"}, ...]).

        `system` (default: `default_system`) is prepended as a system message when the
        conversation has none (None: the template's own default); the template is the model's
        unless `chat_template` is given.
        """
        source = chat_template or self.chat_template
        if source is None:
            raise ValueError(
                f"{self.source}: the tokenizer has no chat template; pass chat_template="
            )
        variables = {
            **{k: v for k, v in self.special_tokens.items() if v is not None},
            **template_vars,
        }
        return compile_chat_template(source).render(
            messages=as_messages(messages, self.default_system if system is None else system),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def encode_chat(
        self, messages: Messages, add_generation_prompt: bool = True, **kwargs
    ) -> list[int]:
        """`encode(apply_chat_template(...))`."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))
