"""Launch settings of the Triton decode attention, tuned per GPU model.

The decode kernel's speed depends on its partition length, keys per tile, warps and pipelining
depth, and the best values differ by GPU and by batch size (one sequence wants many short
partitions, a full batch wants long ones). ``benchmarks/gpu/attention_bw.py --write-tuning``
times every variant on the GPU at hand and writes the winners to a JSON file; the kernel reads
the file for its device from ``tokenmill/attention/tuned/`` (or the file named by
``$TOKENMILL_DECODE_TUNING``) the way vLLM reads its per-device fused-MoE configs. Without a
file the defaults below apply.

File format::

    {"device": "NVIDIA H200",
     "by_batch": [{"max_batch": 8, "partition_size": 128, "block_n": 32, "num_warps": 4,
                   "num_stages": null},
                  {"max_batch": null, "partition_size": 512, ...}],
     "by_batch_fp8": [...]}

A batch of B sequences takes the first rule whose ``max_batch`` is at least B (null: any).
``by_batch_fp8`` (optional; ``attention_bw.py --kv-cache-dtype fp8`` writes it) holds the
rules for an fp8 KV cache, whose tiles are half the bytes and are widened in registers.
The choice depends on the batch size alone, never on the sequences' lengths, so a CUDA graph
captured for a batch size keeps one launch.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

ENV_FILE = "TOKENMILL_DECODE_TUNING"
TUNED_DIR = Path(__file__).with_name("tuned")
_MIN_DOT = 16  # tl.dot's smallest dimension on GPUs
FP8_COMPUTE = ("fp16", "query")


@dataclass(frozen=True)
class DecodeLaunch:
    """One launch of the decode split kernel: tokens per partition, keys per tile, warps per
    program and software-pipelining depth (None: Triton's default)."""

    partition_size: int = 512
    block_n: int = 32
    num_warps: int = 8
    num_stages: int | None = None
    # An fp8 cache's keys and values are widened in registers to this before the dot products:
    # "fp16" (e4m3 converts to it exactly, one instruction per pair; the queries are rounded to
    # it) or "query" (the queries' dtype, bf16 in a bf16 model). Ignored for other caches.
    fp8_compute: str = "fp16"

    def __post_init__(self) -> None:
        for name in ("partition_size", "block_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < _MIN_DOT or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {_MIN_DOT}, got {value!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if self.num_stages is not None and (not isinstance(self.num_stages, int)
                                            or not 1 <= self.num_stages <= 8):
            raise ValueError(f"num_stages must be null or 1..8, got {self.num_stages!r}")
        if self.fp8_compute not in FP8_COMPUTE:
            raise ValueError(f"fp8_compute must be one of {', '.join(FP8_COMPUTE)}, "
                             f"got {self.fp8_compute!r}")

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``triton_kernels.decode_attention``."""
        return asdict(self)


DEFAULT_LAUNCH = DecodeLaunch()


@dataclass(frozen=True)
class DecodeTuning:
    """Launch settings by batch size: ``rules`` are (max_batch or None, launch), in order;
    ``fp8_rules`` the same for an fp8 KV cache (empty: ``rules`` serve it too)."""

    rules: tuple[tuple[int | None, DecodeLaunch], ...] = ((None, DEFAULT_LAUNCH),)
    source: str = "defaults"
    fp8_rules: tuple[tuple[int | None, DecodeLaunch], ...] = ()

    def for_batch(self, batch: int, fp8_cache: bool = False) -> DecodeLaunch:
        for max_batch, launch in (self.fp8_rules if fp8_cache and self.fp8_rules
                                  else self.rules):
            if max_batch is None or batch <= max_batch:
                return launch
        return DEFAULT_LAUNCH


def _parse_rules(entries: Any, where: str) -> tuple[tuple[int | None, DecodeLaunch], ...]:
    """One list of rules (``by_batch`` or ``by_batch_fp8``); ValueError names the entry."""
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: expected a non-empty list")
    names = {f.name for f in fields(DecodeLaunch)}
    rules: list[tuple[int | None, DecodeLaunch]] = []
    last = 0
    for i, entry in enumerate(entries):
        at = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{at} must be an object")
        max_batch = entry.get("max_batch")
        if max_batch is not None and (not isinstance(max_batch, int) or max_batch <= last):
            raise ValueError(f"{at}: max_batch must be null or an integer above the "
                             f"previous rule's ({last}), got {max_batch!r}")
        if rules and rules[-1][0] is None:
            raise ValueError(f"{at} follows a rule for any batch (max_batch null)")
        try:
            launch = DecodeLaunch(**{k: v for k, v in entry.items() if k in names})
        except ValueError as e:
            raise ValueError(f"{at}: {e}") from None
        rules.append((max_batch, launch))
        last = max_batch or last
    return tuple(rules)


def parse_tuning(data: Any, source: str) -> DecodeTuning:
    """A DecodeTuning from a tuning file's JSON; ValueError names the file and the entry."""
    if not isinstance(data, dict) or not isinstance(data.get("by_batch"), list) \
            or not data["by_batch"]:
        raise ValueError(f"{source}: expected an object with a non-empty list 'by_batch'")
    rules = _parse_rules(data["by_batch"], f"{source}: by_batch")
    fp8_rules = (_parse_rules(data["by_batch_fp8"], f"{source}: by_batch_fp8")
                 if "by_batch_fp8" in data else ())
    return DecodeTuning(rules, source, fp8_rules)


def load_tuning(path: str | os.PathLike[str]) -> DecodeTuning:
    """Read a tuning file (see the module's docstring)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return parse_tuning(data, str(path))


def device_slug(device_name: str) -> str:
    """A file name for a GPU model: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


@functools.cache
def tuning_for_device(device_name: str) -> DecodeTuning:
    """The tuning for a GPU model: ``$TOKENMILL_DECODE_TUNING`` if set, else the packaged
    file for the device, else the defaults."""
    explicit = os.environ.get(ENV_FILE)
    if explicit:
        if not os.path.isfile(explicit):
            raise ValueError(f"${ENV_FILE}={explicit}: no such file")
        return load_tuning(explicit)
    path = TUNED_DIR / f"{device_slug(device_name)}.json"
    return load_tuning(path) if path.is_file() else DecodeTuning()
