"""Weight/activation quantization of the model's linear layers (`--quantization`, FP8 checkpoints)."""

from compilelm.layers.quantization.checkpoint import (
    finalize_fp8_checkpoint,
    fp8_checkpoint_tensors,
    prepare_fp8_checkpoint,
)
from compilelm.layers.quantization.fp8 import (
    QUANTIZATION_METHODS,
    Fp8BlockLinearMethod,
    Fp8LinearMethod,
    calibrate,
    quantize_model,
    quantize_weight_per_channel,
)
from compilelm.layers.quantization.scheme import Fp8Scheme, UnsupportedQuantization, parse_quantization_config

__all__ = ["QUANTIZATION_METHODS", "Fp8BlockLinearMethod", "Fp8LinearMethod", "Fp8Scheme", "UnsupportedQuantization",
           "calibrate", "finalize_fp8_checkpoint", "fp8_checkpoint_tensors", "parse_quantization_config",
           "prepare_fp8_checkpoint", "quantize_model", "quantize_weight_per_channel"]
