"""The ops, one file each (custom op, fake, dispatch, torch reference): ``quantize``, ``linear``,
``token_cat_quantize``, ``qwen_resnorm_quantize``; ``dispatch`` picks an implementation, ``verify`` does first-use
byte verification and keeps the counters. Import from the submodules; docs/design.md §2 draws the layering."""
