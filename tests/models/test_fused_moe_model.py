"""A mixture-of-experts model bound to the CUDA kernel set runs its experts through the fused-MoE
Triton kernel (tokenmill/kernels/triton/fused_moe.py) and gives the logits and greedy tokens of
the same model on PyTorch's kernels.

The Triton kernels run on CPU tensors in the interpreter (fp32, fp16: the interpreter gets
bf16 wrong); tests/gpu/test_fused_moe_cuda.py has the kernel on a GPU.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
from quant_helpers import logits_of, tiny_arch, tiny_model  # noqa: E402

from tokenmill.models.kernel_binding import TORCH_KERNELS, bind_kernels  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs Triton kernels on CPU tensors: interpreter only (tests/gpu has the CUDA check)")
triton = pytest.importorskip("triton")

# Logits of the tiny model reach ~150; fp16 rounds them to 0.125 there.
TOL = {torch.float32: 1e-3, torch.float16: 0.25}


@pytest.mark.parametrize("architecture", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_moe_model_on_the_fused_kernel_matches_pytorch(
        architecture: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.kernels.triton import fused_moe as fm
    from tokenmill.models.kernel_binding import triton_kernels

    launches = []
    launch = fm._launch
    monkeypatch.setattr(fm, "_launch",
                        lambda *args, **kw: launches.append(1) or launch(*args, **kw))
    arch = replace(tiny_arch(architecture), num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=48, norm_topk_prob=True)
    model = tiny_model(arch).to(dtype)
    ids = list(range(3, 40))
    want = logits_of(bind_kernels(model, kernels=TORCH_KERNELS), ids)
    assert not launches
    got = logits_of(bind_kernels(model, kernels=triton_kernels()), ids)
    # Two launches a sparse layer, every layer sparse.
    assert len(launches) == 2 * arch.num_hidden_layers
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype]
    assert torch.equal(got.argmax(-1), want.argmax(-1))
