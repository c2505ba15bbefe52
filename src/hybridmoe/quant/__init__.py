"""Block quant formats: numpy reference (de)quantizers (formats, with the 4/5-bit and K-quant
layouts in block_types) and torch twins (torch_dequant).

Only numpy is imported here; `hybridmoe.quant.torch_dequant` pulls in torch when asked for.
"""

from hybridmoe.quant.block_types import Q8_0_EXACT_TYPES
from hybridmoe.quant.formats import SUPPORTED, dequantize, mxfp4_from_hf, quantize, to_q8_0

__all__ = ["Q8_0_EXACT_TYPES", "SUPPORTED", "dequantize", "mxfp4_from_hf", "quantize", "to_q8_0"]
