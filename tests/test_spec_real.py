"""Speculative == plain greedy, token for token, on the real SmolLM2-135M (f32).

Every drafter x {chain, tree} x {batch 1, batch 4 with different prompt lengths}, plus EOS, a
stop sequence and max_new_tokens landing inside an accepted block (draft model = the target,
so every block is accepted whole and the cut must happen mid-block).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specjax.api import generate_ids
from specjax.drafters.registry import make_drafter
from specjax.tree import chain, k_ary

pytestmark = pytest.mark.real

SPEC_BENCH = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "spec_bench" / "question.jsonl"
MAX_NEW = 24
TREES = {"chain": chain(3), "tree": k_ary((2, 1, 1))}
DRAFTERS = ["ngram", "suffix", "layerskip:6", "model:smollm2-135m"]


@pytest.fixture(scope="module")
def prompts(smollm2):
    texts = [
        "Summarize: The cat sat on the mat. The cat sat on the mat because the mat was warm.",
        "List the first five prime numbers.",
    ]
    if SPEC_BENCH.exists():
        rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines()]
        texts += [r["turns"][0][:400] for r in rows if r["category"] in ("summarization", "qa")][:2]
    ids = [smollm2.tokenizer.encode_chat(t) for t in texts[:4]]
    assert len({len(i) for i in ids}) > 1, "the batch must have different prompt lengths"
    return ids


@pytest.fixture(scope="module")
def plain(smollm2, prompts):
    results = generate_ids(smollm2.cfg, smollm2.params, prompts, max_new_tokens=MAX_NEW, eos_ids=[])
    return [r.token_ids for r in results]


def _spec(model, prompts, spec, tree, **kwargs):
    drafter, drafter_params = make_drafter(spec, tree=tree, target=model)
    kwargs.setdefault("eos_ids", [])
    return generate_ids(
        model.cfg, model.params, prompts, max_new_tokens=kwargs.pop("max_new_tokens", MAX_NEW),
        draft=drafter, drafter_params=drafter_params, **kwargs,
    )


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("spec", DRAFTERS)
def test_greedy_speculative_equals_plain(smollm2, prompts, plain, spec, tree_name):
    batch4 = _spec(smollm2, prompts, spec, TREES[tree_name])
    assert [r.token_ids for r in batch4] == plain
    batch1 = _spec(smollm2, prompts[:1], spec, TREES[tree_name], batch_size=1)
    assert batch1[0].token_ids == plain[0]
    if spec.startswith("model:"):  # the target drafting for itself accepts everything
        for r in batch4:
            assert r.spec["acceptance_rate"] >= 0.99
            assert r.spec["acceptance_length"] >= 0.99 * (TREES[tree_name].max_depth + 1) - 0.5


def test_eos_stop_and_length_inside_accepted_blocks(smollm2, prompts, plain):
    tree = chain(3)
    # a token first emitted mid-block: blocks are token 0 (prefill), then 1-4, 5-8, ...
    first_eos = next(i for i in range(2, MAX_NEW) if plain[0].index(plain[0][i]) == i and (i - 1) % 4 in (1, 2))
    eos = plain[0][first_eos]
    got = _spec(smollm2, prompts[:1], "model:smollm2-135m", tree, eos_ids=[eos], batch_size=1)[0]
    assert got.token_ids == plain[0][: first_eos + 1] and got.stop_reason == "eos"
    stop = plain[1][6:8]
    first_stop = next(i for i in range(MAX_NEW) if plain[1][i : i + 2] == stop)
    got = _spec(smollm2, prompts[1:2], "model:smollm2-135m", tree, stop_token_seqs=[stop], batch_size=1)[0]
    assert got.token_ids == plain[1][: first_stop + 2] and got.stop_reason == "stop"
    got = _spec(smollm2, prompts[:1], "model:smollm2-135m", tree, max_new_tokens=6, batch_size=1)[0]
    assert got.token_ids == plain[0][:6] and got.stop_reason == "length"
    assert got.spec["steps"] == 2  # 4 tokens per step: the second block is cut after 1 token
