"""The multi-device half of tests/test_sharding.py: run as a script in a fresh process with 8 fake
CPU devices (XLA_FLAGS set before jax is imported), it runs every case once and writes one JSON
object of results to OUT.json; the test asserts on it.

    python tests/sharding_worker.py OUT.json   # sets its own XLA_FLAGS (8 devices)

The results are saved after each case (and each drafter kind): a run XLA aborts (a collective
that timed out) is resumed by the next run with the same OUT.json, which skips what is there.

Cases: sharded vs one-device forward logits (ragged padded prompts), loading straight into
shards (per-device bytes, each leaf's sharding), greedy and sampled generation on each mesh vs
one device for AR and every drafter kind, the decode programs' collectives, and the one-line
errors of a mesh that does not divide the model.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_devices import RESUMABLE_TIMEOUT_S, fake_devices_env  # imports no jax

os.environ.update(fake_devices_env(8, RESUMABLE_TIMEOUT_S))

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

from helpers import tiny_config, write_hf  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from specjax import api, timing  # noqa: E402
from specjax.drafters.auto import AutoDrafter, AutoParams  # noqa: E402
from specjax.drafters.draft_model import DraftModelDrafter  # noqa: E402
from specjax.drafters.layerskip import layerskip_drafter  # noqa: E402
from specjax.drafters.learned.drafting import drafter_params  # noqa: E402
from specjax.drafters.learned.registry import (  # noqa: E402
    init_head,
    make_head_config,
    make_learned_drafter,
)
from specjax.drafters.ngram import NgramDrafter  # noqa: E402
from specjax.drafters.suffix import SuffixDrafter  # noqa: E402
from specjax.measure.hlo import loop_collectives, whole_gathers  # noqa: E402
from specjax.models import checkpoint  # noqa: E402
from specjax.models.cache import init_cache  # noqa: E402
from specjax.models.llama import forward, init_params  # noqa: E402
from specjax.models.load import load_checkpoint  # noqa: E402
from specjax.sharding import (  # noqa: E402
    as_mesh,
    cache_shardings,
    llama_param_shapes,
    loader_shardings,
    partition_specs,
    rows_sharding,
    shard_params,
)
from specjax.tree import chain, k_ary  # noqa: E402

MESHES = ("dp=8", "tp=8", "dp=2,tp=4")
#: 8 heads and 8 KV heads: tp=8 divides every split dimension
CFG = tiny_config(num_heads=8, num_kv_heads=8, head_dim=4)
DRAFT_CFG = tiny_config(num_layers=1, num_heads=8, num_kv_heads=8, head_dim=4, name="draft")
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [2, 12, 13, 14, 6, 5, 4, 15, 9], [5] * 12, [9, 9, 8]]
MAX_NEW = 10
CHAIN = chain(3)
HEAD_OPTIONS = {
    "eagle3": {"ttt_steps": 3}, "mtp": {"ttt_steps": 3}, "medusa": {"num_heads": 3},
    "dflash": {"block_size": 4, "num_anchors": 8}, "dspark": {"block_size": 4, "num_anchors": 8},
}
KINDS = ("ar", "ngram", "suffix", "model", "layerskip", *HEAD_OPTIONS, "auto")
#: kinds run on every mesh; the others on dp=2,tp=4 (both axes at once) only, to keep the
#: worker's compile time modest
ALL_MESH_KINDS = ("ar", "ngram", "eagle3")
SAMPLED_KINDS = ("ar", "eagle3", "auto")
SAMPLING = {"temperature": 0.8, "top_k": 8}


def drafter_for(kind: str, params):
    """(drafter spec or Drafter, drafter params) of a kind, heads random."""
    if kind == "ar":
        return None, None
    if kind == "ngram":
        return NgramDrafter(tree=k_ary((2, 2, 1), max_nodes=7)), None
    if kind == "auto":  # every shape in turn: plain steps, chains of 1 and 3, switched per step
        return (AutoDrafter.wrap(NgramDrafter(tree=chain(1)), (0, 1, 3), rotate=True),
                AutoParams(inner=None, step_s=jnp.ones(3)))
    if kind == "suffix":
        return SuffixDrafter(tree=CHAIN), None
    if kind == "model":
        return DraftModelDrafter(tree=CHAIN, cfg=DRAFT_CFG), init_params(DRAFT_CFG, jax.random.PRNGKey(2))
    if kind == "layerskip":
        return layerskip_drafter(CHAIN, CFG, 1), params
    head = make_head_config(kind, CFG, **HEAD_OPTIONS[kind])
    variables = init_head(head, jax.random.PRNGKey(1))
    return make_learned_drafter(head, CHAIN), drafter_params(variables, params, head)


# ---- the decode program's HLO: the API's own build step, recorded --------------------------------

RECORDED: list[str] = []


def recording_build_and_run(program, *args, **static):
    """`timing.build_and_run` that also keeps the compiled program's HLO text."""
    start = time.perf_counter()
    RECORDED.append(program.lower(*args, **static).compile().as_text())
    built = time.perf_counter()
    outputs = jax.block_until_ready(program(*args, **static))
    return outputs, built - start, time.perf_counter() - built


def whole_shapes(rows: int, width: int) -> set[tuple[int, ...]]:
    """The shapes of every whole split weight (one layer's and the stack) and of one KV cache
    layer and the whole stack, in both K and V layouts."""
    shapes = set()
    for leaf, spec in zip(jax.tree.leaves(llama_param_shapes(CFG)),
                          jax.tree.leaves(partition_specs(llama_param_shapes(CFG), 8),
                                          is_leaf=lambda x: isinstance(x, P))):
        if any(spec):
            shapes |= {leaf.shape, leaf.shape[1:]} if len(leaf.shape) == 3 else {leaf.shape}
    layer_k = (rows, CFG.num_kv_heads, CFG.head_dim, width)
    layer_v = (rows, CFG.num_kv_heads, width, CFG.head_dim)
    return shapes | {layer_k, layer_v, (CFG.num_layers, *layer_k), (CFG.num_layers, *layer_v)}


def generate(params, drafter, mesh, sampled=False, refill=True):
    draft, dparams = drafter
    options = SAMPLING if sampled else {}
    results = api.generate_ids(CFG, params, PROMPTS, draft=draft, drafter_params=dparams,
                               max_new_tokens=MAX_NEW, eos_ids=(), mesh=mesh, seed=7,
                               refill=refill, **options)
    return [r.token_ids for r in results]


def generation_cases(params, done: dict, save) -> dict:
    """Greedy tokens of every kind on its meshes (the reference: plain greedy on one device,
    which every greedy speculative output must equal), sampled tokens on one device and on
    dp=2,tp=4, and the collectives of each sharded decode program: the refilling chunk's (the
    default path) for every case, the static batch's decode loop for the kinds run on every
    mesh. `done` holds the kinds an earlier, aborted run finished (kept, not run again); `save`
    is called with the results after each kind."""
    out: dict = {"greedy": {}, "sampled": {}, "collectives": {}, "whole_gathers": {},
                 "refill_collectives": {}, "seconds": {}} | done
    if "reference" not in out:
        out["reference"] = generate(params, (None, None), None)
    for kind in KINDS:
        if kind not in out["greedy"]:
            kind_case(params, kind, out)
            save(out)
    return out


def kind_case(params, kind: str, out: dict) -> None:
    """One kind's generation cases, written into `out`'s tables."""
    drafter = drafter_for(kind, params)
    tree = None if drafter[0] is None else drafter[0].tree
    rows = api.batch_rows(None, len(PROMPTS))
    width = api.batch_shape([len(p) for p in PROMPTS], rows, MAX_NEW, tree).width
    greedy = {}
    for mesh in MESHES if kind in ALL_MESH_KINDS else ("dp=2,tp=4",):
        RECORDED.clear()
        start = time.perf_counter()
        greedy[mesh] = generate(params, drafter, mesh)
        out["seconds"][f"{kind} {mesh}"] = round(time.perf_counter() - start, 1)
        progress(f"{kind} {mesh}: {out['seconds'][f'{kind} {mesh}']} s")
        refill_hlo = RECORDED[-1]  # the chunk's one program
        out["refill_collectives"][f"{kind} {mesh}"] = loop_collectives(refill_hlo)
        out["whole_gathers"][f"refill {kind} {mesh}"] = whole_gathers(
            refill_hlo, whole_shapes(rows, width))
        if kind in ALL_MESH_KINDS:
            RECORDED.clear()
            static = generate(params, drafter, mesh, refill=False)
            progress(f"{kind} {mesh} static batch: done")
            assert static == greedy[mesh], (kind, mesh)
            decode_hlo = RECORDED[-1]  # the decode program (the second of the batch's two)
            out["collectives"][f"{kind} {mesh}"] = loop_collectives(decode_hlo)
            out["whole_gathers"][f"{kind} {mesh}"] = whole_gathers(
                decode_hlo, whole_shapes(rows, width))
    if kind in SAMPLED_KINDS:
        out["sampled"][kind] = {
            "reference": generate(params, drafter, None, sampled=True),
            "dp=2,tp=4": generate(params, drafter, "dp=2,tp=4", sampled=True)}
    out["greedy"][kind] = greedy  # last: a kind is done once its greedy entry is written


def progress(line: str) -> None:
    """One line on stderr as each case ends (the test shows stderr's tail when the worker fails)."""
    print(line, file=sys.stderr, flush=True)


# ---- the forward ----------------------------------------------------------------------------------


def logits_case(params) -> dict:
    """Max |sharded - one-device| forward logits per mesh, ragged right-padded prompts with a
    cache already holding ragged rows."""
    rng = np.random.default_rng(0)
    rows, seq, capacity = 8, 6, 32
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (rows, seq)), jnp.int32)
    held = jnp.asarray(rng.integers(0, 9, rows), jnp.int32)  # ragged rows already cached
    positions = held[:, None] + jnp.arange(seq)[None, :]
    cache = init_cache(CFG, rows, capacity).replace(lengths=held)
    run = jax.jit(lambda p, t, pos, c: forward(CFG, p, t, pos, c).logits)
    reference = np.asarray(run(params, tokens, positions, cache))
    out = {}
    for name in MESHES:
        mesh = as_mesh(name)
        sharded = run(shard_params(params, mesh, CFG), jax.device_put(tokens, rows_sharding(mesh)),
                      jax.device_put(positions, rows_sharding(mesh)),
                      jax.device_put(cache, cache_shardings(mesh)))
        out[name] = float(np.max(np.abs(np.asarray(sharded) - reference)))
    return out


# ---- loading straight into shards ----------------------------------------------------------------


def load_case() -> dict:
    """Loads a 4-layer checkpoint on tp=8: each device's bytes vs the whole model's, every leaf's
    sharding, and the host slices each device was sent (never a whole split leaf)."""
    cfg = tiny_config(num_layers=4, hidden_size=64, intermediate_size=256, num_heads=8,
                      num_kv_heads=8, head_dim=8, vocab_size=128)
    mesh = as_mesh("dp=1,tp=8")
    sent: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (leaf shape, slice shape)
    original = jax.make_array_from_callback

    def recording(shape, sharding, callback, *args, **kwargs):
        def recorded(index):
            piece = callback(index)
            sent.append((tuple(shape), tuple(piece.shape)))
            return piece
        return original(shape, sharding, recorded, *args, **kwargs)

    with tempfile.TemporaryDirectory() as folder:
        write_hf(Path(folder), cfg, init_params(cfg, jax.random.PRNGKey(3)))
        checkpoint.jax.make_array_from_callback = recording
        try:
            _, params = load_checkpoint(folder, "float32", shardings=loader_shardings(mesh))
        finally:
            checkpoint.jax.make_array_from_callback = original
        _, whole = load_checkpoint(folder, "float32")
    per_device = {str(d): 0 for d in mesh.devices.flat}
    leaves = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        for shard in leaf.addressable_shards:
            per_device[str(shard.device)] += shard.data.nbytes
        leaves[name] = {"spec": str(leaf.sharding.spec), "shape": list(leaf.shape),
                        "shard_shape": list(leaf.addressable_shards[0].data.shape),
                        "mesh": leaf.sharding.mesh.shape == mesh.shape}
    equal = all(np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(whole)))
    replicated = sum(leaf.nbytes for leaf in jax.tree.leaves(params)
                     if leaf.sharding.is_fully_replicated)
    return {"per_device": per_device, "full": sum(x.nbytes for x in jax.tree.leaves(params)),
            "replicated": replicated, "tp": 8, "leaves": leaves, "equal": equal,
            "sent": [list(map(list, s)) for s in sent]}


# ---- errors -------------------------------------------------------------------------------------


def error_cases(params) -> dict:
    """The one-line errors of meshes that do not fit, and whether anything compiled first."""
    out = {}
    gqa = tiny_config()  # 4 heads, 2 KV heads
    for name, call in {
        "kv_heads": lambda: api.generate_ids(gqa, init_params(gqa, jax.random.PRNGKey(0)),
                                             PROMPTS, max_new_tokens=4, mesh="dp=2,tp=4"),
        "too_many": lambda: api.generate_ids(CFG, params, PROMPTS, max_new_tokens=4,
                                             mesh="dp=4,tp=4"),
        "draft_model": lambda: api.generate_ids(
            CFG, params, PROMPTS, max_new_tokens=4, mesh="tp=8",
            draft=DraftModelDrafter(tree=CHAIN, cfg=DRAFT_CFG.replace(num_kv_heads=4)),
            drafter_params=init_params(DRAFT_CFG.replace(num_kv_heads=4), jax.random.PRNGKey(2))),
    }.items():
        RECORDED.clear()
        try:
            call()
            out[name] = {"error": None}
        except ValueError as error:
            out[name] = {"error": f"{type(error).__name__}: {error}", "compiled": len(RECORDED)}
    # 3 prompts on dp=8: rounded up to 8 rows (5 padding rows)
    out["rounded"] = {"tokens": [r.token_ids for r in api.generate_ids(
        CFG, params, PROMPTS[:3], max_new_tokens=4, eos_ids=(), mesh="dp=8")],
        "reference": [r.token_ids for r in api.generate_ids(
            CFG, params, PROMPTS[:3], max_new_tokens=4, eos_ids=())]}
    return out


def write_json(path: Path, value: dict) -> None:
    """`value` as JSON at `path`, atomically (a temporary file, then a rename)."""
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(value))
    partial.replace(path)


def main() -> None:
    """Runs every case not already in OUT's partial results (an earlier, aborted run's), saving
    them after each case; OUT gets the whole results, `"complete": true`, at the end."""
    api.build_and_run = recording_build_and_run
    assert timing.build_and_run is not recording_build_and_run
    out = Path(sys.argv[1])
    params = init_params(CFG, jax.random.PRNGKey(0))
    results = json.loads(out.read_text()) if out.exists() else {"seconds": {}}
    results["runs"] = results.get("runs", 0) + 1
    seconds = results["seconds"]

    def save(partial_generation: dict) -> None:
        write_json(out, results | {"generation": partial_generation})

    for name, case in {"logits": lambda: logits_case(params), "load": load_case,
                       "errors": lambda: error_cases(params),
                       "generation": lambda: generation_cases(
                           params, results.get("generation", {}), save)}.items():
        if name in seconds:  # finished by an earlier run
            continue
        start = time.perf_counter()
        results[name] = case()
        seconds[name] = round(time.perf_counter() - start, 1)
        progress(f"{name}: {seconds[name]} s")
        write_json(out, results)
    results["devices"] = jax.device_count()
    results["complete"] = True
    write_json(out, results)


if __name__ == "__main__":
    main()
