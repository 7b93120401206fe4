"""Log-linear extrapolation of drafter learning curves: AL = a + b * log2(training tokens).

Reads the curves that `benchmarks/train_drafters.py` writes (JSONL rows with "kind",
"train_tokens", "al"), fits each (file, kind) by least squares, and prints a markdown table:
AL gained per doubling of training tokens, and the tokens a target AL would need if the fit
held (it will not hold forever: read it as an order of magnitude, not a plan).

    python benchmarks/extrapolate_curves.py benchmarks/results/train_drafters/curves*.jsonl --target-al 3
"""
from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np


def load_points(path: Path) -> dict[str, list[tuple[int, float]]]:
    """kind -> [(train_tokens, AL)] of one curves file (rows without train_tokens are references)."""
    points: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row.get("train_tokens"):
            points[row["kind"]].append((int(row["train_tokens"]), float(row["al"])))
    return dict(points)


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of AL = a + b * log2(tokens), least squares over >= 2 points."""
    x = np.log2([t for t, _ in points])
    y = np.array([al for _, al in points])
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def tokens_for(al: float, a: float, b: float) -> float:
    """Training tokens at which the fitted line reaches `al` (inf if it never rises)."""
    return 2.0 ** ((al - a) / b) if b > 0 else math.inf


def table(paths: list[Path], target_al: float) -> list[str]:
    lines = [f"| curve | kind | points (k tokens: AL) | AL per doubling | tokens to AL {target_al:g} |",
             "|---|---|---|---|---|"]
    for path in paths:
        for kind, pts in load_points(path).items():
            if len(pts) < 2:
                continue
            a, b = fit(pts)
            need = tokens_for(target_al, a, b)
            shown = ", ".join(f"{t // 1000}: {al:.3f}" for t, al in pts)
            need_text = "never (flat or falling)" if math.isinf(need) else f"~10^{math.log10(need):.0f}"
            lines.append(f"| {path.name} | {kind} | {shown} | {b:+.3f} | {need_text} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("curves", nargs="+", type=Path)
    p.add_argument("--target-al", type=float, default=3.0)
    args = p.parse_args(argv)
    print("\n".join(table(args.curves, args.target_al)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
