"""The experimental L2 prefetch (tokenmill/runner/l2_prefetch.py), checked on the CPU: the
read kernel (Triton's interpreter) reads exactly the prefix it is given, the hooks read each
next linear layer's weight in the order a decoder runs them, only in small forward passes,
and the model's outputs do not change. Whether it is faster is for a GPU to say
(benchmarks/gpu/lease.sh, step decode-bf16-l2)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.models.layers import Linear  # noqa: E402
from tokenmill.runner import l2_prefetch  # noqa: E402
from tokenmill.runner.l2_prefetch import L2Prefetch, prefetch_bytes_from_env, touch_prefix  # noqa: E402


@pytest.mark.parametrize("numel,max_bytes", [(10_000, 12_000), (3_000, 1 << 20),
                                             (2_500_000, 3_000_000)])
def test_the_read_covers_the_prefix_and_nothing_past_it(numel: int, max_bytes: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = torch.zeros(l2_prefetch.NUM_PROGRAMS)
    touch_prefix(x.view(-1, 50) if numel % 50 == 0 else x, max_bytes, out)
    n = min(numel, max_bytes // 2)
    torch.testing.assert_close(out.sum(), x[:n].float().sum(), rtol=1e-4, atol=1e-2)


def test_the_size_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(l2_prefetch.ENV, raising=False)
    assert prefetch_bytes_from_env() == 0
    monkeypatch.setenv(l2_prefetch.ENV, "32")
    assert prefetch_bytes_from_env() == 32 << 20
    for bad in ("lots", "-1", "1.5"):
        monkeypatch.setenv(l2_prefetch.ENV, bad)
        with pytest.raises(ValueError, match=l2_prefetch.ENV):
            prefetch_bytes_from_env()
    monkeypatch.setenv(l2_prefetch.ENV, "16")  # a refused value leaves nothing behind
    assert prefetch_bytes_from_env() == 16 << 20


def test_hooks_read_the_next_layer_in_decoder_order_and_change_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model="tiny-llama", load_format="dummy", dtype="float32", quantization="none",
              max_model_len=128, num_kv_blocks=32)
    runner = llm.engine.core.executor.runner
    runner.cpu_program = None  # every step through the modules, as on a GPU
    model = runner.model
    short = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    long = {"prompt_token_ids": list(range(10, 30))}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([short, long], params)]

    # The reads themselves are the test above's; here they are counted (the interpreter
    # takes ~20 ms a launch).
    reads = []
    monkeypatch.setattr(l2_prefetch, "touch_prefix",
                        lambda w, max_bytes, out: reads.append((w, max_bytes)))
    prefetch = L2Prefetch(model, max_bytes=4096, stream=None, max_batch=8, active=lambda: True)
    order = []
    for layer in model.model.layers:
        order += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                  layer.mlp.down_proj]
    assert [m for m in model.modules() if type(m) is Linear] == order

    got = [o.outputs[0].token_ids for o in llm.generate([short], params)]
    # The last pass was a decode step of one token: every linear layer but the first is read,
    # each after the one before it, 4096 bytes at most.
    assert [m for m, _ in prefetch.log] == order[1:]
    assert all(n == min(4096, m.weight.numel() * 4) for m, n in prefetch.log)
    assert reads[-len(order) + 1:] == [(m.weight, 4096) for m in order[1:]]
    assert got == want[:1]

    fresh = {"prompt_token_ids": list(range(100, 120))}  # no prefix-cache hit
    llm.generate([fresh], SamplingParams(temperature=0.0, max_tokens=1))
    assert prefetch.log == []  # a 20-token prefill is past max_batch
    got = [o.outputs[0].token_ids for o in llm.generate([short, long], params)]
    assert got == want

    prefetch.remove()
    prefetch.log = []
    llm.generate([short], params)
    assert prefetch.log == []  # the hooks are gone
