"""Self-distillation data for drafter training, and its deterministic batch order.

The target writes its own training data: prompts (token ids, e.g. chat-templated prompt sets)
are continued by the target with `specjax.api.generate_ids` (greedy by default), and each
prompt + response becomes one training sequence. Target hidden states and logits are NOT
stored: the train step recomputes them on the fly with one frozen target forward per batch
(exact, and nothing to keep in sync).

On-disk format (`save` / `load`), a folder with:

  sequences.npz   tokens      int32 [N, T]  prompt + response, right-padded with pad_id
                  lengths     int32 [N]     real tokens per row (<= T)
                  prompt_lens int32 [N]     prompt tokens per row (loss covers t >= prompt_len)
  meta.json       {"format": "specjax-distill-v1", "seq_len": T, "num_sequences": N,
                   "pad_id": ..., plus how the responses were generated}

Batch order: step s reads items `order[s * B : (s + 1) * B]` of an endless stream that
concatenates per-epoch permutations seeded by (seed, epoch), so the batch of any step is a
pure function of (dataset, seed, batch size, step): a resumed run sees the same batches.
"""
from __future__ import annotations

import dataclasses
import json
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from specjax.api import iter_generate_ids
from specjax.drafters.learned.objectives import response_mask
from specjax.jsonfile import read_json_object, write_text_atomic

FORMAT = "specjax-distill-v1"


@dataclasses.dataclass(frozen=True, eq=False)
class Sequences:
    """Training sequences (host numpy arrays)."""

    tokens: np.ndarray  # [N, T] int32
    lengths: np.ndarray  # [N] int32
    prompt_lens: np.ndarray  # [N] int32
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        n, _ = self.tokens.shape
        if self.lengths.shape != (n,) or self.prompt_lens.shape != (n,):
            raise ValueError("tokens [N, T], lengths [N] and prompt_lens [N] must agree on N")
        if n == 0:
            raise ValueError("no training sequences")

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        np.savez(folder / "sequences.npz", tokens=self.tokens, lengths=self.lengths,
                 prompt_lens=self.prompt_lens)
        meta = {"format": FORMAT, "seq_len": self.seq_len, "num_sequences": self.num_sequences,
                **self.meta}
        write_text_atomic(folder / "meta.json", json.dumps(meta, indent=1))

    @classmethod
    def load(cls, folder: str | Path) -> Sequences:
        folder = Path(folder)
        meta = read_json_object(folder / "meta.json")
        if meta.get("format") != FORMAT:
            raise ValueError(f"{folder / 'meta.json'}: not a {FORMAT} data folder "
                             f"(format={meta.get('format')})")
        arrays = folder / "sequences.npz"
        try:
            with np.load(arrays) as z:
                return cls(z["tokens"].astype(np.int32), z["lengths"].astype(np.int32),
                           z["prompt_lens"].astype(np.int32), meta)
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
            raise ValueError(f"{arrays}: not readable training sequences ({e})") from None

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int,
                  pad_id: int = 0, meta: dict | None = None) -> Sequences:
        """(prompt ids, response ids) pairs -> sequences cut to seq_len, right-padded."""
        tokens = np.full((len(rows), seq_len), pad_id, np.int32)
        lengths = np.zeros((len(rows),), np.int32)
        prompt_lens = np.zeros((len(rows),), np.int32)
        for i, (prompt, response) in enumerate(rows):
            ids = (list(prompt) + list(response))[:seq_len]
            tokens[i, : len(ids)] = ids
            lengths[i] = len(ids)
            prompt_lens[i] = min(len(prompt), seq_len)
        return cls(tokens, lengths, prompt_lens, {"pad_id": pad_id, **(meta or {})})


def self_distill(cfg, params, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 seq_len: int, temperature: float = 0.0, seed: int = 0, batch_size: int = 8,
                 eos_ids: Sequence[int] | None = None,
                 on_batch: Callable[[int], None] | None = None, mesh=None) -> Sequences:
    """Continues each prompt (token ids) with the target itself -> Sequences of prompt + response.

    Prompts longer than seq_len - 1 keep their last seq_len // 2 tokens. on_batch(n) is called
    as each batch of n prompts finishes (a progress bar's update). mesh: generate on this
    `jax.sharding.Mesh` (`specjax.sharding`; None: one device).
    """
    keep = max(1, seq_len // 2)
    prompts = [list(p) if len(p) < seq_len else list(p)[-keep:] for p in prompts]
    results = []
    for _, batch in iter_generate_ids(
        cfg, params, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
        batch_size=batch_size, eos_ids=eos_ids, mesh=mesh,
    ):
        results += batch
        if on_batch is not None:
            on_batch(len(batch))
    meta = {"generated_by": cfg.name, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "seed": seed}
    return Sequences.from_rows([(p, r.token_ids) for p, r in zip(prompts, results)], seq_len,
                               cfg.pad_token_id, meta)


def batch_indices(num_items: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """`[batch_size]` item indices of step `step` (see the module docstring)."""
    positions = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs, offsets = np.divmod(positions, num_items)
    out = np.empty((batch_size,), np.int64)
    for epoch in np.unique(epochs):
        order = np.random.default_rng([seed, int(epoch)]).permutation(num_items)
        out[epochs == epoch] = order[offsets[epochs == epoch]]
    return out


def tokens_before(data: Sequences, batch_size: int, seed: int, step: int) -> int:
    """Real tokens (`lengths`) in the batches of steps [0, step): whole epochs of the stream
    count every item once, the last partial epoch its first items (see `batch_indices`)."""
    epochs, rest = divmod(step * batch_size, data.num_sequences)
    order = np.random.default_rng([seed, epochs]).permutation(data.num_sequences)
    return int(epochs * np.sum(data.lengths, dtype=np.int64)
               + np.sum(data.lengths[order[:rest]], dtype=np.int64))


def get_batch(data: Sequences, batch_size: int, seed: int, step: int) -> dict[str, np.ndarray]:
    """{"tokens" [B, T], "lengths" [B], "prompt_lens" [B]} of step `step`."""
    idx = batch_indices(data.num_sequences, batch_size, seed, step)
    return {"tokens": data.tokens[idx], "lengths": data.lengths[idx],
            "prompt_lens": data.prompt_lens[idx]}


def response_tokens(data: Sequences) -> np.ndarray:
    """`[N]` every response token of the data (the tokens the heads learn to predict)."""
    return data.tokens[response_mask(data.lengths, data.prompt_lens, data.seq_len)]
