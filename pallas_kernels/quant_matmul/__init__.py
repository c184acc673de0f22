"""A Linear layer's product over ggml-quantized base blocks with 1-bit variant deltas."""

from .api import IMPLEMENTATIONS, fallback_reasons, quant_matmul
from .blocks import (
  FORMATS,
  QuantizedKernel,
  dequantize,
  dequantize_jnp,
  from_ggml_rows,
  permute_columns,
  quantize,
  quantize_rows,
  take_columns,
  to_ggml_rows,
)

__all__ = ["FORMATS", "IMPLEMENTATIONS", "QuantizedKernel", "dequantize", "dequantize_jnp",
           "fallback_reasons", "from_ggml_rows", "permute_columns", "quant_matmul", "quantize",
           "quantize_rows", "take_columns", "to_ggml_rows"]
