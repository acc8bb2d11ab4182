"""Fast paths beside what users and diffusers install on a model: diffusers hooks registered before or after
enabling, attention processors and backends set while the fast paths are on (docs/design.md §5)."""

import pytest
from diffusers.hooks import HookRegistry, ModelHook

from diffusers_nvfp4_fast import (
    disable_fast_paths,
    enable_fast_paths,
    fast_path_report,
)
from support.fast_paths import (
    pipeline,
    sha,
)

pytestmark = pytest.mark.usefixtures("fresh_verdicts")


class _CountingHook(ModelHook):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs


@pytest.mark.parametrize("hooks_first", [True, False])
def test_composes_with_diffusers_hooks(hooks_first, modelopt_exports):
    pipe, kwargs = pipeline("qwen", modelopt_exports)
    model = pipe.transformer
    block = model.transformer_blocks[2]
    off = sha(pipe, kwargs)
    hook = _CountingHook()
    if hooks_first:
        HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, "count")
    enable_fast_paths(pipe)
    if not hooks_first:
        HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, "count")
    on = sha(pipe, kwargs)
    report = fast_path_report(pipe)["QwenImageTransformer2DModel"]
    assert on == off and hook.calls == 3 and report["fused_calls"]["qwen_resnorm"] == 12
    block._diffusers_hook.remove_hook("count")
    assert sha(pipe, kwargs) == off
    assert fast_path_report(pipe)["QwenImageTransformer2DModel"]["fused_calls"]["qwen_resnorm"] == 24
    disable_fast_paths(pipe)
    assert "forward" not in block.__dict__ or block.__dict__["forward"].__func__ is type(block).forward
    assert sha(pipe, kwargs) == off


def test_processor_choices_made_while_enabled_are_kept(modelopt_exports):
    """set_attention_backend reaches the processor the wrapper runs, and a processor the user installs while the
    fast paths are on is neither overwritten on disable nor fed an unbiased output."""
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    from diffusers_nvfp4_fast.patches import qwenimage

    pipe, kwargs = pipeline("qwen", modelopt_exports)
    model = pipe.transformer
    off = sha(pipe, kwargs)
    original = model.transformer_blocks[2].attn.processor
    enable_fast_paths(pipe)
    wrapper = model.transformer_blocks[2].attn.processor
    model.set_attention_backend("native")
    assert wrapper.processor._attention_backend == wrapper._attention_backend
    assert getattr(wrapper.processor._attention_backend, "value", None) == "native"
    user = QwenDoubleStreamAttnProcessor2_0()
    model.transformer_blocks[3].attn.processor = user
    assert qwenimage.bias_deferral_reason(model.transformer_blocks[3].attn) == "attention processor replaced"
    assert sha(pipe, kwargs) == off
    disable_fast_paths(pipe)
    assert model.transformer_blocks[3].attn.processor is user
    assert model.transformer_blocks[2].attn.processor is original  # under the wrapper ran the fused QK processor
    assert getattr(original._attention_backend, "value", None) == "native"  # the backend set meanwhile stays


def test_flux2_backend_and_parallel_config_set_while_enabled_outlive_disable(modelopt_exports):
    """diffusers' enable_parallelism and set_attention_backend write to whatever processor is installed; the fused
    FLUX.2 processors keep those settings on diffusers' processor, so disabling the fast paths loses neither (a
    restored processor without the parallel config would attend over one rank's half of the sequence)."""
    pipe, kwargs = pipeline("flux2", modelopt_exports)
    model = pipe.transformer
    off = sha(pipe, kwargs)
    originals = [b.attn.processor for b in model.single_transformer_blocks]
    enable_fast_paths(pipe)
    model.set_attention_backend("native")
    marker = object()
    for block in model.single_transformer_blocks:
        block.attn.processor._parallel_config = marker  # what enable_parallelism does to every processor
    fused = [b.attn.processor for b in model.single_transformer_blocks]
    assert all(p._parallel_config is marker for p in fused)
    for processor in fused:
        processor._parallel_config = None  # unset again, so the pipeline below runs on one process
    assert sha(pipe, kwargs) == off
    for processor in fused:
        processor._parallel_config = marker
    disable_fast_paths(pipe)
    restored = [b.attn.processor for b in model.single_transformer_blocks]
    assert all(a is b for a, b in zip(restored, originals))
    assert all(p._parallel_config is marker and getattr(p._attention_backend, "value", None) == "native"
               for p in restored)
