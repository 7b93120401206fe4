"""Where a generation job's time goes, measured apart for every batch: building its programs
(compile), prefill (the prompts and each row's first token) and decode (every later token).

`build_and_run` builds a jitted program for its arguments with JAX's AOT path
(`lower(...).compile()`: tracing and compiling, or loading from the persistent compilation
cache; about a millisecond when this process built it already), then runs it to completion, and
returns the two times apart; `job_stats` sums a job's rows into the line `specjax generate`
prints: `compiled in 24.1 s; 65 tokens in 1.92 s (33.9 tokens/s; prefill 0.21 s, decode
1.71 s)`.

Every batch counts what its rows' slots did (`SlotStats`: busy slot-steps / all slot-steps is
the slot utilisation; a static batch's row is busy from its first decoding step to its last).
A refilling job (`specjax.refill`: continuous batching inside one program per chunk of
prompts) cannot time prefill apart from decode inside its program: its chunk's run time is
decode_s (prefill_s 0); the job's line then ends with the slot utilisation, the refills per
chunk and the prefill passes' share of the program's steps (refill passes / (refill passes +
decode steps)); a static job's with its prefill and decode seconds and the slot utilisation.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import jax


@dataclasses.dataclass(frozen=True)
class SlotStats:
    """What the B slots of one batch did: a refilling chunk's `specjax.refill.SlotCounters` on
    the host, or a static batch's (refills 0)."""

    slots: int  # B
    decode_steps: int  # decoding steps over all B slots
    busy_slot_steps: int  # slot-steps of running rows
    refills: int  # refill passes (each one prefill of the policy's rows); 0: a static batch
    prefilled: int  # prompts started

    @property
    def slot_steps(self) -> int:
        return self.decode_steps * self.slots


@dataclasses.dataclass(frozen=True)
class BatchTimes:
    """Seconds of one batch of a job (every row of the batch carries the same record)."""

    batch: int  # the batch's index in its job
    compile_s: float  # building its programs (tracing + compiling, or loading them from the cache)
    prefill_s: float  # the prompts' forward and each row's first token
    decode_s: float  # every later token (a refilling chunk: its whole run, prefills included)
    slots: SlotStats | None = None  # the batch's slot counters (None: not counted)

    @property
    def run_s(self) -> float:
        """Generating, compilation excluded: prefill + decode."""
        return self.prefill_s + self.decode_s


@dataclasses.dataclass(frozen=True)
class JobStats:
    """A job's totals (or a part of it): new tokens and each batch's times, summed."""

    new_tokens: int = 0
    compile_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    slot_steps: int = 0  # the batches' `SlotStats`: all slot-steps,
    busy_slot_steps: int = 0  # the busy ones,
    refills: int = 0  # refill passes,
    decode_steps: int = 0  # decoding steps
    chunks: int = 0  # refilling chunks (calls; 0: static batches only)

    def __add__(self, other: JobStats) -> JobStats:
        return JobStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    @property
    def run_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of generating (compilation excluded); 0 before any."""
        return self.new_tokens / self.run_s if self.run_s > 0 else 0.0

    @property
    def slot_utilisation(self) -> float:
        """Busy slot-steps / all slot-steps (0 without any)."""
        return self.busy_slot_steps / self.slot_steps if self.slot_steps else 0.0

    @property
    def prefill_step_share(self) -> float:
        """Refill passes / (refill passes + decoding steps): the prefills' share of the steps."""
        steps = self.refills + self.decode_steps
        return self.refills / steps if steps else 0.0

    def line(self) -> str:
        """`compiled in C s; N tokens in T s (R tokens/s; prefill P s, decode D s[, slots U%
        busy])`, or for a refilling job `(R tokens/s; slots U% busy, F refills/chunk, prefill S%
        of steps)`."""
        head = (f"compiled in {self.compile_s:.1f} s; {self.new_tokens} tokens in {self.run_s:.2f} s "
                f"({self.tokens_per_s:.1f} tokens/s; ")
        if self.chunks:
            return head + (f"slots {self.slot_utilisation:.0%} busy, "
                           f"{self.refills / self.chunks:.1f} refills/chunk, "
                           f"prefill {self.prefill_step_share:.0%} of steps)")
        slots = f", slots {self.slot_utilisation:.0%} busy" if self.slot_steps else ""
        return head + f"prefill {self.prefill_s:.2f} s, decode {self.decode_s:.2f} s{slots})"


def job_stats(results: Iterable) -> JobStats:
    """The totals of a job's results (TokenResults or Generations): every row's new tokens and
    each batch's times once."""
    results = list(results)
    batches = {r.times.batch: r.times for r in results if r.times is not None}.values()
    slots = [t.slots for t in batches if t.slots is not None]
    return JobStats(
        new_tokens=sum(len(r.token_ids) for r in results),
        compile_s=sum(t.compile_s for t in batches),
        prefill_s=sum(t.prefill_s for t in batches),
        decode_s=sum(t.decode_s for t in batches),
        slot_steps=sum(s.slot_steps for s in slots),
        busy_slot_steps=sum(s.busy_slot_steps for s in slots),
        refills=sum(s.refills for s in slots),
        decode_steps=sum(s.decode_steps for s in slots),
        chunks=sum(1 for s in slots if s.refills),
    )


def build_and_run(program, *args, **static):
    """(outputs, compile seconds, run seconds) of `program(*args, **static)`, a jitted function:
    built first (`program.lower(...).compile()`, which fills the caches the call then uses),
    then called and waited for."""
    start = time.perf_counter()
    program.lower(*args, **static).compile()
    built = time.perf_counter()
    outputs = jax.block_until_ready(program(*args, **static))
    return outputs, built - start, time.perf_counter() - built
