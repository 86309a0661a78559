"""The runner's side of LoRA: wrap the model's projections, keep adapters in device slots,
tell the layers which rows run which slot each step.

:class:`AdapterStore` holds checked adapters in host memory (least recently used dropped past
its capacity), read from their folders on first use. :class:`LoRAManager` wraps every decoder
layer's four projections in :class:`~tokenmill.lora.layers.LoRALinear` and keeps ``max_loras``
adapters in their slots, the least recently used one giving its slot to an adapter a step
needs. The scheduler puts at most ``max_loras`` adapters in one step, so a step's adapters
always fit.

Under tensor parallelism each rank keeps its slices, as of the weights: ``B`` rows of the
column-parallel projections (qkv, gate-up), ``A`` columns of the row-parallel ones (o, down),
whose partial updates the all-reduce after them adds up with the base product.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.config import LoRAConfig
from tokenmill.distributed import tp_rank, tp_size
from tokenmill.lora.adapter import LoRAAdapter, projection_shapes, read_adapter
from tokenmill.lora.layers import LoRALinear, LoRAStep, StepContext
from tokenmill.lora_request import LoRARequest
from tokenmill.models.config import ArchConfig


@dataclass(frozen=True)
class _Projection:
    """One adapted projection of a decoder layer: where it is, the Hugging Face projections
    fused in it (its parts), and whether its input columns are split across ranks."""

    block: str
    name: str
    modules: tuple[str, ...]
    row_parallel: bool


PROJECTIONS = (
    _Projection("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj"), False),
    _Projection("self_attn", "o_proj", ("o_proj",), True),
    _Projection("mlp", "gate_up_proj", ("gate_proj", "up_proj"), False),
    _Projection("mlp", "down_proj", ("down_proj",), True),
)


class AdapterStore:
    """Checked adapters by id, read on first use; thread-safe (the server's request threads
    check adapters while the engine thread reads them).

    ``in_use`` (set by the engine: its scheduler's ``lora_in_use``) says which adapters
    unfinished requests run: those stay in memory past the capacity and past
    :meth:`remove` until their requests end, so that filling a slot for them never reads a
    folder again (which may be gone by then)."""

    def __init__(self, arch: ArchConfig, config: LoRAConfig) -> None:
        self.arch = arch
        self.config = config
        self.in_use: Callable[[int], bool] = lambda lora_int_id: False
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        # Removed while in use: dropped once their requests have ended.
        self._removed: set[int] = set()
        self._lock = threading.Lock()

    def get(self, request: LoRARequest, replace: bool = False) -> LoRAAdapter:
        """The checked adapter of ``request`` (read from its folder unless held); ValueError
        when it cannot be served, or when its id already names another adapter's folder
        (with ``replace``, that adapter is read again from the new folder: the runner's
        reads of requests rank 0 has checked)."""
        with self._lock:
            held = self._adapters.get(request.lora_int_id)
            if held is not None and held.request.lora_path == request.lora_path:
                self._adapters.move_to_end(request.lora_int_id)
                if not replace:  # asked for again: no longer removed
                    self._removed.discard(request.lora_int_id)
                return held
            if held is not None:
                if not replace:
                    raise ValueError(
                        f"lora_int_id {request.lora_int_id} already names adapter "
                        f"{held.request.lora_name!r} from {held.request.lora_path!r}; give "
                        f"{request.lora_path!r} its own id")
        adapter = read_adapter(request, self.arch, self.config.max_lora_rank)
        with self._lock:
            self._adapters[request.lora_int_id] = adapter
            self._adapters.move_to_end(request.lora_int_id)
            if not replace:
                self._removed.discard(request.lora_int_id)
            self._evict()
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (once no unfinished request runs it); whether it was held."""
        with self._lock:
            held = lora_int_id in self._adapters and lora_int_id not in self._removed
            if self.in_use(lora_int_id):
                self._removed.add(lora_int_id)
            else:
                self._adapters.pop(lora_int_id, None)
            self._evict()
            return held

    def _evict(self) -> None:
        """Drop removed adapters and, past the capacity, the least recently used ones, of
        those no unfinished request runs (under the lock)."""
        for lora_int_id in list(self._adapters):
            if self.in_use(lora_int_id):
                continue
            if (lora_int_id in self._removed
                    or len(self._adapters) > self.config.cpu_capacity):
                del self._adapters[lora_int_id]
                self._removed.discard(lora_int_id)

    def ids(self) -> list[int]:
        """The adapters held and not removed."""
        with self._lock:
            self._evict()
            return [i for i in self._adapters if i not in self._removed]


class LoRAManager:
    """Slots for ``config.max_loras`` adapters in every projection of ``model``."""

    def __init__(self, model: nn.Module, arch: ArchConfig, config: LoRAConfig,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.store = AdapterStore(arch, config)
        self.context = StepContext()
        self.tp, self.rank = tp_size(), tp_rank()
        shapes = projection_shapes(arch)
        # Per decoder layer: projection name -> its LoRA layer.
        self.layers: list[dict[str, LoRALinear]] = []
        for layer in model.model.layers:
            wrapped = {}
            for proj in PROJECTIONS:
                block = getattr(layer, proj.block)
                in_features = shapes[proj.modules[0]][0]
                if proj.row_parallel:
                    in_features //= self.tp
                parts = tuple(shapes[m][1] // (1 if proj.row_parallel else self.tp)
                              for m in proj.modules)
                lora = LoRALinear(getattr(block, proj.name), in_features, parts,
                                  config.max_loras, config.max_lora_rank, dtype, device,
                                  self.context)
                setattr(block, proj.name, lora)
                wrapped[proj.name] = lora
            _plain_inputs(layer)
            self.layers.append(wrapped)
        # The adapter in each slot (None: empty), and the slots by last use, oldest first.
        self.slots: list[LoRARequest | None] = [None] * config.max_loras
        self._lru: list[int] = list(range(config.max_loras))

    @property
    def nbytes(self) -> int:
        """Device bytes of the slots."""
        return sum(p.nbytes for wrapped in self.layers for lora in wrapped.values()
                   for p in (lora.lora_a, lora.lora_b))

    def begin_step(self, runs: list[tuple[int, int, LoRARequest | None]], num_rows: int,
                   device: torch.device) -> None:
        """Set the step's rows: ``(first row, row count, adapter or None)`` per request, in
        batch order, of a step of ``num_rows`` rows. Loads adapters missing from the slots.
        ``context.step`` stays None when no row runs an adapter."""
        wanted = {r.lora_int_id: r for _, _, r in runs if r is not None}
        if not wanted:
            self.context.step = None
            return
        if len(wanted) > len(self.slots):
            raise RuntimeError(f"a step with {len(wanted)} adapters; max_loras is "
                               f"{len(self.slots)}")
        slot_of = {lora_id: self._slot_for(request, wanted)
                   for lora_id, request in wanted.items()}
        self.context.step = LoRAStep.from_row_slots(
            [(row0, n, slot_of[r.lora_int_id]) for row0, n, r in runs if r is not None],
            num_rows, len(self.slots), device)

    def end_step(self) -> None:
        self.context.step = None

    def remove(self, lora_int_id: int) -> bool:
        """Drop an adapter from host memory (once its unfinished requests end); safe from
        another thread than the steps'. Whether it was held. A slot holding it keeps it until
        another adapter needs the slot; a folder given again under the same id is read again
        (slots match adapters by id and folder)."""
        return self.store.remove(lora_int_id)

    def _slot_for(self, request: LoRARequest, step: dict[int, LoRARequest]) -> int:
        """The slot holding ``request``'s adapter, filled now if none does: an empty slot or
        the least recently used one whose adapter is not in the ``step``."""
        key = request.weights_key
        slot = next((s for s, held in enumerate(self.slots)
                     if held is not None and held.weights_key == key), None)
        if slot is None:
            slot = next(s for s in self._lru if not self._in_step(self.slots[s], step))
            self.slots[slot] = None
            self._load(slot, self.store.get(request, replace=True))
            self.slots[slot] = request
        self._lru.remove(slot)
        self._lru.append(slot)
        return slot

    @staticmethod
    def _in_step(held: LoRARequest | None, step: dict[int, LoRARequest]) -> bool:
        """Whether the adapter ``held`` in a slot runs in the step."""
        return held is not None and (
            (wanted := step.get(held.lora_int_id)) is not None
            and wanted.weights_key == held.weights_key)

    @torch.inference_mode()
    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy this rank's slices of ``adapter`` into ``slot`` of every layer."""
        for i, wrapped in enumerate(self.layers):
            for proj in PROJECTIONS:
                lora = wrapped[proj.name]
                lora.clear_slot(slot)
                for part, module in enumerate(proj.modules):
                    weights = adapter.weights.get((i, module))
                    if weights is None:
                        continue
                    a, b = weights.a, weights.b
                    if self.tp > 1:
                        if proj.row_parallel:
                            a = a.chunk(self.tp, dim=1)[self.rank]
                        else:
                            b = b.chunk(self.tp, dim=0)[self.rank]
                    lora.set_part(slot, part, a, b)


def _plain_inputs(layer: nn.Module) -> None:
    """Have the norms and the SiLU hand the adapted projections plain activations, not the fp8
    ones an Fp8Linear takes directly: the low-rank products read them too."""
    for module in (layer.input_layernorm, layer.post_attention_layernorm):
        if getattr(module, "fp8_out", False):
            module.fp8_out = False
    if getattr(layer.mlp, "fp8_act", False):
        layer.mlp.fp8_act = False
