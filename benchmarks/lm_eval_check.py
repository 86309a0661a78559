"""The tokenmill_mc20 task (benchmarks/lm_eval/) scored offline with tokenmill's `LLM`, as
lm-evaluation-harness scores it through the server: each choice's loglikelihood is the sum of
the logprobs of its tokens after the question, and the highest wins. Given lm-eval's results
folder (`--output_path` with `--log_samples`), it checks that both picked the same answers.

    python benchmarks/lm_eval_check.py [--lm-eval-output DIR] [--result-file FILE]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from tokenmill import LLM, SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "lm_eval", "mc20.jsonl")


def offline_scores(llm: LLM, docs: list[dict]) -> list[list[float]]:
    """Every choice's loglikelihood given its question, as lm-eval splits the tokens: the
    context's own tokens, then the rest of context + " " + choice."""
    tok = llm.engine.tokenizer
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    prompts, spans = [], []
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"
        n_ctx = len(tok.encode(context, add_special_tokens=False))
        for choice in doc["choices"]:
            ids = tok.encode(context + " " + choice, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids})
            spans.append(n_ctx)
    outs = llm.generate(prompts, params, use_tqdm=False)
    flat = [sum(lp.logprob for lp in out.prompt_logprobs[n:]) for out, n in zip(outs, spans,
                                                                                 strict=True)]
    scores, i = [], 0
    for doc in docs:
        scores.append(flat[i:i + len(doc["choices"])])
        i += len(doc["choices"])
    return scores


def lm_eval_picks(folder: str) -> tuple[float, list[int]]:
    """lm-eval's accuracy and the choice it picked for each question (by doc_id)."""
    results = sorted(glob.glob(os.path.join(folder, "**", "results_*.json"), recursive=True))
    samples = sorted(glob.glob(os.path.join(folder, "**", "samples_tokenmill_mc20_*.jsonl"),
                               recursive=True))
    if not results or not samples:
        raise SystemExit(f"no lm-eval results/samples under {folder} (run it with --log_samples)")
    acc = json.load(open(results[-1]))["results"]["tokenmill_mc20"]["acc,none"]
    picks = {}
    for line in open(samples[-1]):
        s = json.loads(line)
        lls = [float(r[0]) for r in s["filtered_resps"]]
        picks[s["doc_id"]] = max(range(len(lls)), key=lls.__getitem__)
    return acc, [picks[i] for i in sorted(picks)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lm-eval-output", default=None, help="lm-eval's --output_path folder")
    p.add_argument("--result-file", default=None)
    args = p.parse_args()
    docs = [json.loads(line) for line in open(DATA)]
    scores = offline_scores(LLM(), docs)
    picks = [max(range(len(s)), key=s.__getitem__) for s in scores]
    right = sum(pk == d["answer"] for pk, d in zip(picks, docs, strict=True))
    acc = right / len(docs)
    print(f"tokenmill LLM offline: acc {acc:.2f} ({right}/{len(docs)})")
    out = {"offline_acc": acc, "offline_picks": picks, "offline_scores": scores}
    ok = True
    if args.lm_eval_output:
        lm_acc, lm_picks = lm_eval_picks(args.lm_eval_output)
        same = sum(a == b for a, b in zip(picks, lm_picks, strict=True))
        print(f"lm-eval through tokenmill serve: acc {lm_acc:.2f}; the same pick on "
              f"{same}/{len(docs)} questions")
        out.update(lm_eval_acc=lm_acc, lm_eval_picks=lm_picks, same_picks=same)
        ok = abs(lm_acc - acc) < 1e-9 and same == len(docs)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
