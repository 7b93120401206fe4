"""benchmarks/extrapolate_curves.py: the log-linear fit and what it extrapolates to."""
from __future__ import annotations

import json
import math

import pytest
from helpers import load_benchmark


@pytest.fixture(scope="module")
def curves():
    return load_benchmark("extrapolate_curves")


def test_fit_recovers_an_exact_log_linear_curve(curves):
    points = [(1000 * 2**k, 1.1 + 0.05 * k) for k in range(4)]  # +0.05 AL per doubling
    a, b = curves.fit(points)
    assert b == pytest.approx(0.05)
    assert curves.tokens_for(1.3, a, b) == pytest.approx(16000)
    assert math.isinf(curves.tokens_for(3.0, a, -0.01))


def test_table_reads_a_curves_file_and_skips_references(curves, tmp_path):
    path = tmp_path / "curves.jsonl"
    rows = [{"kind": "ar"}, {"kind": "ngram", "al": 1.3},
            {"kind": "eagle3", "train_tokens": 1000, "al": 1.1},
            {"kind": "eagle3", "train_tokens": 2000, "al": 1.2},
            {"kind": "dflash", "train_tokens": 1000, "al": 1.05}]  # one point: no fit
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    lines = curves.table([path], 1.4)
    assert len(lines) == 3 and "| eagle3 |" in lines[2] and "+0.100" in lines[2] and "~10^4" in lines[2]
