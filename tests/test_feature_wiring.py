"""Feature wiring, per learned-head kind: the target features (and tokens) a head holds while
generating equal the ones its training loss computes for the same positions.

A random 4-layer target and a random head of each kind decode a batch of prompts of different
lengths for a fixed number of speculative steps. Acceptance is forced to a per-node profile
(`drafters.forced.accept_forced`, so steps accept 0..D draft tokens: every branch of the
drafter's `update` runs, not only the all-rejected one a random head would give). Then the
final committed sequences are run through the training path (`objectives.target_pass`, the
kind's feature / context functions, `ttt_unroll` / `anchored_blocks`) and compared with the
drafter's state, position by position:

- EAGLE-3 / MTP: the draft KV cache entry j (feature of position j, token j + 1) == the
  training-time-test step-0 keys/values at index j, for every committed j; the state's last
  output == TTT step 0's output at the last committed index (what the root's children are
  drafted from).
- DFlash / DSpark: the context cache entry j == the training context K/V at position j; the
  block hidden states drafted after the root == `anchored_blocks` with the anchor at the
  root's position.
- Medusa: the state's hidden == the target's final hidden state at the root's predecessor.

An off-by-one in any of those paths (a token or a feature row shifted by one, a position off
by one) changes these values; see `test_a_planted_off_by_one_is_caught`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config

from specjax.drafters.forced import accept_forced
from specjax.drafters.learned import sequential
from specjax.drafters.learned.blocks import TargetView, shift_left
from specjax.drafters.learned.dflash import anchored_blocks
from specjax.drafters.learned.drafting import drafter_params
from specjax.drafters.learned.objectives import target_pass
from specjax.drafters.learned.registry import init_head, make_head_config, make_learned_drafter
from specjax.loop import StopCriteria, spec_start, spec_step
from specjax.models.cache import init_cache
from specjax.models.llama import Llama, init_params
from specjax.sampling import SamplingParams
from specjax.tree import chain, k_ary

VOCAB = 32
DEPTH = 3
STEPS = 6
PASS = 0.7  # forced per-node acceptance
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11, 12], [2, 12, 13, 14, 6, 5, 4, 15, 9], [5] * 11]
HEAD_OPTIONS = {
    "eagle3": {"ttt_steps": DEPTH},
    "mtp": {"ttt_steps": DEPTH},
    "medusa": {"num_heads": DEPTH},
    "dflash": {"block_size": DEPTH + 1, "num_draft_layers": 2},
    "dspark": {"block_size": DEPTH + 1},
}
TREES = {"chain": chain(DEPTH), "tree": k_ary((2, 2, 1), max_nodes=7)}


def forced(drafter):
    """The same drafter with acceptance forced to PASS per node (its propose / update run as
    they are; only which draft nodes are accepted is drawn)."""

    class Forced(type(drafter)):
        def accept(self, params, key, target_logits, draft, sampling):
            depth = jnp.full((self.tree.max_depth,), PASS, jnp.float32)
            return accept_forced(key, target_logits, draft, self.tree, sampling, depth)

    fields = [f for f in dataclasses.fields(drafter) if f.init]
    return Forced(**{f.name: getattr(drafter, f.name) for f in fields})


@pytest.fixture(scope="module")
def target():
    cfg = tiny_config(vocab_size=VOCAB, num_layers=4)
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


def decode(cfg, params, drafter, dparams):
    """(decode state, drafter state) after prefill + STEPS speculative steps (no row ends)."""
    batch, bucket = len(PROMPTS), 16
    width = bucket + 64
    tokens = jnp.asarray([p + [0] * (bucket - len(p)) for p in PROMPTS], jnp.int32)
    lens = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    sampling, criteria = SamplingParams.make(0.0), StopCriteria.make()

    @jax.jit
    def run(params, dparams):
        target = Llama(cfg)
        state, dstate, metrics = spec_start(
            target, params, drafter, dparams, tokens, lens, jnp.full((batch,), 48, jnp.int32),
            init_cache(cfg, batch, width), jax.random.PRNGKey(1), sampling, criteria, width=width)

        def body(_, carry):
            return spec_step(target, params, drafter, dparams, *carry, sampling, criteria)

        state, dstate, metrics = jax.lax.fori_loop(0, STEPS, body, (state, dstate, metrics))
        return state, dstate

    return run(params, dparams)


def setup(kind, tree_name, target):
    cfg, params = target
    head = make_head_config(kind, cfg, **HEAD_OPTIONS[kind])
    variables = init_head(head, jax.random.PRNGKey(2))
    drafter = forced(make_learned_drafter(head, TREES[tree_name]))
    dparams = drafter_params(variables, params, head)
    state, dstate = decode(cfg, params, drafter, dparams)
    committed = np.asarray(state.cache.lengths)
    assert np.all(np.asarray(state.num_tokens) - 1 == committed)  # the root is not in the cache
    # prefill + STEPS steps commit 1 + STEPS tokens with nothing accepted: more means accepted drafts
    assert np.all(committed - np.asarray([len(p) for p in PROMPTS]) > STEPS + 1), committed
    tout = target_pass(cfg, params, state.tokens, head.hidden_layers)  # the training forward
    return head, drafter, dparams, state, dstate, tout, committed


def close(a, b, committed, what):
    """a, b `[B, S, ...]`: equal on each row's first committed[b] entries."""
    for row, n in enumerate(committed):
        np.testing.assert_allclose(np.asarray(a)[row, :n], np.asarray(b)[row, :n], atol=2e-5,
                                   rtol=2e-5, err_msg=f"{what}, row {row}")


def unpacked(head, drafter, dparams, state):
    """(head module, its variables, the target's params, the target view, tokens `[B, W]`,
    positions `[B, W]`) that a wiring check reads."""
    tokens = state.tokens
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return drafter.model, dparams["head"], dparams["target"], TargetView(head.target), tokens, positions


def check_sequential(head, drafter, dparams, state, dstate, tout, committed):
    model, variables, parts, view, tokens, positions = unpacked(head, drafter, dparams, state)
    feats = model.apply(variables, tout.layer_hidden, method="features")
    # step 0 of the training-time test at index j: feature j, token j + 1, position j
    _, k, v, _ = model.apply(variables, feats, view.embed(parts, shift_left(tokens, 1)), positions,
                             method="cell_qkv")
    cache_k, cache_v = dstate.cache.layer_kv(0)
    close(cache_k, k, committed, "draft cache keys vs training step-0 keys")
    close(cache_v, v, committed, "draft cache values vs training step-0 values")
    outs = sequential.ttt_unroll(model, variables, feats, lambda t: view.embed(parts, t), tokens, 1)
    last = np.asarray(outs[0])[np.arange(len(committed)), committed - 1]
    np.testing.assert_allclose(np.asarray(dstate.last), last, atol=2e-5, rtol=2e-5,
                               err_msg="state.last vs the training output at the last committed index")


def check_block(head, drafter, dparams, state, dstate, tout, committed):
    model, variables, parts, view, tokens, positions = unpacked(head, drafter, dparams, state)
    context = model.apply(variables, tout.layer_hidden, method="context")
    k, v = model.apply(variables, context, positions, method="context_kv")  # [Ld, B, T, ...]
    cache_k, cache_v = dstate.cache.token_major()
    for layer in range(k.shape[0]):
        close(cache_k[layer], k[layer], committed, f"context keys, draft layer {layer}")
        close(cache_v[layer], v[layer], committed, f"context values, draft layer {layer}")
    anchors = jnp.asarray(committed, jnp.int32)[:, None]  # the root's position
    trained = anchored_blocks(model, variables, tout.layer_hidden, lambda t: view.embed(parts, t),
                              tokens, anchors, jnp.ones_like(anchors, bool))[:, 0, head.predict_offset:]
    served = drafter.block_hidden(dparams, dstate, state.last_token)
    np.testing.assert_allclose(np.asarray(served), np.asarray(trained), atol=2e-5, rtol=2e-5,
                               err_msg="drafted block vs the training block at the root")


def check_medusa(head, drafter, dparams, state, dstate, tout, committed):
    want = np.asarray(tout.hidden)[np.arange(len(committed)), committed - 1]
    np.testing.assert_allclose(np.asarray(dstate.hidden), want, atol=2e-5, rtol=2e-5,
                               err_msg="Medusa state vs the final hidden of the root's predecessor")


CHECKS = {"eagle3": check_sequential, "mtp": check_sequential, "medusa": check_medusa,
          "dflash": check_block, "dspark": check_block}


@pytest.mark.parametrize(("kind", "tree_name"), [*((k, "chain") for k in CHECKS), ("eagle3", "tree")])
def test_served_features_equal_trained_features(kind, tree_name, target):
    """(A tree exercises the accepted path's non-contiguous verify rows; one compile each.)"""
    CHECKS[kind](*setup(kind, tree_name, target))


# ---- the check can fail -----------------------------------------------------------------------


def _shifted_update_tokens(self, params, state, decode, result, target_out):
    """SequentialDrafter.update with the next tokens read one place early (an off-by-one)."""
    from specjax.drafters.learned.drafting import accepted_rows, gather_tokens

    rows = tuple(accepted_rows(h, result) for h in target_out.layer_hidden)
    features = self._call(params, "features", rows)
    tokens = gather_tokens(decode.tokens, state.cache.lengths, features.shape[1])  # planted
    return self._ingest(params, state, features, tokens, result.num_accepted, decode.cache.lengths)


def _shifted_block_rows(self, params, state, decode, result, target_out):
    """BlockDrafter.update ingesting the rows after the accepted path's (an off-by-one)."""
    from specjax.drafters.learned.drafting import accepted_rows

    rows = tuple(accepted_rows(jnp.roll(h, -1, axis=1), result) for h in target_out.layer_hidden)
    return self._ingest(params, state, rows, decode.cache.lengths)


def _shifted_medusa_row(self, params, state, decode, result, target_out):
    """MedusaDrafter.update keeping the row before the root's predecessor (an off-by-one)."""
    from specjax.drafters.learned.drafting import accepted_rows
    from specjax.drafters.learned.medusa import MedusaState
    from specjax.gather import take_rows

    rows = accepted_rows(target_out.hidden, result)
    return MedusaState(hidden=take_rows(rows, jnp.maximum(result.num_accepted - 1, 0)))


PLANTS = {
    "eagle3": ("specjax.drafters.learned.sequential.SequentialDrafter", _shifted_update_tokens),
    "dflash": ("specjax.drafters.learned.dflash.BlockDrafter", _shifted_block_rows),
    "medusa": ("specjax.drafters.learned.medusa.MedusaDrafter", _shifted_medusa_row),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(PLANTS))
def test_a_planted_off_by_one_is_caught(kind, target, monkeypatch):
    """Each family's update with one index shifted fails the wiring check."""
    import importlib

    where, update = PLANTS[kind]
    module, cls = where.rsplit(".", 1)
    monkeypatch.setattr(getattr(importlib.import_module(module), cls), "update", update)
    with pytest.raises(AssertionError):
        CHECKS[kind](*setup(kind, "chain", target))
