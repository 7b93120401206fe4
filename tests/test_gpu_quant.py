"""benchmarks/gpu_quant.py (the GPU suite's part 5): the weight-copy count it reports reads the
compiled program right (a layer kernel's shape written outside a fusion's body counts, the same
shape inside a fusion's body or as a parameter does not), and its smoke run on this CPU finds
what is known of it: no copy where the CPU kernels read f32 weights in place, one dequantized
copy a layer kernel on XLA's int8 path (the QArrays of a random model), and the step's numbers."""
from __future__ import annotations

import json

import pytest
from helpers import load_benchmark

from specjax.models.quant import cpu_kernel_reason


@pytest.fixture(scope="module")
def gpu_quant():
    return load_benchmark("gpu_quant")


HLO = """\
HloModule step

%fused_computation.1 (param_0: s8[64,96], param_1: f32[1,96]) -> f32[64,96] {
  %param_0 = s8[64,96]{1,0} parameter(0)
  %convert.1 = f32[64,96]{1,0} convert(%param_0)
  %broadcast.2 = f32[64,96]{1,0} broadcast(%param_1), dimensions={0,1}
  ROOT %multiply.3 = f32[64,96]{1,0} multiply(%convert.1, %broadcast.2)
}

%body.7 (arg: (s32[], f32[2,64])) -> (s32[], f32[2,64]) {
  %p = s8[64,96]{1,0} parameter(0)
  %dynamic-slice.4 = bf16[96,64]{1,0} dynamic-slice(%w, %i, %z), dynamic_slice_sizes={1,96,64}
  %fusion.5 = f32[64,96]{1,0} fusion(%p, %s), kind=kLoop, calls=%fused_computation.1
  %dynamic-slice.9 = s4[64,96]{1,0:E(4)} dynamic-slice(%q, %i, %z), dynamic_slice_sizes={1,64,96}
  %dot.6 = f32[2,96]{1,0} dot(%x, %fusion.5), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.10 (w: bf16[4,96,64]) -> f32[2,64] {
  %copy.11 = bf16[96,64]{1,0} copy(%slice)
  %while.12 = (s32[], f32[2,64]) while(%t), condition=%cond.8, body=%body.7
}
"""


def test_the_copies_are_what_the_layer_loop_writes_in_a_weights_shape(gpu_quant):
    copies = gpu_quant.weight_copies(HLO, {(64, 96)})  # not ENTRY's copy: outside the loop
    assert copies == {"count": 3, "bytes": 64 * 96 * 4 + 96 * 64 * 2 + 64 * 96 // 2,
                      "ops": {"dynamic-slice": 2, "fusion": 1}}
    assert gpu_quant.weight_copies(HLO, {(32, 32)})["count"] == 0


def test_the_smoke_run_counts_the_copies_of_each_path(gpu_quant, tmp_path):
    if cpu_kernel_reason() is not None:
        pytest.skip(f"CPU kernel unavailable: {cpu_kernel_reason()}")
    modes = ("float32", "int8", "int4")
    assert gpu_quant.main(["--smoke", "--modes", *modes, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_quant_smoke.json").read_text())
    rows = {(r["mode"], r["batch_size"]): r for r in report["results"]}
    assert set(rows) == {(mode, b) for mode in modes for b in (1, 4)}
    for b in (1, 4):
        assert rows["float32", b]["weight_copies_per_layer"] == 0  # the float CPU kernel reads in place
        for mode in ("int8", "int4"):  # qwix's dequantize: one copy a layer kernel, no more
            assert rows[mode, b]["weight_copies_per_layer"] == 7, rows[mode, b]["copy_ops"]
    for r in rows.values():
        assert r["step_ms"] > 0 and 0 < r["fraction_of_floor"] < 1.5
        assert r["weight_bytes"] > 0
    assert rows["int8", 1]["weight_bytes"] < rows["float32", 1]["weight_bytes"]
