"""Weight/activation quantization of the model's linear layers (`--quantization`)."""

from compilelm.layers.quantization.checkpoint import checkpoint_quantization, dequantize_fp8_weights
from compilelm.layers.quantization.fp8 import (
    QUANTIZATION_METHODS,
    Fp8LinearMethod,
    calibrate,
    quantize_model,
    quantize_weight_per_channel,
)

__all__ = ["QUANTIZATION_METHODS", "Fp8LinearMethod", "calibrate", "checkpoint_quantization",
           "dequantize_fp8_weights", "quantize_model", "quantize_weight_per_channel"]
