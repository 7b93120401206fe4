"""Draft-length schedules: which draft shape to use at which batch size.

`specjax tune` writes one; `specjax.generate(..., schedule=...)`, `generate_ids(...,
schedule=...)` and `specjax generate --tuned FILE` use it: a batch of B rows (the batch size
the program runs at) takes the entry with the smallest `batch_size >= B`, or the largest
entry when B is past every entry. The entry's draft shape (`DraftShape`) replaces the
drafter's tree (`num_draft: 0` = no speculation at that size).

File format (YAML, `version: 1`):

    version: 1
    model: smollm2-135m         # what it was tuned for (informative)
    draft: ngram                # drafter spec; used when the caller passes no drafter
    device: cpu
    buckets:                    # the entries, any order; sorted on load
      - {batch_size: 1, num_draft: 6}
      - {batch_size: 16, tree: eagle_small}
      - {batch_size: 64, num_draft: 0}
    # any other key of an entry (predicted_tokens_per_s, ...) is kept as `extra`
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml

from specjax.drafters.registry import make_drafter
from specjax.tree import TreeSpec, chain, load_tree
from specjax.yamlfile import field_problem, read_yaml_mapping

VERSION = 1


@dataclasses.dataclass(frozen=True)
class DraftShape:
    """A draft shape: a chain of `num_draft` tokens (0 = no speculation) or a tree (a preset
    name or a YAML path). The one record of a shape for the tuner's candidates and the
    schedule's entries."""

    num_draft: int = 0
    tree: str | None = None

    def __post_init__(self):
        if self.num_draft < 0:
            raise ValueError(f"num_draft must be >= 0, got {self.num_draft}")
        if self.tree and self.num_draft:
            raise ValueError(f"give num_draft or tree, not both (num_draft={self.num_draft}, "
                             f"tree={self.tree!r})")

    @property
    def tree_spec(self) -> TreeSpec | None:
        """The draft tree: a tree preset/YAML, a chain, or None (no speculation)."""
        if self.tree:
            return load_tree(self.tree)
        return chain(self.num_draft) if self.num_draft else None

    @property
    def label(self) -> str:
        """"eagle_small", "4", or "0" (no speculation)."""
        return self.tree or str(self.num_draft)

    @property
    def num_nodes(self) -> int:
        spec = self.tree_spec
        return spec.num_nodes if spec is not None else 0

    def to_dict(self) -> dict:
        return {"tree": self.tree} if self.tree else {"num_draft": self.num_draft}


@dataclasses.dataclass(frozen=True)
class ScheduleEntry:
    """The draft shape for batches of up to `batch_size` rows (`extra`: other keys of the
    file's entry, e.g. predicted_tokens_per_s, kept as they are)."""

    batch_size: int
    shape: DraftShape = DraftShape()
    extra: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"a schedule entry needs batch_size >= 1, got {self.batch_size}")

    def to_dict(self) -> dict:
        return {"batch_size": self.batch_size, **self.shape.to_dict(), **self.extra}

    @classmethod
    def from_dict(cls, data: dict) -> ScheduleEntry:
        known = {"batch_size", "num_draft", "tree"}
        shape = DraftShape(num_draft=int(data.get("num_draft") or 0), tree=data.get("tree"))
        return cls(batch_size=int(data["batch_size"]), shape=shape,
                   extra={k: v for k, v in data.items() if k not in known})


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Draft shapes by batch size (`entries`, sorted by batch_size) and what they were tuned for."""

    entries: tuple[ScheduleEntry, ...]
    model: str = ""
    draft: str = ""
    device: str = ""

    def __post_init__(self):
        if not self.entries:
            raise ValueError("a schedule needs at least one entry")
        ordered = tuple(sorted(self.entries, key=lambda e: e.batch_size))
        sizes = [b.batch_size for b in ordered]
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"duplicate batch sizes in schedule: {sizes}")
        object.__setattr__(self, "entries", ordered)

    def pick(self, batch_size: int) -> DraftShape:
        """The draft shape for batches of `batch_size` rows: the entry with the smallest
        batch_size >= it, or the last entry past them all."""
        return next((e for e in self.entries if e.batch_size >= batch_size), self.entries[-1]).shape

    def to_dict(self) -> dict:
        return {
            "version": VERSION, "model": self.model, "draft": self.draft, "device": self.device,
            "buckets": [e.to_dict() for e in self.entries],
        }

    @classmethod
    def from_dict(cls, data: dict, where: str = "<schedule>") -> Schedule:
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"{where}: not a version-{VERSION} draft schedule")
        if not isinstance(data.get("buckets"), list):
            raise ValueError(f"{where}: needs a 'buckets' list")
        try:
            entries = tuple(ScheduleEntry.from_dict(b) for b in data["buckets"])
            for entry in entries:
                entry.shape.tree_spec  # noqa: B018 -- resolves each draft shape now, naming this file
            return cls(entries, str(data.get("model", "")), str(data.get("draft", "")),
                       str(data.get("device", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: bad entry under 'buckets' ({field_problem(e)})") from None

    def save(self, path: str | os.PathLike, header: str = "") -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        comment = "".join(f"# {line}\n" for line in header.splitlines())
        path.write_text(comment + yaml.safe_dump(self.to_dict(), sort_keys=False), encoding="utf-8")


def load_schedule(source: str | os.PathLike | Schedule | dict) -> Schedule:
    """A Schedule from itself, a parsed mapping, or a YAML file."""
    if isinstance(source, Schedule):
        return source
    if isinstance(source, dict):
        return Schedule.from_dict(source)
    return Schedule.from_dict(read_yaml_mapping(source, "schedule"), f"schedule {source}")


def scheduled(drafter, drafter_params, schedule, batch_size: int, model=None, dtype: str = "float32"):
    """(drafter, params) to run batches of `batch_size` with: the schedule's pick.

    With no drafter given, the schedule's own `draft` spec is built for `model` (a target
    with .cfg/.params/.tokenizer) through the drafter registry.
    """
    if schedule is None:
        return drafter, drafter_params
    schedule = load_schedule(schedule)
    tree = schedule.pick(batch_size).tree_spec
    if tree is None:
        return None, None
    if drafter is None:
        if not schedule.draft or model is None:
            raise ValueError("the schedule names no drafter: pass one (draft=...)")

        return make_drafter(schedule.draft, tree=tree, target=model, dtype=dtype)
    return dataclasses.replace(drafter, tree=tree), drafter_params
