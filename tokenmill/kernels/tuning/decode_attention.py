"""Launch settings of the Triton decode attention, tuned per GPU model.

The decode kernel's speed depends on its partition length, keys per tile, warps and pipelining
depth, and the best values differ by GPU and by batch size (one sequence wants many short
partitions, a full batch wants long ones). ``benchmarks/gpu/attention_bw.py --write-tuning``
times every variant on the GPU at hand and writes the winners to a JSON file; the kernel reads
the file for its device from ``tokenmill/kernels/tuning/attention/`` (or the file named by
``$TOKENMILL_DECODE_TUNING``) the way vLLM reads its per-device fused-MoE configs. Without a
file the defaults below apply.

File format::

    {"device": "NVIDIA H200",
     "by_batch": [{"max_batch": 8, "partition_size": 128, "block_n": 32, "num_warps": 4,
                   "num_stages": null},
                  {"max_batch": null, "max_context": 1024, "partition_size": 256, ...},
                  {"max_batch": null, "partition_size": 1024, ...}],
     "by_batch_fp8": [...]}

A decode step of B sequences whose longest context is L tokens takes the first rule whose
``max_batch`` is at least B (null: any) and whose ``max_context`` (optional, null: any) is at
least L: long contexts want long partitions, short ones many programs. ``by_batch_fp8``
(optional; ``attention_bw.py --kv-cache-dtype fp8`` writes it) holds the rules for an fp8 KV
cache, whose tiles are half the bytes and are widened in registers.

A replayed CUDA graph cannot change its launch, so the graph runner captures one graph per
batch size and *context class* (:meth:`DecodeTuning.context_classes`: the ``max_context``
bounds that can apply to that batch size) and replays the class of the step's longest context.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tokenmill import envs
from tokenmill.utils import optional_positive_ints

ENV_FILE = "TOKENMILL_DECODE_TUNING"
TUNED_DIR = Path(__file__).with_name("attention")
_MIN_DOT = 16  # tl.dot's smallest dimension on GPUs
FP8_COMPUTE = ("fp16", "query")


@dataclass(frozen=True)
class DecodeLaunch:
    """One launch of the decode split kernel: tokens per partition, keys per tile, warps per
    program, software-pipelining depth (None: Triton's default) and the settings below."""

    partition_size: int = 512
    block_n: int = 32
    num_warps: int = 8
    num_stages: int | None = None
    # An fp8 cache's keys and values are widened in registers to this before the dot products:
    # "fp16" (e4m3 converts to it exactly, one instruction per pair; the queries are rounded to
    # it) or "query" (the queries' dtype, bf16 in a bf16 model). Ignored for other caches.
    fp8_compute: str = "fp16"
    # Registers a thread may use (Triton's maxnreg; None: the compiler's choice, which takes
    # all 255 for the long tiles): fewer registers let more programs share an SM, whose loads
    # are then in flight together, at the cost of spills. The sweep decides.
    max_registers: int | None = None
    # Read a partition's block ids once, before its loop, rather than a tile's in each step:
    # the tiles' cache loads then depend on no load inside the loop, and Triton's pipeliner
    # keeps num_stages - 1 tiles in flight (with the per-tile read it waits for every copy
    # before each tile). It costs shared memory for the extra buffers, hence fewer programs
    # an SM; the sweep decides.
    preload_table: bool = False

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
        if self.max_registers is not None and (
                not isinstance(self.max_registers, int) or isinstance(self.max_registers, bool)
                or not 24 <= self.max_registers <= 255):
            raise ValueError(f"max_registers must be null or 24..255, got {self.max_registers!r}")
        if not isinstance(self.preload_table, bool):
            raise ValueError(f"preload_table must be true or false, got {self.preload_table!r}")
        if self.fp8_compute not in FP8_COMPUTE:
            raise ValueError(f"fp8_compute must be one of {', '.join(FP8_COMPUTE)}, "
                             f"got {self.fp8_compute!r}")

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``triton_kernels.decode_attention``."""
        return asdict(self)


DEFAULT_LAUNCH = DecodeLaunch()


@dataclass(frozen=True)
class DecodeRule:
    """Steps of at most ``max_batch`` sequences (None: any) whose longest context is at most
    ``max_context`` tokens (None: any) launch ``launch``."""

    max_batch: int | None
    launch: DecodeLaunch
    max_context: int | None = None

    def applies(self, batch: int, context: int | None) -> bool:
        """Whether a step of ``batch`` sequences with a longest context of ``context`` tokens
        matches (an unknown context matches rules for any context only)."""
        return ((self.max_batch is None or batch <= self.max_batch)
                and (self.max_context is None
                     or (context is not None and context <= self.max_context)))

    def covers(self, other: DecodeRule) -> bool:
        """Every step ``other`` matches, this rule matches too."""
        return (_at_least(self.max_batch, other.max_batch)
                and _at_least(self.max_context, other.max_context))


def _at_least(bound: int | None, other: int | None) -> bool:
    """``bound >= other`` where None is no bound."""
    return bound is None or (other is not None and bound >= other)


Rules = tuple[DecodeRule, ...]


@dataclass(frozen=True)
class DecodeTuning:
    """Launch settings by batch size and context: ``rules`` are matched in order (see the
    module's docstring); ``fp8_rules`` the same for an fp8 KV cache (empty: ``rules`` serve it
    too)."""

    rules: Rules = (DecodeRule(None, DEFAULT_LAUNCH),)
    source: str = "defaults"
    fp8_rules: Rules = ()

    def _rules(self, fp8_cache: bool) -> Rules:
        return self.fp8_rules if fp8_cache and self.fp8_rules else self.rules

    def for_batch(self, batch: int, fp8_cache: bool = False,
                  context: int | None = None) -> DecodeLaunch:
        """The launch of a decode step of ``batch`` sequences whose longest context is
        ``context`` tokens (None: unknown, only rules for any context match)."""
        for rule in self._rules(fp8_cache):
            if rule.applies(batch, context):
                return rule.launch
        return DEFAULT_LAUNCH

    def context_classes(self, batch: int, fp8_cache: bool = False) -> tuple[int | None, ...]:
        """The longest-context bounds at which the launch of ``batch`` sequences may change,
        ascending, ending with None (any context): a step takes the first class at least as
        long as its longest context, and ``for_batch(batch, fp8_cache, that class)`` is the
        launch it would get from its own context."""
        bounds = set()
        for rule in self._rules(fp8_cache):
            if rule.max_batch is None or batch <= rule.max_batch:
                if rule.max_context is None:
                    break
                bounds.add(rule.max_context)
        return (*sorted(bounds), None)


def _parse_rules(entries: Any, where: str) -> Rules:
    """One list of rules (``by_batch`` or ``by_batch_fp8``); ValueError names the entry."""
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: expected a non-empty list")
    names = {f.name for f in fields(DecodeLaunch)}
    rules: list[DecodeRule] = []
    for i, entry in enumerate(entries):
        at = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{at} must be an object")
        bounds = optional_positive_ints(entry, ("max_batch", "max_context"), at)
        try:
            launch = DecodeLaunch(**{k: v for k, v in entry.items() if k in names})
        except ValueError as e:
            raise ValueError(f"{at}: {e}") from None
        rule = DecodeRule(bounds["max_batch"], launch, bounds["max_context"])
        for j, earlier in enumerate(rules):
            if earlier.covers(rule):
                name = where.rsplit(": ", 1)[-1]  # the list's name, without the file's
                raise ValueError(f"{at} is never used: {name}[{j}] comes first and matches "
                                 "every step it would")
        rules.append(rule)
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
    return parse_tuning(read_json(path), str(path))


def read_json(path: str | os.PathLike[str]) -> Any:
    """A tuning file's JSON; ValueError naming the file where it is not JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None


def device_slug(device_name: str) -> str:
    """A file name for a GPU model: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def tuned_file(env_var: str, tuned_dir: Path, device_name: str) -> Path | None:
    """The tuning file for a GPU model: ``$env_var`` if set (ValueError if it names no file),
    else ``tuned_dir``'s file for the device if there is one, else None."""
    explicit = getattr(envs, env_var)
    if explicit:
        if not os.path.isfile(explicit):
            raise ValueError(f"${env_var}={explicit}: no such file")
        return Path(explicit)
    path = tuned_dir / f"{device_slug(device_name)}.json"
    return path if path.is_file() else None


@functools.cache
def tuning_for_device(device_name: str) -> DecodeTuning:
    """The tuning for a GPU model: ``$TOKENMILL_DECODE_TUNING`` if set, else the packaged
    file for the device, else the defaults."""
    path = tuned_file(ENV_FILE, TUNED_DIR, device_name)
    return DecodeTuning() if path is None else load_tuning(path)
