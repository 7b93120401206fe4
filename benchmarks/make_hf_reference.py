"""Writes the Hugging Face reference fixture for SmolLM2 (tests/fixtures/smollm2_hf_reference.npz).

transformers loads the same Q4_1 GGUF (dequantized to f32) and, for a few chat prompts, records
  - the prompt token ids (transformers' tokenizer, chat template applied),
  - a 64-token greedy continuation (plain argmax, one token at a time with the KV cache, EOS not
    special-cased),
  - the top-16 logits (values + ids) at every position of prompt + continuation (one forward
    over the whole sequence),
  - the gap between the best and second-best logit at each position (ties make argmax fragile).
tests/test_hf_reference.py compares specjax's f32 forward against it without torch.

    python benchmarks/make_hf_reference.py [--gguf PATH] [--out PATH.npz]

Needs torch==2.13.0 (CPU), transformers and accelerate (`pip install -e .[hf]`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

DEFAULT_OUT = (
    Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "smollm2_hf_reference.npz"
)
PROMPTS = (
    [
        {
            "role": "user",
            "content": "Explain in a few sentences how a bicycle stays upright while moving.",
        }
    ],
    [
        {
            "role": "user",
            "content": "Write a Python function that checks whether a string is a palindrome.",
        }
    ],
    [
        {"role": "system", "content": "You are a concise assistant that answers in plain English."},
        {
            "role": "user",
            "content": "What are the main differences between a list and a tuple in Python?",
        },
    ],
)


def hf_model_and_tokenizer(gguf_path: Path):
    """transformers' f32 model and tokenizer for a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), tokenizer


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Plain argmax decoding with the KV cache: `steps` new token ids."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        tokens = []
        for _ in range(steps):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            # the cache is the 4th positional argument (`past_key_values` before transformers 5.2x,
            # `cache` after), and the output's attribute was renamed alike
            cache = getattr(out, "cache", None) or out.past_key_values
            out = model(torch.tensor([[token]]), None, None, cache, use_cache=True)
    return tokens


def full_logits(model, ids: list[int]) -> np.ndarray:
    """`[T, V]` f32 logits of one forward over ids."""
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def build_reference(
    gguf_path: Path, new_tokens: int = 64, top_k: int = 16
) -> dict[str, np.ndarray]:
    import torch
    import transformers

    torch.manual_seed(0)
    model, tokenizer = hf_model_and_tokenizer(gguf_path)
    prompts = [chat_ids(tokenizer, m) for m in PROMPTS]
    continuations = [greedy(model, p, new_tokens) for p in prompts]
    seqs = [p + c for p, c in zip(prompts, continuations)]
    width, n = max(len(s) for s in seqs), len(seqs)
    topk_values = np.zeros((n, width, top_k), np.float32)
    topk_ids = np.full((n, width, top_k), -1, np.int32)
    margins = np.zeros((n, width), np.float32)
    prompt_ids = np.full((n, max(len(p) for p in prompts)), -1, np.int32)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        logits = full_logits(model, s)
        order = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
        topk_ids[i, : len(s)] = order
        topk_values[i, : len(s)] = np.take_along_axis(logits, order, axis=-1)
        margins[i, : len(s)] = topk_values[i, : len(s), 0] - topk_values[i, : len(s), 1]
        prompt_ids[i, : len(p)] = p
    meta = {
        "gguf": gguf_path.name,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "new_tokens": new_tokens,
        "top_k": top_k,
    }
    return {
        "prompt_ids": prompt_ids,
        "prompt_lens": np.array([len(p) for p in prompts], np.int32),
        "continuations": np.array(continuations, np.int32),
        "topk_values": topk_values,
        "topk_ids": topk_ids,
        "margins": margins,
        "messages": np.array(json.dumps(PROMPTS)),
        "meta": np.array(json.dumps(meta)),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: the smollm2-135m preset)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=16)
    args = parser.parse_args(argv)
    gguf_path = args.gguf
    if gguf_path is None:
        from specjax.models.hub import fetch_preset, read_preset

        gguf_path = fetch_preset(read_preset("smollm2-135m"))
    ref = build_reference(gguf_path, args.new_tokens, args.top_k)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **ref)
    lens = ref["prompt_lens"].tolist()
    valid = ref["topk_ids"][..., 0] >= 0
    print(
        f"wrote {args.out} ({args.out.stat().st_size} bytes): prompts of {lens} tokens, "
        f"min top-1/top-2 logit gap {ref['margins'][valid].min():.4f}"
    )


if __name__ == "__main__":
    main()
