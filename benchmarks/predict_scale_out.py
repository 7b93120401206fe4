"""PREDICTED (not measured) decode tokens/s of Llama-3-8B and Llama-3-70B on a TPU v5e-8 and on
8x H100 SXM, plain and with n-gram speculation at the draft length the tuner's model picks.

    python benchmarks/predict_scale_out.py [--context 1024] [--tune benchmarks/results/tune_smollm2_ngram_cpu.json]

The model (`specjax.measure.tune`'s: tokens/s = E[tokens/step](D) x B / (T_target(B, 1+D) +
T_draft)), with the step cost from a roofline instead of a profile:

    T_target(B, T) = max(bytes / (chips x HBM B/s), 2 x params x B x T / (chips x peak x MFU))
                     + L x 2 x all-reduce([B, T, H] over tp = chips)
    bytes = weights + the KV cache read (B x context x 2 x L x KVH x Dh x 2 bytes)
    all-reduce(x) = alpha + 2 (n-1)/n x bytes(x) / link B/s        (ring)
    T_draft = 2 % of the plain step (n-gram matching on the device; measured < 2 % on CPU)

E[tokens/step](D) = 1 + sum of the first D joint acceptances, measured for n-gram on
Spec-Bench with SmolLM2-135M (the tune result named by --tune): a larger target accepts
differently on the same prompts, so the table shows what the hardware side predicts, not a
promise. Published figures used (per chip): v5e 819 GB/s HBM, 197 TFLOP/s bf16, 16 GiB,
ICI 1,600 Gb/s; H100 SXM 3.35 TB/s HBM, 989 TFLOP/s dense bf16, 80 GB, NVLink 900 GB/s.
Assumed: MFU 0.5 for the verify GEMMs, alpha (one all-reduce's latency) 10 us on both.
The mesh is tp = 8 (every chip on the model): the smallest batch latency; weights that do not
fit the chips in bf16 are taken as int8 (issue 17's quantized weights), marked in the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from specjax.costmodel import chain_tokens_per_step, throughput

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def params(self) -> float:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.ffn
        return self.layers * (attn + mlp) + 2 * self.vocab * self.hidden


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    chips: int
    hbm_bytes_s: float
    peak_flops: float
    hbm_bytes: float
    link_bytes_s: float


MODELS = (
    Model("Llama-3-8B", 32, 4096, 14336, 32, 8, 128, 128256),
    Model("Llama-3-70B", 80, 8192, 28672, 64, 8, 128, 128256),
)
DEVICES = (
    Device("TPU v5e-8", 8, 819e9, 197e12, 16 * GIB, 1600e9 / 8),
    Device("8x H100 SXM", 8, 3.35e12, 989e12, 80e9, 900e9),
)
MFU = 0.5
ALPHA_S = 10e-6
DRAFT_SHARE = 0.02


def weight_bytes_per_param(model: Model, device: Device) -> int:
    """2 (bf16) when the weights fit the chips with a quarter left for the cache, else 1 (int8)."""
    return 2 if 2 * model.params <= 0.75 * device.chips * device.hbm_bytes else 1


def step_seconds(model: Model, device: Device, batch: int, tokens: int, context: int) -> float:
    """T_target(B, T): one verify step of `tokens` positions per row on tp = chips."""
    weights = model.params * weight_bytes_per_param(model, device)
    cache = batch * context * 2 * model.layers * model.kv_heads * model.head_dim * 2
    memory_s = (weights + cache) / (device.chips * device.hbm_bytes_s)
    compute_s = 2 * model.params * batch * tokens / (device.chips * device.peak_flops * MFU)
    n = device.chips
    reduce_bytes = batch * tokens * model.hidden * 2
    all_reduce_s = ALPHA_S + 2 * (n - 1) / n * reduce_bytes / device.link_bytes_s
    return max(memory_s, compute_s) + model.layers * 2 * all_reduce_s


def best_draft(model, device, batch, context, joint, max_draft=8) -> tuple[int, float, float]:
    """(D, tokens/s at D, plain tokens/s): the D in 0..max_draft the throughput model ranks first."""
    plain_step = step_seconds(model, device, batch, 1, context)
    rates = {
        d: throughput(chain_tokens_per_step(joint, d), batch,
                      step_seconds(model, device, batch, 1 + d, context),
                      DRAFT_SHARE * plain_step if d else 0.0)
        for d in range(max_draft + 1)
    }
    d = max(rates, key=rates.get)
    return d, rates[d], rates[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1024, help="tokens in each row's cache")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--tune", default="benchmarks/results/tune_smollm2_ngram_cpu.json",
                   help="a `specjax tune` result whose calibration holds the joint acceptance")
    args = p.parse_args(argv)
    joint = json.loads(Path(args.tune).read_text())["calibration"]["acceptance"]["joint_acceptance"]
    print("PREDICTED decode tokens/s (roofline + measured n-gram acceptance; see the docstring)")
    print(f"context {args.context}, tp = 8, joint acceptance from {args.tune}\n")
    print("| model | device | weights | batch | plain tok/s | D picked | spec tok/s | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for model in MODELS:
        for device in DEVICES:
            dtype = "bf16" if weight_bytes_per_param(model, device) == 2 else "int8"
            for batch in args.batches:
                d, spec, plain = best_draft(model, device, batch, args.context, joint)
                print(f"| {model.name} | {device.name} | {dtype} | {batch} | {plain:,.0f} | {d} | "
                      f"{spec:,.0f} | {spec / plain:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
