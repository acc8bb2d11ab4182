"""The ops, one file each: ``quantize``, ``linear`` (the NVFP4 GEMM), and the fused ops, each declared once with
``fused.FusedOp`` (its forms' torch references, kernel calls and checked custom ops; its selftest probe) and listed
in ``registry.FUSED_OPS``: ``token_cat_quantize``,
``swiglu_quantize``, ``gelu_quantize``, ``layer_norm_quantize`` (residual-norm and adaptive-LayerNorm quantize),
``rotary``, ``qk_norm_rotary``. ``dispatch`` picks an implementation, ``verify`` does first-use byte verification
and keeps the counters, ``site`` names the site kinds. Import from the submodules; docs/design.md §2 draws the
layering."""
