"""Which adapter a request runs with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter by name, id and folder (vLLM's ``LoRARequest``).

    ``lora_int_id`` identifies the adapter's weights in the engine: requests with the same id
    share its device slot and its prefix-cache entries, so a folder whose weights change must
    come back under a new id. ``lora_path`` is a PEFT folder (``adapter_config.json`` and
    ``adapter_model.safetensors``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int)
                or self.lora_int_id <= 0):
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def weights_key(self) -> tuple[int, str]:
        """What identifies its weights: the id and the folder (not the name)."""
        return self.lora_int_id, self.lora_path

    @property
    def cache_salt(self) -> bytes:
        """What the prefix cache chains a request's first block to: the same tokens under
        another adapter (or none) are other keys and values."""
        return f"lora:{self.lora_int_id}".encode()
