"""LoRA adapters served on one base model (vLLM's multi-LoRA serving).

- :mod:`tokenmill.lora_request`: :class:`LoRARequest`, which adapter a request runs with.
- :mod:`tokenmill.lora.adapter`: reading and checking a PEFT adapter folder against the model.
- :mod:`tokenmill.lora.layers`: :class:`LoRALinear`, a projection plus the low-rank updates of
  the adapters in its device slots, each applied to its own requests' rows.
- :mod:`tokenmill.lora.manager`: the runner's side: wrapping the model, filling slots, telling
  the layers which rows use which slot each step.
"""

from tokenmill.lora_request import LoRARequest

__all__ = ["LoRARequest"]
