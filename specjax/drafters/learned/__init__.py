"""Learned drafters: draft heads trained on the target's own outputs (EAGLE-3, MTP, Medusa,
DFlash, DSpark).

- `kind.py`: `HeadKind`, the record of one kind; `registry.py`: the kinds by name, one line each.
- one module per kind (`eagle3`, `mtp`, `medusa`, `dflash`, `dspark`): config, Flax module,
  init, loss, drafter, upstream layout, ending with its `KIND` record.
- shared: `blocks` (Flax building blocks, target views, HF names of a layer), `drafting`
  (drafting on a tree), `objectives` (loss pieces), `sequential` (EAGLE-3/MTP drafting and
  training-time test); DFlash's block machinery is `dflash`'s, which DSpark extends.
- folders: `checkpoint` (train-drafter outputs; `KIND:DIR`; export), `hf` (upstream layouts).

Nothing here imports `specjax.train` or `specjax.api`: training imports the kinds.
"""
