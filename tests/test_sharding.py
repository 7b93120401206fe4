"""One host, many devices (`specjax.sharding`): the mesh string, the partition rules, loading
straight into shards, and generation on 8 fake CPU devices equal to one device.

The multi-device cases run once, in a subprocess (tests/sharding_worker.py) that sets
`--xla_force_host_platform_device_count=8` before it imports jax (this process has one device);
the module-scoped fixture returns its JSON and each test asserts on its part.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import tiny_config
from jax.sharding import PartitionSpec as P

from specjax.errors import InputError
from specjax.measure.hlo import dims_key, loop_collectives, whole_gathers
from specjax.models.llama import init_params
from specjax.sharding import (
    LLAMA_RULES,
    SMALL_LEAF_BYTES,
    MeshSpec,
    fallback_spec,
    llama_param_shapes,
    make_mesh,
    parse_mesh,
    partition_specs,
    rule_spec,
)

WORKER = Path(__file__).resolve().parent / "sharding_worker.py"
MESHES = ("dp=8", "tp=8", "dp=2,tp=4")


# ---- the mesh string ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, spec", [
    ("dp=2,tp=4", MeshSpec(2, 4)), ("tp=8", MeshSpec(1, 8)), ("dp=8", MeshSpec(8, 1)),
    (" tp = 4 , dp = 2 ", MeshSpec(2, 4)), ("auto", MeshSpec(8, 1)),
])
def test_parse_mesh(text, spec):
    assert parse_mesh(text, num_devices=8) == spec


@pytest.mark.parametrize("text, message", [
    ("dp=2,xp=4", r"^mesh 'dp=2,xp=4': 'xp=4' is not dp=N or tp=N \(axes: dp, tp; or 'auto'\)$"),
    ("dp=0,tp=8", r"^mesh 'dp=0,tp=8': dp must be a positive integer, got '0'$"),
    ("dp=-2", r"^mesh 'dp=-2': dp must be a positive integer, got '-2'$"),
    ("dp=2,dp=4", r"^mesh 'dp=2,dp=4': axis dp given twice$"),
    ("dp=2,tp=2", r"^mesh 'dp=2,tp=2' needs dp\*tp = 4 devices, 8 available$"),
    ("dp=4,tp=4", r"^mesh 'dp=4,tp=4' needs dp\*tp = 16 devices, only 8 available$"),
    ("tp", r"is not dp=N or tp=N"),
])
def test_parse_mesh_errors_name_the_problem(text, message):
    with pytest.raises(InputError, match=message):
        parse_mesh(text, num_devices=8)


def test_make_mesh_axes():
    mesh = make_mesh(MeshSpec(1, 1))
    assert mesh.axis_names == ("dp", "tp") and mesh.devices.shape == (1, 1)
    with pytest.raises(InputError, match=r"^mesh dp=2,tp=1 needs 2 devices, only 1 available$"):
        make_mesh(MeshSpec(2, 1))


# ---- the rules ------------------------------------------------------------------------------------

#: the layout the rules must give, written out by hand per leaf (the simple reference)
EXPECTED = {
    "params/embed_tokens/embedding": P("tp", None),
    "params/lm_head/kernel": P(None, "tp"),
    "params/norm/scale": P(),
    "params/layers/input_layernorm/scale": P(),
    "params/layers/post_attention_layernorm/scale": P(),
    "params/layers/self_attn/q_norm/scale": P(),
    "params/layers/self_attn/k_norm/scale": P(),
    "params/layers/self_attn/q_proj/kernel": P(None, None, "tp"),
    "params/layers/self_attn/k_proj/kernel": P(None, None, "tp"),
    "params/layers/self_attn/v_proj/kernel": P(None, None, "tp"),
    "params/layers/self_attn/q_proj/bias": P(None, "tp"),
    "params/layers/self_attn/k_proj/bias": P(None, "tp"),
    "params/layers/self_attn/v_proj/bias": P(None, "tp"),
    "params/layers/self_attn/o_proj/kernel": P(None, "tp", None),
    "params/layers/mlp/gate_proj/kernel": P(None, None, "tp"),
    "params/layers/mlp/up_proj/kernel": P(None, None, "tp"),
    "params/layers/mlp/down_proj/kernel": P(None, "tp", None),
}


def flat(tree) -> dict:
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(
                tree, is_leaf=lambda x: isinstance(x, P))[0]}


@pytest.mark.parametrize("variant", [{}, {"attention_bias": True}, {"qk_norm": True},
                                     {"tie_word_embeddings": True}])
def test_rules_cover_every_llama_leaf(variant):
    """Every leaf of init_params (all variants) gets the hand-written spec; the shape tree the
    loaders place by is init_params' own."""
    cfg = tiny_config(**variant)
    params = init_params(cfg, jax.random.PRNGKey(0))
    shapes = llama_param_shapes(cfg)
    assert jax.tree.structure(shapes) == jax.tree.structure(params)
    assert [s.shape for s in jax.tree.leaves(shapes)] == [p.shape for p in jax.tree.leaves(params)]
    specs = flat(partition_specs(params, tp=2))
    assert specs == {name: EXPECTED[name] for name in specs}
    assert all(rule_spec(name, LLAMA_RULES) is not None for name in specs)


def test_learned_drafter_params_keep_the_target_layout():
    """The target's parts inside a learned drafter's params follow the target's rules; the head's
    own leaves (an EAGLE-3 head has its own lm_head / norm) fall back."""
    assert rule_spec("target/params/lm_head/kernel", LLAMA_RULES) == P(None, "tp")
    assert rule_spec("head/params/lm_head/kernel", LLAMA_RULES) is None
    assert rule_spec("head/params/layer/q_proj/kernel", LLAMA_RULES) is None


def test_fallback_small_replicated_large_split():
    assert SMALL_LEAF_BYTES == 16 << 20
    assert fallback_spec((2048, 2048), 2, tp=8) == P()  # 8 MiB: small
    assert fallback_spec((4096, 32000), 2, tp=8) == P(None, "tp")  # 262 MB: split outputs
    assert fallback_spec((4096, 32001), 2, tp=8) == P()  # tp does not divide: whole
    assert fallback_spec((64, 32), 4, tp=8, small_bytes=1024) == P(None, "tp")
    assert fallback_spec((), 4, tp=8, small_bytes=0) == P()


def test_rule_of_the_wrong_rank_is_an_error():
    with pytest.raises(ValueError, match=r"^rule P\(None, 'tp'\) for params/lm_head/kernel does "
                                         r"not fit its shape \(4, 4, 4\)$"):
        partition_specs({"params": {"lm_head": {"kernel": np.zeros((4, 4, 4))}}}, tp=2)


# ---- reading collectives from HLO ----------------------------------------------------------------

PLANTED = """HloModule planted

%body (p: (s32[], f32[8,32])) -> (s32[], f32[8,32]) {
  %p = (s32[], f32[8,32]) parameter(0)
  %w = f32[4,32]{1,0} get-tuple-element(%p), index=1
  %all-gather.1 = f32[32,32]{1,0} all-gather(%w), channel_id=1, dimensions={0}
  %all-reduce.2 = f32[8,1,32]{2,1,0} all-reduce(%w), channel_id=2, to_apply=%add
  ROOT %t = (s32[], f32[8,32]) tuple(%p, %w)
}

%cond (p: (s32[], f32[8,32])) -> pred[] {
  ROOT %c = pred[] all-reduce(%p), channel_id=3, to_apply=%add
}

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[8,32]) -> f32[8,32] {
  %x = f32[8,32]{1,0} parameter(0)
  %outside = f32[64,32]{1,0} all-gather(%x), channel_id=4, dimensions={0}
  %while.1 = (s32[], f32[8,32]) while(%x), condition=%cond, body=%body
  ROOT %r = f32[8,32] get-tuple-element(%while.1), index=1
}
"""


def test_loop_collectives_count_the_loop_only():
    counts = loop_collectives(PLANTED)
    assert counts == {"all-gather": 1, "all-reduce": 2, "reduce-scatter": 0, "all-to-all": 0,
                      "collective-permute": 0}
    assert whole_gathers(PLANTED, {(32, 32)}) == [(32, 32)]  # a whole [32, 32] weight: caught
    assert whole_gathers(PLANTED, {(1, 32, 32)}) == [(32, 32)]  # up to unit axes
    assert whole_gathers(PLANTED, {(64, 32)}) == []  # the gather outside the loop is not counted
    assert dims_key((2, 1, 8, 4)) == (2, 4, 8)


# ---- 8 fake devices --------------------------------------------------------------------------------


#: runs of the worker before the cases fail: the second resumes an aborted first (a stuck
#: collective of XLA CPU's fake devices, see tests/fake_devices.py)
WORKER_RUNS = 2


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """Every multi-device case, run once in a subprocess with 8 fake CPU devices; a run that XLA
    aborted on a stuck collective is resumed once (the cases it finished are kept)."""
    out = tmp_path_factory.mktemp("sharding") / "results.json"
    for run in range(1, WORKER_RUNS + 1):
        proc = subprocess.run([sys.executable, str(WORKER), str(out)], capture_output=True,
                              text=True, timeout=900)
        if proc.returncode == 0:
            break
        stuck = "Termination timeout" in proc.stderr
        # the stderr without the stack frames XLA prints for every thread of a stuck run
        said = "\n".join(line for line in proc.stderr.splitlines()
                         if not line.lstrip().startswith("@"))
        assert stuck and run < WORKER_RUNS, said[-4000:]
        print(f"\nsharding worker run {run}: XLA aborted a stuck collective; resuming")
    results = json.loads(out.read_text())
    assert results.get("complete"), results.keys()
    print("\nsharding worker seconds:", results["seconds"], "runs:", results["runs"])
    return results


def test_worker_has_eight_devices(worker):
    assert worker["devices"] == 8


def test_sharded_forward_logits_match(worker):
    """Ragged rows (cache lengths 0..8) and right-padded prompts: the sharded forward's logits
    are the one-device logits up to f32 summation order (tp adds partial sums)."""
    assert set(worker["logits"]) == set(MESHES)
    for mesh, diff in worker["logits"].items():
        assert diff < 1e-5, (mesh, diff)


def test_load_straight_into_shards(worker):
    """tp=8: every split leaf is split on the mesh, each device holds its share (+ the
    replicated norms) and no more, and each device was sent only its slice of each split leaf."""
    load = worker["load"]
    assert load["equal"]  # the same values as a one-device load
    tp, full = load["tp"], load["full"]
    share = (full - load["replicated"]) / tp + load["replicated"]
    for device, size in load["per_device"].items():
        assert size == share and size < full / 4, (device, size, full)
    for name, leaf in load["leaves"].items():
        assert leaf["mesh"]
        assert leaf["spec"] == str(EXPECTED[name]), name
        split = [i for i, axis in enumerate(EXPECTED[name]) if axis == "tp"]
        expected_shard = [n // tp if i in split else n for i, n in enumerate(leaf["shape"])]
        assert leaf["shard_shape"] == expected_shard, name
    sent_split = [(shape, piece) for shape, piece in load["sent"] if piece != shape]
    assert sent_split and all(np.prod(piece) * tp == np.prod(shape) for shape, piece in sent_split)
    whole_sent = {tuple(shape) for shape, piece in load["sent"] if piece == shape}
    replicated = {tuple(leaf["shape"]) for leaf in load["leaves"].values() if leaf["spec"] == "P()"}
    assert whole_sent <= replicated  # only the replicated norms went whole to a device


def test_errors_before_any_compile(worker):
    errors = worker["errors"]
    assert errors["kv_heads"] == {
        "error": "InputError: mesh tp=4 does not divide num_kv_heads=2 of model 'tiny': choose "
                 "a tp that divides it", "compiled": 0}
    assert errors["too_many"] == {
        "error": "InputError: mesh 'dp=4,tp=4' needs dp*tp = 16 devices, only 8 available",
        "compiled": 0}
    assert errors["draft_model"] == {
        "error": "InputError: mesh tp=8 does not divide num_kv_heads=4 of model 'draft': choose "
                 "a tp that divides it", "compiled": 0}


def test_batch_rounded_up_to_dp(worker):
    """3 prompts on dp=8 run as 8 rows (5 padding rows), same tokens as one device."""
    rounded = worker["errors"]["rounded"]
    assert rounded["tokens"] == rounded["reference"] and len(rounded["tokens"]) == 3


def test_greedy_sharded_equals_plain_greedy(worker):
    """AR, every drafter kind and auto switching shapes every step, sharded, emit exactly the
    one-device plain greedy tokens."""
    generation = worker["generation"]
    reference = generation["reference"]
    assert set(generation["greedy"]) == {"ar", "ngram", "suffix", "model", "layerskip", "eagle3",
                                         "mtp", "medusa", "dflash", "dspark", "auto"}
    for kind, by_mesh in generation["greedy"].items():
        assert by_mesh, kind
        for mesh, tokens in by_mesh.items():
            assert tokens == reference, (kind, mesh)
    assert set(generation["greedy"]["ar"]) == set(MESHES)


def test_sampled_sharded_equals_one_device(worker):
    """Sampling (temperature 0.8, top-k 8) with the same per-prompt keys: the same tokens."""
    for kind, runs in worker["generation"]["sampled"].items():
        assert runs["dp=2,tp=4"] == runs["reference"], kind
        assert runs["reference"] != worker["generation"]["reference"]  # sampling did sample


def test_decode_loop_gathers_no_whole_weight_or_cache(worker):
    """The decode programs' loops gather no whole split weight matrix and no whole KV cache
    layer or stack; tp meshes add partial sums (all-reduce), dp alone reduces only `done`."""
    generation = worker["generation"]
    for name, gathers in generation["whole_gathers"].items():
        assert gathers == [], (name, gathers)
    for name, counts in generation["refill_collectives"].items():
        print("refill", name, counts)
    for name, counts in generation["collectives"].items():
        print(name, counts)
        if name.endswith(" tp=8"):
            assert counts["all-reduce"] >= 2  # o_proj and down_proj partial sums at least
        if name.endswith(" dp=8"):
            assert counts["all-reduce"] == 1  # only "is any row still running"


# ---- the CLI flag ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "bench", "tune"])
def test_cli_mesh_flag_is_checked_at_parse_time(command, capsys):
    """--mesh is parsed and checked by argparse (exit 2, one line naming it), before any load."""
    from specjax.cli.main import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--mesh", "dp=2,tp=4"])
    assert exit_info.value.code == 2
    assert ("argument --mesh: mesh 'dp=2,tp=4' needs dp*tp = 8 devices, only 1 available"
            in capsys.readouterr().err)


def test_cli_generate_threads_the_mesh(monkeypatch, capsys):
    """`generate --mesh auto` loads with the mesh's shardings and passes the mesh to the API."""
    from types import SimpleNamespace

    import specjax.api
    import specjax.models.hub
    from specjax.api import Generation
    from specjax.cli import main

    seen = {}

    def load(name, dtype, shardings=None, quantize=None):
        seen["shardings"] = shardings
        return SimpleNamespace(cfg=tiny_config(), params=None, tokenizer=None)

    def iter_generate(model, prompts, **options):
        seen["mesh"] = options["mesh"]
        yield 0, [Generation(prompt=prompts[0], completion="ok", token_ids=[5],
                             num_new_tokens=1, stop_reason="length", time_s=0.0)]

    monkeypatch.setattr(specjax.models.hub, "load_model", load)
    monkeypatch.setattr(specjax.api, "iter_generate", iter_generate)
    assert main(["generate", "--prompt", "hi", "--mesh", "auto"]) == 0
    assert seen["mesh"].axis_names == ("dp", "tp") and seen["mesh"].devices.shape == (1, 1)
    shardings = seen["shardings"](tiny_config())
    assert shardings["params"]["lm_head"]["kernel"].spec == P(None, "tp")
    assert capsys.readouterr().out.strip() == "ok"
