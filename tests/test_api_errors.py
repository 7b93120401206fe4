"""The Python API's argument checks (a table of bad inputs -> exception and message, all raised
before any model load) and per-prompt sampling keys: a row's tokens depend only on (seed, the
prompt's id), not on the batch size, its position in the job, or a resume."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from helpers import tiny_config, tiny_vocab, write_hf

from specjax.api import PromptError, generate, generate_ids, iter_generate, iter_generate_ids
from specjax.cli import main
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.registry import available_drafters
from specjax.models.llama import init_params
from specjax.options import GenerationConfig
from specjax.tree import chain

# A model name that cannot load: every case below must fail on its arguments first.
UNLOADABLE = "/nonexistent/model/never-loaded"

NOT_A_PROMPT = "must be a str, a chat (list of messages) or a sequence of token ids, got"
NOT_PROMPTS = "prompts must be a str, a chat or a sequence of prompts, got"
KINDS = str(available_drafters())

TEXT_CASES = [
    # (prompts, options, exception, message substring)
    ([123], {}, TypeError, f"prompt 0 {NOT_A_PROMPT} int 123 (one token-id prompt is a list"),
    (None, {}, TypeError, f"{NOT_PROMPTS} NoneType"),
    ([b"hello"], {}, TypeError, f"prompt 0 {NOT_A_PROMPT} bytes"),
    ([{"prompt": "hello"}], {}, TypeError,  # one chat, whose message is not one
     "prompt 0: message 0 must be a mapping with a str 'role' and a str 'content', got dict"),
    ([[{"role": "user", "content": "hi"}, {"role": "user"}]], {}, TypeError, "prompt 0: message 1"),
    ({"prompt": "hello"}, {}, TypeError, f"{NOT_PROMPTS} dict"),
    (b"hello", {}, TypeError, f"{NOT_PROMPTS} bytes"),
    (42, {}, TypeError, f"{NOT_PROMPTS} int"),
    (["fine", None], {}, TypeError, f"prompt 1 {NOT_A_PROMPT} NoneType"),
    (["fine", 5], {"labels": ["in.jsonl:1", "in.jsonl:2"]}, TypeError, f"in.jsonl:2 {NOT_A_PROMPT}"),
    (["fine", [1, 2.5]], {}, TypeError, "prompt 1 has a non-integer token id at position 1"),
    (["fine", "  "], {}, PromptError, "prompt 1 is empty"),
    (["fine", []], {}, PromptError, "prompt 1 is empty"),
    (["a", "b"], {"labels": ["only one"]}, ValueError, "labels has 1 entries for 2 prompts"),
    (["a"], {"batch_size": -1}, ValueError, "batch_size must be an integer >= 1, got -1"),
    (["a"], {"batch_size": 0}, ValueError, "batch_size must be an integer >= 1, got 0"),
    (["a"], {"batch_size": 2.0}, TypeError, "batch_size must be an integer >= 1, got float"),
    (["a"], {"max_new_tokens": 0}, ValueError, "max_new_tokens must be an integer >= 1"),
    (["a"], {"max_new_tokens": 1.5}, TypeError, "max_new_tokens must be an integer"),
    (["a"], {"max_new_tokens": True}, TypeError, "max_new_tokens must be an integer"),
    (["a"], {"seed": 1.5}, TypeError, "seed must be an integer in [0, 4294967296)"),
    (["a"], {"seed": "1"}, TypeError, "seed must be an integer"),
    (["a"], {"seed": -1}, ValueError, "seed must be an integer in [0, 4294967296), got -1"),
    (["a"], {"seed": 2**40}, ValueError, "seed must be an integer in [0, 4294967296)"),
    (["a"], {"max_len": 0}, ValueError, "max_len must be an integer >= 1"),
    (["a"], {"draft": "nope"}, ValueError, f"unknown drafter 'nope'; choose from {KINDS}"),
    (["a"], {"draft": 42}, ValueError, f"draft must be a drafter spec (one of {KINDS}"),
    (["a"], {"draft": NgramDrafter}, ValueError, "draft must be a drafter spec"),
    (["a"], {"draft": "ngram:abc"}, ValueError, "ngram: expected N or A-B"),
    (["a"], {"draft": "ngram", "num_draft": 0}, ValueError, "num_draft must be in [1, 64]"),
    (["a"], {"draft": "ngram", "num_draft": 2, "tree": "chain4"}, ValueError, "not both"),
    (["a"], {"draft": "ngram", "tree": "no_such_tree"}, ValueError, "unknown tree 'no_such_tree'"),
    (["a"], {"num_draft": 2}, ValueError, "give draft= too"),
    (["a"], {"draft": "ngram", "drafter_params": {}}, ValueError, "drop drafter_params="),
    (["a"], {"draft": (NgramDrafter(tree=chain(2)), None), "drafter_params": {}}, ValueError, "carries its params"),
    (["a"], {"config": GenerationConfig(temperature=0.5), "max_new_tokens": 4}, ValueError,
     "max_new_tokens given both in config= and as keyword arguments"),
    (["a"], {"config": {"temperature": 0.5}}, TypeError, "config must be a specjax.GenerationConfig"),
    (["a"], {"config": GenerationConfig(), "top_p": 2.0, "stop": "x"}, ValueError, "stop, top_p given both"),
    (["a"], {"seed": 1, "key": jax.random.PRNGKey(0)}, ValueError, "give seed= or key=, not both"),
    (["a"], {"key": 5}, TypeError, "key must be a JAX PRNG key"),
    (["a"], {"key": np.zeros(3, np.uint32)}, ValueError, "raw shape (3,)"),
    (["a"], {"eos_ids": ["x"]}, TypeError, "eos_ids[0] must be an integer token id, got str"),
    (["a"], {"dtype": "float64"}, ValueError, "unsupported dtype 'float64'"),
    (["a"], {"prompt_ids": [1.5]}, TypeError, "prompt_ids[0] must be an int or a str, got float"),
    (["a"], {"prompt_ids": [1, 2]}, ValueError, "prompt_ids has 2 entries for 1 prompts"),
    (["a"], {"prompt_ids": "a"}, TypeError, "prompt_ids must be a sequence of ints or strs"),
    (["a"], {"stop": [1]}, TypeError, "stop[0] must be a str, got int"),
    (["a"], {"temperature": -1.0}, ValueError, "temperature"),
    (["a"], {"top_p": 0.0}, ValueError, "top_p"),
]


@pytest.mark.parametrize("prompts,options,error,message", TEXT_CASES,
                         ids=[f"{i}-{c[3][:30]}" for i, c in enumerate(TEXT_CASES)])
def test_text_api_refuses_bad_arguments_before_loading(prompts, options, error, message):
    options = options if "config" in options else {"max_new_tokens": 4, **options}
    with pytest.raises(error) as info:
        generate(UNLOADABLE, prompts, **options)
    assert message in str(info.value)
    with pytest.raises(error):  # at the call, not at the first batch
        iter_generate(UNLOADABLE, prompts, **options)


def test_text_api_refuses_a_model_that_is_not_one():
    with pytest.raises(TypeError, match="model must be a name, a path or a loaded model"):
        generate(object(), ["hello"], max_new_tokens=4)


ID_CASES = [
    ([[1, 2.0]], {}, TypeError, "prompt 0 has a non-integer token id at position 1: float 2.0"),
    ([[1, 3.7]], {}, TypeError, "non-integer token id at position 1: float 3.7"),
    ([[np.float32(3)]], {}, TypeError, "non-integer token id at position 0: float32"),
    ([np.array([1.0, 2.0])], {}, TypeError, "prompt 0 must be a 1-D array of integer token ids"),
    ([np.array([[1, 2]])], {}, TypeError, "must be a 1-D array of integer token ids, got a 2-D"),
    ([[True, 2]], {}, TypeError, "non-integer token id at position 0: bool"),
    (["hello"], {}, TypeError, "prompt 0 must be a sequence of integer token ids, got str"),
    ([b"hello"], {}, TypeError, "prompt 0 must be a sequence of integer token ids, got bytes"),
    ([5], {}, TypeError, "prompt 0 must be a sequence of integer token ids, got int 5"),
    ([[1], {"ids": [1]}], {}, TypeError, "prompt 1 must be a sequence of integer token ids, got dict"),
    (None, {}, TypeError, "prompts must be a sequence of token-id sequences, got NoneType"),
    ([[1, 2]], {"labels": ["row-a"], "batch_size": -1}, ValueError, "batch_size must be an integer >= 1"),
    ([[]], {}, PromptError, "prompt 0 is empty"),
    ([[1, 999]], {}, PromptError, "outside the vocabulary [0, 64): [999]"),
    ([[1, -3]], {"labels": ["row-a"]}, PromptError, "row-a has token ids outside the vocabulary"),
    ([[1] * 28], {"max_len": 32}, PromptError, "needs 36 cache entries, more than max_len=32"),
    # 20 prompt + 8 new + 5 (a chain of 4 drafts and the root) > 32
    ([[1] * 20], {"max_len": 32, "draft": NgramDrafter(tree=chain(4))}, PromptError,
     "with max_new_tokens=8 + 5 for drafting it needs 33 cache entries, more than max_len=32"),
    ([[1] * 20], {"max_len": 32, "draft": "ngram"}, PromptError, "+ 9 for drafting"),  # auto: chains up to 8
    ([[1] * 23], {"max_len": 32, "draft": "ngram", "num_draft": 1}, PromptError, "+ 2 for drafting"),
    ([[1]], {"draft": "ngram", "drafter": NgramDrafter(tree=chain(4))}, ValueError, "give draft= only"),
    ([[1]], {"config": GenerationConfig(stop="x")}, ValueError, "stop strings need the tokenizer"),
]


@pytest.mark.parametrize("prompts,options,error,message", ID_CASES,
                         ids=[f"{i}-{c[3][:30]}" for i, c in enumerate(ID_CASES)])
def test_id_api_refuses_bad_arguments(tiny_model, prompts, options, error, message):
    cfg, params = tiny_model
    options = options if "config" in options else {"max_new_tokens": 8, **options}
    with pytest.raises(error) as info:
        iter_generate_ids(cfg, params, prompts, **options)  # raised at the call
    assert message in str(info.value)


def test_id_api_takes_numpy_integer_ids(tiny_model):
    cfg, params = tiny_model
    as_lists = generate_ids(cfg, params, [[5, 6, 7], [9, 10]], max_new_tokens=4, eos_ids=[])
    as_numpy = generate_ids(cfg, params, [np.array([5, 6, 7], np.int64), [np.int32(9), np.uint8(10)]],
                            max_new_tokens=4, eos_ids=[])
    assert [r.token_ids for r in as_numpy] == [r.token_ids for r in as_lists]
    # the draft margin is only counted with a drafter: 20 + 8 fits max_len=32
    assert len(generate_ids(cfg, params, [[1] * 20], max_new_tokens=8, max_len=32)) == 1


# ---- per-prompt sampling keys ----------------------------------------------------------------

PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [7, 8, 9, 7, 8, 9], [10, 11, 12], [13, 14, 13, 14, 13], [20, 21]]
MODES = {"ar": {}, "ngram": {"draft": NgramDrafter(tree=chain(3))}}


def sampled(model, prompts, mode: str, **options) -> list[list[int]]:
    cfg, params = model
    results = generate_ids(cfg, params, prompts, max_new_tokens=10, temperature=0.8, seed=7,
                           eos_ids=[], **MODES[mode], **options)
    return [r.token_ids for r in results]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_rows_samples_depend_only_on_seed_and_prompt_id(tiny_model, mode):
    full = sampled(tiny_model, PROMPTS, mode, batch_size=4)
    assert sampled(tiny_model, PROMPTS, mode, batch_size=1) == full
    order = [4, 2, 0, 3, 1]
    moved = sampled(tiny_model, [PROMPTS[i] for i in order], mode, batch_size=2, prompt_ids=order)
    assert moved == [full[i] for i in order]
    # a resumed job: the remaining rows with their original ids
    rest = [1, 3, 4]
    assert sampled(tiny_model, [PROMPTS[i] for i in rest], mode, prompt_ids=rest) == [full[i] for i in rest]
    # string ids are as stable; another seed or id samples something else
    names = ["a", "b", "c", "d", "e"]
    by_name = sampled(tiny_model, PROMPTS, mode, batch_size=4, prompt_ids=names)
    assert sampled(tiny_model, PROMPTS[::-1], mode, batch_size=2, prompt_ids=names[::-1]) == by_name[::-1]
    assert by_name != full


def test_rows_with_the_same_prompt_sample_independently(tiny_model):
    rows = sampled(tiny_model, [[3, 4]] * 4, "ar", batch_size=4)
    assert len({tuple(r) for r in rows}) > 1


def test_greedy_ignores_the_prompt_ids(tiny_model):
    cfg, params = tiny_model
    plain = generate_ids(cfg, params, PROMPTS[:3], max_new_tokens=6, eos_ids=[])
    with_ids = generate_ids(cfg, params, PROMPTS[:3], max_new_tokens=6, eos_ids=[],
                            prompt_ids=["x", 17, 2**40])
    assert [r.token_ids for r in with_ids] == [r.token_ids for r in plain]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = tiny_config(vocab_size=len(tiny_vocab()[0]))
    return str(write_hf(tmp_path_factory.mktemp("tiny_hf"), cfg, init_params(cfg, jax.random.PRNGKey(0))))


def test_cli_resume_with_sampling_gives_the_uninterrupted_rows(tiny_dir, tmp_path):
    rows = [{"prompt": "hello world"}, {"id": "x", "prompt": "the cat"}, {"prompt": "one more"},
            {"id": 7, "prompt": "and the last"}, {"prompt": "fifth"}]
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run(out, *extra):
        args = ["generate", "--model", tiny_dir, "--prompts", str(prompts), "--out", str(out),
                "--max-new-tokens", "6", "--temperature", "0.8", "--seed", "3", "--no-chat", *extra]
        assert main(args) == 0
        return {json.loads(line)["id"]: json.loads(line)["token_ids"]
                for line in out.read_text().splitlines()}

    whole = run(tmp_path / "whole.jsonl", "--batch-size", "4")
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(line + "\n" for line in (tmp_path / "whole.jsonl").read_text().splitlines()[:2]))
    assert run(cut, "--batch-size", "2", "--resume") == whole
