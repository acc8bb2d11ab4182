"""The BFL / ComfyUI FLUX.2 NVFP4 single-file format: metadata, names, config, the plan, and the loader."""

from .materialize import load_bfl_nvfp4_transformer, resolve_single_file, unswizzle_checked
from .plan import BflPlan, plan_bfl_checkpoint

__all__ = ["BflPlan", "load_bfl_nvfp4_transformer", "plan_bfl_checkpoint", "resolve_single_file", "unswizzle_checked"]
