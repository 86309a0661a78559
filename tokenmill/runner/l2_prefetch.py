"""Warm the GPU's L2 cache with a matmul's weights while the small kernels before it run: an
experiment for batch-1 decode, on with ``TOKENMILL_L2_PREFETCH=<MB>`` (off by default).

At batch 1 a decode step is its matmuls streaming the weights from HBM (91% of the copy
bandwidth in the fifth GPU run) plus ~0.7 ms of small kernels between them (norms, rotary,
attention, SiLU), during which HBM is nearly idle. Hopper's L2 holds 50 MB, more than
Llama-3.1-8B's o_proj (32 MB). So as soon as one linear layer's product has been queued, a
side stream waits for it and reads the first bytes of the next linear layer's weight; the
small kernels in between run beside that read, and the next product finds the weight's first
rows in L2. Only inside captured decode graphs of small batches (the fork and the join become
edges of the graph); eager steps never fork.

Needs Triton (import it only where it is installed); the read is a Triton kernel whose
programs sum their slices into one float each, so that the compiler keeps the loads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill import envs
from tokenmill.kernels.triton.l2_prefetch import BLOCK, NUM_PROGRAMS, touch_prefix
from tokenmill.models.layers import Linear

ENV = "TOKENMILL_L2_PREFETCH"
def prefetch_bytes_from_env() -> int:
    """The bytes read ahead of each matmul that ``TOKENMILL_L2_PREFETCH`` asks for (in MB);
    0 when it is unset or 0. ValueError naming the variable for anything but a whole number."""
    return envs.TOKENMILL_L2_PREFETCH << 20


class L2Prefetch:
    """Forward hooks on ``model``: after each unquantized linear layer's product is queued, read
    the first ``max_bytes`` of the next one's weight (in the order the layers are registered,
    which is the order a decoder runs them) on ``stream``, which waits for that product
    first; the model's forward joins the stream again before it returns.

    ``stream`` None reads on the current stream (tests on the CPU); ``active`` says whether a
    forward pass should prefetch at all (by default: while a CUDA graph is being captured),
    and only passes of at most ``max_batch`` tokens do (the model's first argument).
    """

    def __init__(self, model: nn.Module, max_bytes: int, stream: torch.cuda.Stream | None,
                 max_batch: int = 8,
                 active: Callable[[], bool] = torch.cuda.is_current_stream_capturing) -> None:
        self.max_bytes = max_bytes
        self.stream = stream
        # Only forward passes of at most this many tokens prefetch: at larger batches the
        # products are long enough that the weights' reads are not the whole of them.
        self.max_batch = max_batch
        self.active = active
        self._on = False
        linears = [m for m in model.modules() if type(m) is Linear]
        self.next_of = {a: b for a, b in zip(linears, linears[1:], strict=False)}
        device = linears[0].weight.device if linears else torch.device("cpu")
        self.sums = torch.zeros(NUM_PROGRAMS, dtype=torch.float32, device=device)
        if linears:  # compile and load the kernel now, outside any capture
            touch_prefix(linears[0].weight, BLOCK * 2, self.sums)
        self.forked = False
        # Each prefetch of the latest forward pass, as (layer read, its bytes): for tests.
        self.log: list[tuple[nn.Module, int]] = []
        self._handles = [m.register_forward_hook(self._after_product) for m in self.next_of]
        self._handles += [model.register_forward_pre_hook(self._begin),
                          model.register_forward_hook(self._join)]

    def remove(self) -> None:
        """Take the hooks off the model."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _begin(self, module: nn.Module, args: tuple) -> None:
        self.log = []
        self.forked = False
        tokens = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) else None
        self._on = tokens is not None and tokens <= self.max_batch and self.active()

    def _after_product(self, module: nn.Module, args: object, output: object) -> None:
        if not self._on:
            return
        nxt = self.next_of[module]
        weight = nxt.weight
        self.log.append((nxt, min(weight.numel() * weight.element_size(), self.max_bytes)))
        if self.stream is None:
            touch_prefix(weight, self.max_bytes, self.sums)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            touch_prefix(weight, self.max_bytes, self.sums)
        self.forked = True

    def _join(self, module: nn.Module, args: object, output: object) -> None:
        if self.forked and self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self.forked = False
