"""τ of an EAGLE-3 draft on held-out prompts, in chain and tree settings, every step verified (adaptive policy off),
and whether greedy output with the draft equals greedy output without it. One JSON line per setting.
Usage: python bench/draft_tau.py [--model default] [--draft default] [--prompts out/train/corpus/prompts.jsonl]
       [--num-prompts 60] [--max-tokens 128] [--device cpu] [--dtype float32]
The prompts file is JSONL of {"prompt", "split"} records (the corpus' prompts.jsonl; its "heldout" ones are used).
"""

from __future__ import annotations

import argparse
import json
import time

from jetserve.assets import resolve_checkpoint
from jetserve.llm import LLM
from jetserve.sampling_params import SamplingParams

SETTINGS = {
    "chain 3": dict(spec_topk=1, spec_steps=3),
    "chain 5": dict(spec_topk=1, spec_steps=5),
    "chain 7": dict(spec_topk=1, spec_steps=7),
    "tree 8 (top-2, 3 levels)": dict(spec_topk=2, spec_steps=3, spec_num_draft_tokens=8),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--draft", default="default")
    p.add_argument("--prompts", default="out/train/corpus/prompts.jsonl")
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    model, draft = resolve_checkpoint(args.model, "model"), resolve_checkpoint(args.draft, "draft")
    with open(args.prompts) as f:
        records = [json.loads(line) for line in f if line.strip()]
    prompts = [r["prompt"] for r in records if r.get("split") == "heldout"][: args.num_prompts]
    base = dict(dtype=args.dtype, device=args.device, max_model_len=1024, max_num_seqs=8)
    plain = LLM(model, **base)
    tok = plain.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    want = [o.output_token_ids for o in plain.generate(ids, params)]
    plain_s = time.perf_counter() - start
    for name, shape in SETTINGS.items():
        llm = LLM(model, draft=draft, spec_adaptive=False, **shape, **base)
        start = time.perf_counter()
        got = [o.output_token_ids for o in llm.generate(ids, params)]
        stats = llm.engine.spec_stats
        print(json.dumps({
            "setting": name, "prompts": len(ids), "tau": round(stats.mean_acceptance_length, 3),
            "acceptance_per_depth": [round(r, 3) for r in stats.acceptance_rate_per_depth],
            "greedy_equal": got == want, "seconds_spec": round(time.perf_counter() - start, 1),
            "seconds_plain": round(plain_s, 1),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
