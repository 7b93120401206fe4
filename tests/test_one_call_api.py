"""The one-call API: `draft=` as a spec string, a Drafter or a (drafter, params) pair; a frozen
GenerationConfig in place of loose options; `key=` beside `seed=`; prompts as text, chats or
token ids; dtype "auto"."""
from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import jax
import pytest
from helpers import tiny_config, tiny_tokenizer, tiny_vocab, write_hf

import specjax
from specjax.drafters.ngram import NgramDrafter
from specjax.loop import (
    ar_finish_program,
    ar_start_program,
    spec_finish_program,
    spec_start_program,
)
from specjax.models import config as model_config
from specjax.models.hub import LoadedModel, load_model
from specjax.models.llama import init_params
from specjax.refill import refill_program
from specjax.tree import chain, load_tree

PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3], [7, 8, 9, 7, 8, 9], [10, 11, 12]]


def token_ids(results) -> list[list[int]]:
    return [r.token_ids for r in results]


def test_every_form_of_draft_is_greedy_exact(tiny_model):
    cfg, params = tiny_model
    plain = token_ids(specjax.generate_ids(cfg, params, PROMPTS, max_new_tokens=12, eos_ids=()))
    forms = {  # equal drafters share one compiled program: three compiles in all
        "spec": {"draft": "ngram"},
        "Drafter": {"draft": NgramDrafter(tree=chain(4))},
        "(drafter, params)": {"draft": (NgramDrafter(tree=chain(4)), None)},
        "spec + num_draft": {"draft": "ngram", "num_draft": 2},
        "spec + tree": {"draft": "ngram", "tree": "kary_2x2x2"},
        "Drafter reshaped": {"draft": NgramDrafter(tree=chain(2)), "tree": load_tree("kary_2x2x2")},
    }
    for name, form in forms.items():
        results = specjax.generate_ids(cfg, params, PROMPTS, max_new_tokens=12, eos_ids=(), **form)
        assert token_ids(results) == plain, name
        assert all(r.spec is not None for r in results), name


def test_a_bad_draft_fails_before_anything_compiles(tiny_model):
    cfg, params = tiny_model
    programs = (ar_start_program, ar_finish_program, spec_start_program, spec_finish_program,
                refill_program)
    compiled = [program._cache_size() for program in programs]
    for bad in ("nope", "ngram:x", 3.5, ("ngram", None)):
        with pytest.raises(ValueError) as info:
            specjax.generate_ids(cfg, params, PROMPTS, max_new_tokens=4, draft=bad)
        if bad != "ngram:x":
            assert all(kind in str(info.value) for kind in specjax.available_drafters())
    assert [program._cache_size() for program in programs] == compiled


def test_generation_config_in_place_of_loose_options(tiny_model):
    cfg, params = tiny_model
    config = specjax.GenerationConfig(max_new_tokens=10, temperature=0.9, top_k=20, eos_ids=[])
    loose = specjax.generate_ids(cfg, params, PROMPTS, max_new_tokens=10, temperature=0.9, top_k=20,
                                 eos_ids=[], seed=3, draft="ngram")
    configured = specjax.generate_ids(cfg, params, PROMPTS, config=config, seed=3, draft="ngram")
    assert token_ids(configured) == token_ids(loose)
    assert config.eos_ids == () and config.stop == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.temperature = 0.0
    assert specjax.GenerationConfig(stop="###").stop == ("###",)
    for bad in ({"max_new_tokens": 0}, {"top_p": 0.0}, {"temperature": float("nan")}, {"top_k": -1}):
        with pytest.raises(ValueError):
            specjax.GenerationConfig(**bad)


def test_key_beside_seed(tiny_model):
    cfg, params = tiny_model

    def sampled(**key_or_seed):
        return token_ids(specjax.generate_ids(cfg, params, PROMPTS, max_new_tokens=8, temperature=1.0,
                                              eos_ids=(), draft="ngram", **key_or_seed))

    by_seed = sampled(seed=7)
    assert sampled(key=jax.random.PRNGKey(7)) == by_seed
    assert sampled(key=jax.random.key(7)) == by_seed  # a typed key
    assert sampled(key=jax.random.PRNGKey(8)) != by_seed


@pytest.fixture(scope="module")
def text_model():
    cfg = tiny_config(vocab_size=len(tiny_vocab()[0]), eos_token_ids=())
    return LoadedModel(cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(0)),
                       tokenizer=tiny_tokenizer(), source=Path("tiny"))


def test_prompts_as_text_chats_and_token_ids(text_model):
    tokenizer = text_model.tokenizer
    conversation = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"},
                    {"role": "user", "content": "on what"}]
    ids = tokenizer.encode("hello world")
    prompts = ["hello world", [{"role": "user", "content": "hello world"}], conversation, ids]
    config = specjax.GenerationConfig(max_new_tokens=6, eos_ids=())
    out = specjax.generate(text_model, prompts, config=config, draft="ngram")
    by_ids = specjax.generate_ids(text_model.cfg, text_model.params,
                                  [tokenizer.encode_chat("hello world"), tokenizer.encode_chat(conversation), ids],
                                  config=config)
    assert [g.token_ids for g in out] == [by_ids[0].token_ids, by_ids[0].token_ids,
                                          by_ids[1].token_ids, by_ids[2].token_ids]
    assert [g.prompt for g in out] == prompts
    assert out[0].completion == tokenizer.decode(out[0].token_ids)
    # one bare chat is one prompt, like one bare str
    (single,) = specjax.generate(text_model, conversation, config=config)
    assert single.token_ids == out[2].token_ids


def test_dtype_auto(monkeypatch, tmp_path):
    assert inspect.signature(specjax.load).parameters["dtype"].default == "auto"
    assert inspect.signature(specjax.iter_generate).parameters["dtype"].default == "auto"
    assert model_config.resolve_dtype("auto") == "float32"  # the tests run on CPU
    monkeypatch.setattr(model_config.jax, "default_backend", lambda: "gpu")
    assert model_config.resolve_dtype("auto") == "bfloat16"
    monkeypatch.undo()
    cfg = tiny_config(vocab_size=len(tiny_vocab()[0]))
    folder = write_hf(tmp_path, cfg, init_params(cfg, jax.random.PRNGKey(0)))
    assert load_model(folder, dtype="auto").cfg.dtype == "float32"
    assert specjax.load(str(folder), dtype="bfloat16").cfg.dtype == "bfloat16"
