"""Test and demo helpers: tiny offline pipelines (``tiny``) and NVFP4 checkpoint writers (``export``)."""
