"""Make NVFP4 checkpoints from BF16 diffusers transformers with this package's own quantizer (docs/checkpoints.md).

``quantize_transformer`` (``diffusers-nvfp4-fast quantize``): streamed layer by layer, input scales calibrated
through the user's pipeline or computed per call, the BF16-kept layers from ModelOpt's per-model recipes;
``quantize_text_encoder`` (``--subfolder text_encoder``): the same for a pipeline's text encoder, ModelOpt's LLM recipe.
"""

from .text_encoder import quantize_text_encoder
from .transformer import QuantizedCheckpoint, quantize_transformer

__all__ = ["QuantizedCheckpoint", "quantize_text_encoder", "quantize_transformer"]
