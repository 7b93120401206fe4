"""One prompt, warm: tokens/s of the default batch_size (8; a job's batch shrinks to its
prompts' bucket, so one prompt runs as one row), of batch_size=1, and of the same prompt padded
to 8 rows (what the default ran before the batch shrank), in one process.

    python benchmarks/one_prompt.py [--model smollm2-135m] [--max-new-tokens 96]
        [--draft ngram] [--num-draft 4] [--repeats 5]

Each mode runs once untimed first (compilation), then the modes take turns `--repeats` times in
rotating order (a drifting machine load hits them alike); tokens/s = the row's new tokens /
its `time_s` (generating only: compilation is never in it), medians printed as one JSON object.
The prompt is the README's first command's, with the chat template.
"""
from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from specjax import api
from specjax.drafters.registry import make_drafter
from specjax.loop import StopCriteria
from specjax.models.hub import load_model
from specjax.rng import job_row_keys
from specjax.sampling import SamplingParams
from specjax.tree import chain

PROMPT = "Explain speculative decoding in two sentences."


def padded_run(model, ids, drafter, eos_ids, max_new_tokens: int, rows: int):
    """The prompt alone in a batch of `rows` rows (the others padding), as the API ran it."""
    results, _ = api.run_batch(
        model.cfg, model.params, [ids], max_new_tokens=max_new_tokens, sampling=SamplingParams.make(),
        criteria=StopCriteria.make(eos_ids), row_keys=job_row_keys(np.zeros(2, np.uint32), [0]),
        batch_size=rows, drafter=drafter, drafter_params=None, drafter_carry=drafter.init_carry(None),
    )
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--num-draft", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model = load_model(args.model)
    ids = model.tokenizer.encode_chat(PROMPT)
    drafter, _ = make_drafter(args.draft, tree=chain(args.num_draft), target=model)
    eos_ids = api.model_eos_ids(model)
    job = lambda batch_size: api.generate_ids(
        model.cfg, model.params, [ids], max_new_tokens=args.max_new_tokens, eos_ids=eos_ids,
        draft=drafter, batch_size=batch_size)[0]
    modes = {
        "default (batch_size=8)": lambda: job(8),
        "batch_size=1": lambda: job(1),
        "padded to 8 rows (the former default)": lambda: padded_run(
            model, ids, drafter, eos_ids, args.max_new_tokens, 8),
    }
    rates = {name: [] for name in modes}
    for run in modes.values():
        run()  # compiles
    names = list(modes)
    for turn in range(args.repeats):
        for name in names[turn % len(names):] + names[: turn % len(names)]:
            result = modes[name]()
            rates[name].append(len(result.token_ids) / result.time_s)
    medians = {name: statistics.median(r) for name, r in rates.items()}
    default, one, padded = medians.values()
    print(json.dumps({
        "tokens_per_s": {name: round(m, 2) for name, m in medians.items()},
        "default / batch_size=1": round(default / one, 3),
        "default / padded to 8": round(default / padded, 3),
        "new_tokens": len(job(8).token_ids), "repeats": args.repeats,
    }, indent=2))


if __name__ == "__main__":
    main()
