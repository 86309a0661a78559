"""Weight-only int8 / int4 quantization for the CPU (``--quantization none|int8|int4``).

``quantize_model`` swaps a loaded model's Linear layers and head for the modules in
``linear`` / ``head``; ``tokenmill.model_loader.gguf_quantized`` builds them straight from a
GGUF file's Q4_0 / Q4_1 blocks.
"""

from tokenmill.quant.head import QuantizedEmbedding, QuantizedHead
from tokenmill.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from tokenmill.quant.model import (
    DEFAULT_GROUP_SIZE,
    QUANT_METHODS,
    QuantizationSummary,
    check_quantization,
    quantize_model,
    quantize_weight,
)

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "QUANT_METHODS",
    "Int4WeightOnlyLinear",
    "Int8WeightOnlyLinear",
    "QuantizationSummary",
    "QuantizedEmbedding",
    "QuantizedHead",
    "check_quantization",
    "quantize_model",
    "quantize_weight",
]
