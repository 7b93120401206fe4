"""Learned drafters inside the speculative loop: exactness, losslessness, training pays off.

Every test target here has the same shapes (vocab 16, 2 layers), and every generate call the
same batch (ROWS) and buckets, so one compiled program per drafter serves the greedy, the
statistical and the trained-drafter tests.

- greedy: speculative output == plain greedy output, token for token (f32), rows of different
  prompt lengths, chain and tree, untrained drafters.
- sampling: temperature 0.8, top-k 8, top-p 0.95; the joint distribution of the first two
  generated tokens over SAMPLES rows vs the exact AR joint by chi-square (cells with expected
  count < 5 pooled, `test_accept.chi_square`), pass at p > P_PASS.
- toy target: next token = perm(previous token) (a Llama whose layers add nothing and whose
  head maps embedding x to perm(x)); a head trained briefly on the target's own outputs reaches
  AL >= 0.9 (D + 1), and its training loss falls.
- the training-time test (`ttt_unroll`) computes exactly what the drafter computes at
  inference (same logits for the same tokens).
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import chi_square, tiny_config

from specjax.api import generate_ids
from specjax.drafters.learned.blocks import TargetView
from specjax.drafters.learned.drafting import drafter_params
from specjax.drafters.learned.registry import init_head, make_head_config, make_learned_drafter
from specjax.drafters.learned.sequential import ttt_unroll
from specjax.drafters.registry import make_drafter
from specjax.metrics import job_summary
from specjax.models.cache import init_cache
from specjax.models.llama import forward, init_params
from specjax.sampling import SamplingParams, probabilities
from specjax.train.data import Sequences, self_distill
from specjax.train.trainer import TrainConfig, train
from specjax.tree import chain, k_ary

VOCAB = 16
ROWS = 128  # batch of every generate call (one compiled program per drafter)
MAX_NEW = 12
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [2, 12, 13, 14, 6, 5, 4, 15, 9], [5] * 12]
SAMPLES = 4096
P_PASS = 1e-3
STAT = {"temperature": 0.8, "top_k": 8, "top_p": 0.95}
DEPTH = 3
TREE = k_ary((2, 2, 1), max_nodes=7)

#: kind -> head options for the untrained and trained drafters of the tests
HEAD_OPTIONS = {
    "eagle3": {"ttt_steps": DEPTH},
    "mtp": {"ttt_steps": DEPTH},
    "medusa": {"num_heads": DEPTH},
    "dflash": {"block_size": DEPTH + 1, "num_anchors": 8},
    "dspark": {"block_size": DEPTH + 1, "num_anchors": 8},
}
KINDS = list(HEAD_OPTIONS)


def small_config():
    return tiny_config(vocab_size=VOCAB)


@pytest.fixture(scope="module")
def target():
    cfg = small_config()
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


def toy_target(cfg, seed=0, sharpness=20.0):
    """A target whose greedy next token is perm(previous token): its layers add nothing (zero
    o_proj / down_proj), so every hidden state is the token's embedding e_x (norm sqrt(H)), and
    the head scores y by <e_x, e_{perm^-1(y)}> * sharpness / H."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(cfg.vocab_size)
    emb = rng.normal(size=(cfg.vocab_size, cfg.hidden_size))
    emb *= np.sqrt(cfg.hidden_size) / np.linalg.norm(emb, axis=1, keepdims=True)
    inverse = np.argsort(perm)
    head = emb[inverse].T * sharpness / cfg.hidden_size  # [H, V]: column y = e_{perm^-1(y)}
    p = jax.tree.map(np.asarray, init_params(cfg, jax.random.PRNGKey(seed)))["params"]
    layers = dict(p["layers"])
    layers["self_attn"] = {**layers["self_attn"], "o_proj": {"kernel": np.zeros_like(layers["self_attn"]["o_proj"]["kernel"])}}
    layers["mlp"] = {**layers["mlp"], "down_proj": {"kernel": np.zeros_like(layers["mlp"]["down_proj"]["kernel"])}}
    params = {**p, "layers": layers, "embed_tokens": {"embedding": emb.astype(np.float32)},
              "lm_head": {"kernel": head.astype(np.float32)}}
    return jax.tree.map(jnp.asarray, {"params": params}), perm


@pytest.fixture(scope="module")
def toy():
    cfg = small_config()
    params, perm = toy_target(cfg)
    return cfg, params, perm


def run(cfg, params, prompts, drafter=None, dparams=None, **kwargs):
    kwargs = {"max_new_tokens": MAX_NEW, "eos_ids": (), "batch_size": ROWS, **kwargs}
    return generate_ids(cfg, params, prompts, draft=drafter, drafter_params=dparams, **kwargs)


def untrained(kind, cfg, params, tree, seed=1):
    """(drafter, drafter params) with random head params (EAGLE-3 trees: a reduced vocabulary,
    chains: the same head config as the trained drafters, so they share compiled programs)."""
    options = dict(HEAD_OPTIONS[kind])
    consts = None
    if kind == "eagle3" and not tree.is_chain:
        options["draft_vocab_size"] = 12
        ids = np.sort(np.random.default_rng(seed).choice(VOCAB, 12, replace=False))
        consts = {"draft_to_target": ids}
    head = make_head_config(kind, cfg, **options)
    variables = init_head(head, jax.random.PRNGKey(seed), consts)
    return make_learned_drafter(head, tree), drafter_params(variables, params, head)


@pytest.fixture(scope="module")
def plain(target):
    cfg, params = target
    return [r.token_ids for r in run(cfg, params, PROMPTS)]


# ---- greedy exactness ---------------------------------------------------------------------------


@pytest.mark.parametrize("tree", [chain(DEPTH), TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_plain_greedy(kind, tree, target, plain):
    cfg, params = target
    drafter, dparams = untrained(kind, cfg, params, tree)
    spec = run(cfg, params, PROMPTS, drafter, dparams)
    assert [r.token_ids for r in spec] == plain
    assert all(r.spec["steps"] >= 1 for r in spec)


# ---- statistical losslessness -----------------------------------------------------------------


def exact_first_two(cfg, params, prompt, sampling):
    """`[V, V]` exact joint of the first two sampled tokens after `prompt`."""
    vocab = cfg.vocab_size
    seqs = jnp.asarray([list(prompt) + [a] for a in range(vocab)], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)
    logits = forward(cfg, params, seqs, positions, init_cache(cfg, vocab, seqs.shape[1])).logits
    first = probabilities(logits[0, -2], sampling)  # [V]: p(a | prompt)
    second = probabilities(logits[:, -1], sampling)  # [V, V]: p(b | prompt, a)
    return np.asarray(first[:, None] * second, np.float64)


def sample_first_two(cfg, params, prompt, drafter, dparams, samples):
    out = []
    for seed in range(samples // ROWS):
        res = run(cfg, params, [prompt] * ROWS, drafter, dparams, max_new_tokens=2, seed=seed, **STAT)
        out += [r.token_ids[:2] for r in res]
    return np.asarray(out)


@pytest.mark.parametrize("kind,tree", [(k, chain(DEPTH)) for k in KINDS]
                         + [("eagle3", TREE), ("dspark", TREE)],
                         ids=[f"{k}-chain" for k in KINDS] + ["eagle3-tree", "dspark-tree"])
def test_sampling_is_lossless(kind, tree, target):
    cfg, params = target
    drafter, dparams = untrained(kind, cfg, params, tree)
    prompt = PROMPTS[1]
    joint = exact_first_two(cfg, params, prompt, SamplingParams.make(**STAT))
    samples = sample_first_two(cfg, params, prompt, drafter, dparams, SAMPLES)
    stat, dof, p_value = chi_square(samples, joint)
    assert p_value > P_PASS, (stat, dof, p_value)


# ---- training pays off on a toy target ---------------------------------------------------------


def toy_data(cfg, params, num=64, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(0, cfg.vocab_size, size=rng.integers(2, 12))) for _ in range(num)]
    return self_distill(cfg, params, prompts, max_new_tokens=16, seq_len=28, eos_ids=(),
                        batch_size=ROWS)


@pytest.fixture(scope="module")
def toy_sequences(toy):
    cfg, params, _ = toy
    return toy_data(cfg, params)


TOY_TRAIN = {
    "eagle3": TrainConfig(steps=120, batch_size=8, learning_rate=3e-3, save_every=1000, log_every=10),
    "mtp": TrainConfig(steps=120, batch_size=8, learning_rate=3e-3, save_every=1000, log_every=10),
    "medusa": TrainConfig(steps=300, batch_size=8, learning_rate=1e-2, save_every=1000, log_every=10),
    "dflash": TrainConfig(steps=600, batch_size=8, learning_rate=3e-3, save_every=1000, log_every=10),
    "dspark": TrainConfig(steps=300, batch_size=8, learning_rate=3e-3, save_every=1000, log_every=10),
}


@pytest.mark.parametrize("kind", KINDS)
def test_trained_drafter_on_toy_target(kind, toy, toy_sequences, tmp_path):
    cfg, params, perm = toy
    data: Sequences = toy_sequences
    follows = data.tokens[0, data.prompt_lens[0]: data.lengths[0]]
    assert all(perm[a] == b for a, b in itertools.pairwise(follows)), "toy target is not perm"
    head = make_head_config(kind, cfg, **HEAD_OPTIONS[kind])
    _, log = train(head, params, data, TOY_TRAIN[kind], tmp_path, progress=False)
    assert log[-1]["loss"] < 0.5 * log[0]["loss"], log
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, VOCAB, size=n)) for n in (3, 6, 9, 12)]
    # load it back the way `--draft KIND:DIR` does (drafter.json + the latest checkpoint)
    drafter, dparams = make_drafter(f"{kind}:{tmp_path}", tree=chain(DEPTH), target_cfg=cfg,
                                    target_params=params)
    assert drafter == make_learned_drafter(head, chain(DEPTH))
    res = run(cfg, params, prompts, drafter, dparams)
    al = job_summary([r.spec for r in res])["acceptance_length"]
    assert al >= 0.9 * (DEPTH + 1), (al, log[-1])


# ---- training-time test == inference -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_ttt_matches_drafter_inference(kind, target):
    """The chain the drafter samples right after prefill (temperature 1), fed back as the
    sequence, gets the same distributions from the training-time-test unroll (step k at the
    last prompt index) as the drafter's Draft.probs."""
    from specjax.loop import StopCriteria, init_state, prefill

    cfg, params = target
    head = make_head_config(kind, cfg, ttt_steps=DEPTH)
    variables = init_head(head, jax.random.PRNGKey(3))
    drafter = make_learned_drafter(head, chain(DEPTH))
    dparams = drafter_params(variables, params, head)
    prompt = PROMPTS[2]
    width, bucket = 32, 16
    sampling = SamplingParams.make(1.0)

    @jax.jit
    def draft_after_prefill(params, dparams):
        tokens = jnp.asarray([prompt + [0] * (bucket - len(prompt))])
        state = init_state(tokens, jnp.asarray([len(prompt)]), jnp.asarray([4]),
                           init_cache(cfg, 1, width), jax.random.PRNGKey(0), width)
        state, out = prefill(cfg, params, state, bucket, sampling, StopCriteria.make(),
                             drafter.hidden_layers)
        dstate = drafter.prefill(dparams, drafter.init(dparams, 1, width), state, out)
        draft, _ = drafter.propose(dparams, dstate, state, jax.random.PRNGKey(0), sampling)
        return state.tokens[0, len(prompt)], draft.tokens[0], draft.probs[0]

    @jax.jit
    def ttt_probs(params, variables, tokens):
        positions = jnp.arange(tokens.shape[1])[None]
        tout = forward(cfg, params, tokens, positions, init_cache(cfg, 1, tokens.shape[1]),
                       hidden_layers=head.hidden_layers)
        model, view = drafter.model, TargetView(cfg)
        parts = view.parts(params)
        feats = model.apply(variables, tout.layer_hidden, method="features")
        outs = ttt_unroll(model, variables, feats, lambda t: view.embed(parts, t), tokens, DEPTH)
        t = len(prompt) - 1
        return jnp.stack([jax.nn.softmax(model.apply(variables, o[0, t], parts, method="logits"))
                          for o in outs])

    first, draft, probs = draft_after_prefill(params, dparams)
    seq = jnp.asarray([prompt + [int(first)] + [int(t) for t in draft]], jnp.int32)
    np.testing.assert_allclose(ttt_probs(params, variables, seq), probs, atol=1e-5)


# ---- upstream Hugging Face layouts ---------------------------------------------------------------

UPSTREAM_NAMES = {
    "eagle3": {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
               "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
               "midlayer.post_attention_layernorm.weight",
               *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
               *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))},
    "dflash": {"fc.weight", "hidden_norm.weight", "norm.weight",
               *(f"layers.{i}.{name}.weight" for i in range(2) for name in (
                   "input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
                   "self_attn.k_norm", *(f"self_attn.{p}_proj" for p in "qkvo"),
                   *(f"mlp.{p}_proj" for p in ("gate", "up", "down"))))},
}


def upstream_head(kind, cfg):
    if kind == "eagle3":
        head = make_head_config("eagle3", cfg, draft_vocab_size=12)
        ids = np.sort(np.random.default_rng(0).choice(VOCAB, 12, replace=False))
        return head, init_head(head, jax.random.PRNGKey(5), {"draft_to_target": ids})
    head = make_head_config("dflash", cfg, num_draft_layers=2, block_size=4, mask_token_id=3)
    return head, init_head(head, jax.random.PRNGKey(5))


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_upstream_layout_round_trip(kind, target, tmp_path):
    from safetensors.numpy import load_file

    from specjax.drafters.learned.hf import load_upstream, save_upstream
    from specjax.drafters.registry import make_drafter

    cfg, params = target
    head, variables = upstream_head(kind, cfg)
    folder = save_upstream(head, variables, tmp_path / kind)
    assert set(load_file(str(folder / "model.safetensors"))) == UPSTREAM_NAMES[kind]
    head_back, back = load_upstream(kind, folder, cfg)
    assert head_back == head
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), back, variables))
    drafter, dparams = make_drafter(f"{kind}:{folder}", tree=chain(DEPTH), target_cfg=cfg,
                                    target_params=params)
    assert drafter.head == head and dparams["head"]["params"].keys() == variables["params"].keys()


def test_eagle3_upstream_tensors_mean_what_upstream_means(target, tmp_path):
    """An independent numpy forward of the upstream EAGLE-3 layer, written from its tensors
    ([out, in] weights, [emb; hidden] concatenation, GQA, rotate-half RoPE), equals ours."""
    from safetensors.numpy import load_file

    from specjax.drafters.learned.hf import save_upstream

    cfg, _ = target
    head, variables = upstream_head("eagle3", cfg)
    w = load_file(str(save_upstream(head, variables, tmp_path / "e3") / "model.safetensors"))
    c = head.layer
    rng = np.random.default_rng(0)
    seq, hidden = 5, cfg.hidden_size
    feats = [rng.normal(size=(seq, hidden)).astype(np.float32) for _ in range(3)]
    emb = rng.normal(size=(seq, hidden)).astype(np.float32)

    def rms(x, scale):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c.rms_norm_eps) * scale

    def rope(x):  # [T, heads, Dh]
        inv = 1.0 / c.rope_theta ** (np.arange(0, c.head_dim, 2) / c.head_dim)
        ang = np.arange(seq)[:, None] * inv[None]
        cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
        half = c.head_dim // 2
        return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    h = np.concatenate(feats, -1) @ w["fc.weight"].T
    a = np.concatenate([rms(emb, w["midlayer.input_layernorm.weight"]),
                        rms(h, w["midlayer.hidden_norm.weight"])], -1)
    proj = lambda name, n: (a @ w[f"midlayer.self_attn.{name}_proj.weight"].T).reshape(seq, n, c.head_dim)
    q, k, v = rope(proj("q", c.num_heads)), rope(proj("k", c.num_kv_heads)), proj("v", c.num_kv_heads)
    group = c.num_heads // c.num_kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(c.head_dim)
    scores = np.where(np.tril(np.ones((seq, seq), bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    h = h + np.einsum("hts,shd->thd", probs, v).reshape(seq, -1) @ w["midlayer.self_attn.o_proj.weight"].T
    m = rms(h, w["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
    h = h + (gate / (1 + np.exp(-gate)) * up) @ w["midlayer.mlp.down_proj.weight"].T
    want = rms(h, w["norm.weight"]) @ w["lm_head.weight"].T  # [T, Vd]

    from specjax.drafters.learned.eagle3 import Eagle3Model

    got = Eagle3Model(head).apply(variables, tuple(jnp.asarray(f)[None] for f in feats),
                                  jnp.asarray(emb)[None], jnp.arange(seq)[None])[0]
    target_ids = np.arange(12) + w["d2t"]
    np.testing.assert_allclose(np.asarray(got)[:, target_ids], want, rtol=2e-4, atol=2e-4)


def test_dspark_confidence_sets_each_rows_verified_length(target):
    """Rows verify different numbers of draft tokens: node i is valid iff the product of the
    confidences along its path >= the threshold (a prefix of the chain)."""
    from specjax.loop import StopCriteria, init_state, prefill

    cfg, params = target
    head = make_head_config("dspark", cfg, **HEAD_OPTIONS["dspark"])
    variables = init_head(head, jax.random.PRNGKey(2))
    # a confidence that swings with the previous token (through its codebook row)
    p = variables["params"]
    kernel = np.zeros(p["confidence"]["kernel"].shape, np.float32)
    kernel[cfg.hidden_size:, 0] = 400.0
    variables = {**variables, "params": {**p, "confidence": {"kernel": jnp.asarray(kernel),
                                                           "bias": jnp.asarray([1.0])}}}
    drafter = make_learned_drafter(head, chain(DEPTH), confidence_threshold=0.5)
    dparams = drafter_params(variables, params, head)
    prompts = jnp.asarray([[t, t + 1, 0, 0] for t in range(8)], jnp.int32)
    width, sampling = 16, SamplingParams.make(0.0)

    @jax.jit
    def propose(params, dparams):
        state = init_state(prompts, jnp.full((8,), 2), jnp.full((8,), 4), init_cache(cfg, 8, width),
                           jax.random.PRNGKey(0), width)
        state, out = prefill(cfg, params, state, 4, sampling, StopCriteria.make(), drafter.hidden_layers)
        dstate = drafter.prefill(dparams, drafter.init(dparams, 8, width), state, out)
        draft, _ = drafter.propose(dparams, dstate, state, jax.random.PRNGKey(0), sampling)
        hidden = drafter.block_hidden(dparams, dstate, state.last_token)
        return draft, drafter.node_confidence(dparams, hidden, draft.tokens, state.last_token)

    draft, conf = propose(params, dparams)
    want = np.cumprod(np.asarray(conf), axis=1) >= 0.5
    assert np.array_equal(np.asarray(draft.valid), want)
    lengths = np.asarray(draft.valid).sum(1)
    assert len(set(lengths.tolist())) > 1, lengths
