"""A workload that touches every engine feature a step can carry, and the comparison of two
engines' outputs on it; shared by the asynchronous-scheduling, Triton-path and GPU tests."""

from __future__ import annotations

import math

from tokenmill import SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

PROMPTS = [
    "The capital of France is",
    "Write a poem about the sea",
    "1, 2, 3, 4,",
    "Hello, my name is",
    "Q: What do bees make?\nA:",
    "import numpy as np\nx = np.arange(10)\n",
]
# Sixteen prompts of 1 to 20 tokens, 152 together, short and long mixed: batches whose rows
# need different numbers of steps.
MIXED_PROMPTS = [
    "Hi",
    "What is 2 + 2?",
    "Write a short poem about the moon and the stars shining over a quiet lake at night.",
    "Translate to French: good morning",
    "The quick brown fox",
    "Explain photosynthesis in simple words for a child who is seven years old and curious.",
    "1, 2, 3, 4,",
    "Name a planet.",
    "import numpy as np\nx = np.arange(10)\n",
    "Why is the sky blue? Give a detailed answer with the physics involved, please.",
    "Paris is",
    "Q: What do bees make?\nA:",
    "The best way to learn programming is",
    "Summer",
    "Roses are red, violets are blue,",
    "A long time ago in a galaxy far, far away, there lived a young farmer who dreamed of",
]

# Where the grammar-constrained request sits in the workload (its text is "yes" or "no").
CHOICE_ROW = len(PROMPTS) + 7


def feature_workload() -> tuple[list[str], list[SamplingParams]]:
    """Prompts (repeated: prefix-cache hits) and, for each, parameters that stop by length,
    EOS, a stop string or a grammar, sample with a seed, ask for logprobs, penalize history,
    hold off EOS, and fork (n=2)."""
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 9 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    params += [
        SamplingParams(temperature=0.0, max_tokens=40),  # may stop at EOS
        SamplingParams(temperature=0.9, seed=7, max_tokens=30),  # seeded: its own generator
        SamplingParams(temperature=0.0, max_tokens=1),  # done at its prefill
        SamplingParams(temperature=0.0, max_tokens=30, stop=[" the"]),  # a stop string
        SamplingParams(temperature=0.0, max_tokens=15, logprobs=3),  # top logprobs: no overlap
        SamplingParams(temperature=0.0, max_tokens=25, repetition_penalty=1.4),  # history
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=30,
                       structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        SamplingParams(temperature=0.0, max_tokens=8, n=2, seed=3),
    ]
    prompts = PROMPTS + [PROMPTS[i % len(PROMPTS)] for i in range(len(params) - len(PROMPTS))]
    return prompts, params


def summarize(outputs: list) -> list[tuple]:
    """Each completion's (token ids, text, finish reason, logprobs): the logprobs as
    (token id, logprob, sorted top ids) per token, or None."""
    rows = []
    for out in outputs:
        for c in out.outputs:
            lps = None if c.logprobs is None else [
                (lp.token_id, lp.logprob, sorted(lp.top)) for lp in c.logprobs]
            rows.append((c.token_ids, c.text, c.finish_reason, lps))
    return rows


def assert_same_outputs(got: list[tuple], want: list[tuple], atol: float = 0.0) -> None:
    """Tokens, texts and finish reasons equal; logprobs equal, or within ``atol`` where two
    engines' kernels round differently."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g[:3] == w[:3], f"completion {i}: {g[:3]} != {w[:3]}"
        if g[3] is None or w[3] is None:
            assert g[3] is None and w[3] is None, f"completion {i}: logprobs on one side only"
            continue
        assert len(g[3]) == len(w[3])
        for (gid, glp, gtop), (wid, wlp, wtop) in zip(g[3], w[3], strict=True):
            assert (gid, gtop) == (wid, wtop), f"completion {i}: {gid, gtop} != {wid, wtop}"
            assert math.isclose(glp, wlp, rel_tol=0.0, abs_tol=atol), \
                f"completion {i}: logprob {glp} != {wlp}"
