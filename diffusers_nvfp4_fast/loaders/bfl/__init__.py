"""NVFP4 single files: BFL / ComfyUI files of FLUX.2, Qwen-Image and Qwen-Image 2.1, diffusers' BFL files, and
declared layouts (metadata, families, names, config, the plan, and the loader)."""

from .materialize import (
           load_bfl_nvfp4_transformer,
           problems_message,
           resolve_single_file,
           stored_layer,
           unswizzle_checked,
)
from .plan import BflPlan, plan_bfl_checkpoint

__all__ = ["BflPlan", "load_bfl_nvfp4_transformer", "plan_bfl_checkpoint", "problems_message", "resolve_single_file",
           "stored_layer", "unswizzle_checked"]
