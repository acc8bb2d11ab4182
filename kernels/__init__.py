"""Triton kernels for NVFP4 (no diffusers import). Installed as ``diffusers_nvfp4_fast.kernels``."""
