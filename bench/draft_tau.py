"""τ of an EAGLE-3 draft, in chain and tree settings, every step verified (adaptive policy off), per group of prompts
and over all, and whether greedy output with the draft equals greedy output without it. One JSON line per setting.
Usage: python bench/draft_tau.py [--model default] [--draft default] [--dataset corpus|mtbench]
       [--prompts out/train/corpus/prompts.jsonl] [--num-prompts 60] [--settings "chain 7,…"] [--max-tokens 128]
       [--device cpu] [--dtype float32]
corpus: the first --num-prompts "heldout" records of a prompts file as `jetserve.train.eagle3` reads them (the
corpus' prompts.jsonl), grouped by source. mtbench: MT-bench's 80 first turns, grouped by category. Each answer runs
to its end of turn or --max-tokens. "tau_by_group": each group's τ over its own verify rounds (its prompts are
generated together); "tau": over every group's verify rounds.
"""

from __future__ import annotations

import argparse
import json
import time

from jetserve.assets import resolve_checkpoint
from jetserve.llm import LLM
from jetserve.sampling_params import SamplingParams
from jetserve.train.eagle3 import read_prompt_records

SETTINGS = {
    "chain 3": dict(spec_topk=1, spec_steps=3),
    "chain 5": dict(spec_topk=1, spec_steps=5),
    "chain 7": dict(spec_topk=1, spec_steps=7),
    "tree 8": dict(spec_topk=2, spec_steps=3, spec_num_draft_tokens=8),  # top-2 children, 3 levels
}


def load_groups(dataset: str, prompts_path: str, num_prompts: int) -> dict[str, list[str]]:
    """group → its prompt texts, in file order."""
    if dataset == "mtbench":
        from jetserve.evals.mtbench import load_questions

        pairs = [(q["category"], q["turns"][0]) for q in load_questions()]
    else:
        held = [r for r in read_prompt_records(prompts_path) if r["split"] == "heldout"][:num_prompts]
        pairs = [(r["source"], r["prompt"]) for r in held]
    groups: dict[str, list[str]] = {}
    for group, text in pairs:
        groups.setdefault(group, []).append(text)
    return groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--draft", default="default")
    p.add_argument("--dataset", choices=["corpus", "mtbench"], default="corpus")
    p.add_argument("--prompts", default="out/train/corpus/prompts.jsonl", help="corpus: the prompts JSONL")
    p.add_argument("--num-prompts", type=int, default=60, help="corpus: how many held-out prompts")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of: {', '.join(SETTINGS)}")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        p.error(f"--settings: unknown {', '.join(unknown)} (known: {', '.join(SETTINGS)})")
    model, draft = resolve_checkpoint(args.model, "model"), resolve_checkpoint(args.draft, "draft")
    groups = load_groups(args.dataset, args.prompts, args.num_prompts)
    base = dict(dtype=args.dtype, device=args.device, max_model_len=1024, max_num_seqs=args.max_num_seqs)
    plain = LLM(model, **base)
    tok = plain.tokenizer
    ids = {g: [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in texts]
           for g, texts in groups.items()}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    want = {g: [o.output_token_ids for o in plain.generate(x, params)] for g, x in ids.items()}
    plain_s = time.perf_counter() - start
    for name in settings:
        llm = LLM(model, draft=draft, spec_adaptive=False, **SETTINGS[name], **base)
        stats = llm.engine.spec_stats
        start = time.perf_counter()
        tau, equal = {}, True
        for g, x in ids.items():
            drafts, accepted = stats.num_drafts, stats.num_accepted_tokens
            equal &= [o.output_token_ids for o in llm.generate(x, params)] == want[g]
            tau[g] = round(1 + (stats.num_accepted_tokens - accepted) / max(stats.num_drafts - drafts, 1), 3)
        print(json.dumps({
            "setting": name, "shape": SETTINGS[name], "dataset": args.dataset,
            "prompts": sum(len(x) for x in ids.values()),
            "tau": round(stats.mean_acceptance_length, 3), "tau_by_group": tau,
            "acceptance_per_depth": [round(r, 3) for r in stats.acceptance_rate_per_depth],
            "greedy_equal": equal, "seconds_spec": round(time.perf_counter() - start, 1),
            "seconds_plain": round(plain_s, 1),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
