"""Draft-length schedules: which draft shape to use at which batch size.

`specjax tune` writes one; `specjax.generate(..., schedule=...)`, `generate_ids(...,
schedule=...)` and `specjax generate --tuned FILE` use it: a batch of B rows (the batch size
the program runs at) takes the bucket with the smallest `batch_size >= B`, or the largest
bucket when B is past every bucket. The bucket's draft shape replaces the drafter's tree
(`num_draft: 0` = no speculation at that size).

File format (YAML, `version: 1`):

    version: 1
    model: smollm2-135m         # what it was tuned for (informative)
    draft: ngram                # drafter spec; used when the caller passes no drafter
    device: cpu
    buckets:                    # any order; sorted on load
      - {batch_size: 1, num_draft: 6}
      - {batch_size: 16, tree: eagle_small}
      - {batch_size: 64, num_draft: 0}
    # any other key of a bucket (predicted_tokens_per_s, ...) is kept as `extra`
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml

from specjax.tree import TreeSpec, chain, load_tree
from specjax.yamlfile import field_problem, read_yaml_mapping

VERSION = 1


def draft_tree(num_draft: int = 0, tree: str | None = None) -> TreeSpec | None:
    """The draft shape a (num_draft, tree) pair names: a tree preset/YAML, a chain, or None
    (no speculation) for num_draft 0."""
    if tree:
        return load_tree(tree)
    return chain(num_draft) if num_draft else None


def shape_label(num_draft: int = 0, tree: str | None = None) -> str:
    """"eagle_small", "4", or "0" (no speculation)."""
    return tree or str(num_draft)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Draft shape for batches of up to `batch_size` rows: a chain of num_draft, or a tree."""

    batch_size: int
    num_draft: int = 0
    tree: str | None = None
    extra: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.batch_size < 1 or self.num_draft < 0:
            raise ValueError(f"bucket needs batch_size >= 1 and num_draft >= 0: {self}")
        if self.tree and self.num_draft:
            raise ValueError(f"bucket batch_size={self.batch_size}: give num_draft or tree, not both")

    @property
    def tree_spec(self) -> TreeSpec | None:
        """The draft tree, or None for no speculation."""
        return draft_tree(self.num_draft, self.tree)

    @property
    def label(self) -> str:
        return shape_label(self.num_draft, self.tree)

    def to_dict(self) -> dict:
        shape = {"tree": self.tree} if self.tree else {"num_draft": self.num_draft}
        return {"batch_size": self.batch_size, **shape, **self.extra}

    @classmethod
    def from_dict(cls, data: dict) -> Bucket:
        known = {"batch_size", "num_draft", "tree"}
        return cls(
            batch_size=int(data["batch_size"]), num_draft=int(data.get("num_draft") or 0),
            tree=data.get("tree"), extra={k: v for k, v in data.items() if k not in known},
        )


@dataclasses.dataclass(frozen=True)
class Schedule:
    buckets: tuple[Bucket, ...]
    model: str = ""
    draft: str = ""
    device: str = ""

    def __post_init__(self):
        if not self.buckets:
            raise ValueError("a schedule needs at least one bucket")
        ordered = tuple(sorted(self.buckets, key=lambda b: b.batch_size))
        sizes = [b.batch_size for b in ordered]
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"duplicate batch sizes in schedule: {sizes}")
        object.__setattr__(self, "buckets", ordered)

    def pick(self, batch_size: int) -> Bucket:
        """The bucket for batches of `batch_size` rows."""
        return next((b for b in self.buckets if b.batch_size >= batch_size), self.buckets[-1])

    def to_dict(self) -> dict:
        return {
            "version": VERSION, "model": self.model, "draft": self.draft, "device": self.device,
            "buckets": [b.to_dict() for b in self.buckets],
        }

    @classmethod
    def from_dict(cls, data: dict, where: str = "<schedule>") -> Schedule:
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"{where}: not a version-{VERSION} draft schedule")
        if not isinstance(data.get("buckets"), list):
            raise ValueError(f"{where}: needs a 'buckets' list")
        try:
            buckets = tuple(Bucket.from_dict(b) for b in data["buckets"])
            for b in buckets:
                b.tree_spec  # noqa: B018 -- resolves each draft shape now, naming this file
            return cls(buckets, str(data.get("model", "")), str(data.get("draft", "")),
                       str(data.get("device", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: bad bucket ({field_problem(e)})") from None

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
        from specjax.drafters.registry import make_drafter

        return make_drafter(schedule.draft, tree=tree, target=model, dtype=dtype)
    return dataclasses.replace(drafter, tree=tree), drafter_params
