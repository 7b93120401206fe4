"""benchmarks/gpu_suite.sh: its whole `--smoke` run takes ~100 s on 2 CPU cores (run by hand,
not in CI), so CI checks its parts: the dry run lists the five parts with selections that
exist, and with a stand-in Python every part runs in order, a failing and an over-budget part
are recorded in summary.md, the parts' logs end in parts.log (the folder stays within the 8
files the device tool brings back), and the exit status is 1."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"


def run_suite(*args, env=None, timeout=60):
    return subprocess.run(["bash", str(SUITE), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def table_rows(summary: Path) -> list[list[str]]:
    lines = [x for x in summary.read_text().splitlines() if re.match(r"\| \d\. ", x)]
    return [[c.strip() for c in x.strip("|").split("|")] for x in lines]


def test_dry_run_lists_the_five_parts_and_their_tests_exist(tmp_path):
    for mode, impl in (((), "pallas"), (("--smoke",), "auto")):
        result = run_suite("--dry-run", "--out", str(tmp_path), *mode)
        assert f"SPECJAX_TEST_ATTENTION_IMPL={impl}" in result.stdout
        assert result.returncode == 0, result.stderr
        rows = table_rows(tmp_path / "summary.md")
        assert [r[0] for r in rows] == [
            "1. kernel tests", "2. greedy equality, every drafter",
            "3. verify attention benchmark", "4. spec system benchmark",
            "5. quantized targets benchmark",
        ]
        for node in re.findall(r"tests/(\w+\.py)(?:::(\w+))?", result.stdout):
            path, function = ROOT / "tests" / node[0], node[1]
            assert path.exists(), path
            assert not function or f"def {function}(" in path.read_text(), node


def test_parts_run_in_order_and_failures_and_timeouts_are_recorded(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = -c ]; then echo "cpu: fake, jax 0"; exit 0; fi\n'
        'echo "$*" >> "$(dirname "$0")/calls"\n'
        'case "$*" in *gpu_verify_attention*) echo "broken"; exit 3 ;;\n'
        '  *gpu_spec_system*) sleep 30 ;; esac\n'
        'echo "== 2 passed in 0.1s =="\n'
    )
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "SUITE_BUDGETS": "20 20 20 2 20"}
    result = run_suite("--smoke", "--out", str(out), env=env)
    assert result.returncode == 1
    calls = (tmp_path / "calls").read_text().splitlines()
    assert ["pytest" in calls[0], "pytest" in calls[1]] == [True, True]
    assert "gpu_verify_attention.py" in calls[2] and "gpu_spec_system.py" in calls[3]
    assert "gpu_quant.py" in calls[4]
    rows = table_rows(out / "summary.md")
    assert [r[1] for r in rows] == ["ok", "ok", "failed (rc 3)", "timeout (2 s)", "ok"]
    assert rows[0][5] == "== 2 passed in 0.1s ==" and rows[2][5] == "broken"
    assert sorted(p.name for p in out.iterdir()) == ["parts.log", "summary.md"]
    logs = (out / "parts.log").read_text()
    assert [line for line in logs.splitlines() if line.startswith("=====")] == [
        "===== 1. kernel tests: 1_kernel_tests.log (rc 0) =====",
        "===== 2. greedy equality, every drafter: 2_greedy.log (rc 0) =====",
        "===== 3. verify attention benchmark: 3_verify_attention.log (rc 3) =====",
        "===== 4. spec system benchmark: 4_spec_system.log (rc 124) =====",
        "===== 5. quantized targets benchmark: 5_quant.log (rc 0) =====",
    ]
    assert "broken" in logs
    env["SUITE_BUDGETS"] = "20 20 20 2"  # four: refused before any part runs, naming the variable
    result = run_suite("--smoke", "--out", str(tmp_path / "four"), env=env)
    assert result.returncode == 2 and "SUITE_BUDGETS needs 5 budgets" in result.stderr
    assert not (tmp_path / "four" / "parts.log").exists()
