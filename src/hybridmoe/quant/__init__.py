"""Block quant formats: numpy reference (de)quantizers (formats) and torch twins (torch_dequant).

Only numpy is imported here; `hybridmoe.quant.torch_dequant` pulls in torch when asked for.
"""

from hybridmoe.quant.formats import SUPPORTED, dequantize, mxfp4_from_hf, quantize

__all__ = ["SUPPORTED", "dequantize", "mxfp4_from_hf", "quantize"]
