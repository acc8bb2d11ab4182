"""GPU: whole blocks and tiny pipelines give the same bytes with fast paths on and off, eager, compiled, graphed."""

import pytest
import torch
from torch import nn

from diffusers_nvfp4_fast import disable_fast_paths, enable_fast_paths, fast_path_report, load_nvfp4_transformer, tiny
from diffusers_nvfp4_fast.gates import new_stats
from diffusers_nvfp4_fast.patches.flux2 import patch_flux2
from diffusers_nvfp4_fast.patches.qwenimage import patch_qwenimage

pytestmark = pytest.mark.gpu


class _Holder(nn.Module):
    """Gives a lone block the attribute the model patchers walk."""

    def __init__(self, name: str, block: nn.Module):
        super().__init__()
        setattr(self, name, nn.ModuleList([block]))


def _patched(holder, patcher):
    stats_id, stats = new_stats("always")
    restore = []
    assert patcher(holder, stats_id, restore) == 1
    return stats, restore


@torch.inference_mode()
def test_full_size_flux2_dev_single_block_identical():
    from diffusers.models.transformers.transformer_flux2 import Flux2SingleTransformerBlock

    torch.manual_seed(0)
    dim, rows_img, rows_txt = 6144, 4096, 512
    block = Flux2SingleTransformerBlock(dim=dim, num_attention_heads=48, attention_head_dim=128, mlp_ratio=3.0)
    block = block.to("cuda", torch.bfloat16)
    holder = _Holder("single_transformer_blocks", block)
    assert tiny.quantize_model_inplace(holder, (), 12.0) == 2
    for batch in (1, 2):
        h = torch.randn(batch, rows_img + rows_txt, dim, device="cuda", dtype=torch.bfloat16)
        temb = torch.randn(batch, 3 * dim, device="cuda", dtype=torch.bfloat16) * 0.1
        off = block(h, None, temb)
        stats, restore = _patched(holder, patch_flux2)
        on = block(h, None, temb)
        for undo in restore:
            undo()
        assert stats.fused_calls["flux2_token_cat"] == 1 and stats.verified["flux2_token_cat"] == 1
        assert torch.equal(on, off)


@torch.inference_mode()
def test_full_size_qwen_block_identical():
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    torch.manual_seed(0)
    dim = 3072
    block = QwenImageTransformerBlock(dim=dim, num_attention_heads=24, attention_head_dim=128).to("cuda", torch.bfloat16)
    holder = _Holder("transformer_blocks", block)
    tiny.quantize_model_inplace(holder, (), 16.0)
    for batch in (1, 2):
        img = torch.randn(batch, 4096, dim, device="cuda", dtype=torch.bfloat16)
        txt = torch.randn(batch, 512, dim, device="cuda", dtype=torch.bfloat16)
        temb = torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16)
        off = block(img, txt, None, temb)
        stats, restore = _patched(holder, patch_qwenimage)
        on = block(img, txt, None, temb)
        for undo in restore:
            undo()
        assert stats.fused_calls["qwen_resnorm"] == 2, fast_path_report
        assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])


@pytest.mark.parametrize("which", ["flux2", "klein", "qwen"])
def test_tiny_pipeline_png_identical_on_gpu(which, modelopt_exports):
    model = load_nvfp4_transformer(modelopt_exports(which), device="cuda")
    pipe, kwargs = tiny.TINY_PIPELINES[which](model)
    pipe.to("cuda")
    pipe.set_progress_bar_config(disable=True)
    off = tiny.png_sha256(tiny.run_pipeline(pipe, kwargs))
    report = enable_fast_paths(pipe)
    on = tiny.png_sha256(tiny.run_pipeline(pipe, kwargs))
    report = fast_path_report(pipe)
    disable_fast_paths(pipe)
    assert on == off
    entry = next(iter(report.values()))
    assert sum(entry["fused_calls"].values()) > 0 and entry["verifications"]["failed"] == 0, report


def _transformer_inputs(which, model):
    gen = torch.Generator("cuda").manual_seed(0)
    c = model.config
    if which == "qwen":
        return dict(hidden_states=torch.randn(1, 64, c.in_channels, device="cuda", generator=gen).bfloat16(),
                    encoder_hidden_states=torch.randn(1, 20, c.joint_attention_dim, device="cuda", generator=gen).bfloat16(),
                    encoder_hidden_states_mask=torch.ones(1, 20, dtype=torch.int64, device="cuda"),
                    timestep=torch.full((1,), 0.5, device="cuda").bfloat16(), img_shapes=[[(1, 8, 8)]], return_dict=False)
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(8.0), torch.arange(8.0), torch.zeros(1), indexing="ij"), -1)
    inputs = dict(hidden_states=torch.randn(1, 64, c.in_channels, device="cuda", generator=gen).bfloat16(),
                  encoder_hidden_states=torch.randn(1, 20, c.joint_attention_dim, device="cuda", generator=gen).bfloat16(),
                  timestep=torch.full((1,), 0.5, device="cuda").bfloat16(), img_ids=ids.reshape(-1, 4).cuda(),
                  txt_ids=torch.zeros(20, 4, device="cuda"), return_dict=False)
    if c.guidance_embeds:
        inputs["guidance"] = torch.full((1,), 4.0, device="cuda")
    return inputs


def _qwen_block_call(model, inputs):
    """Block 2 (NVFP4) of the Qwen model with inputs prepared outside: diffusers' Qwen forward copies host tensors
    (RoPE frequencies) on every call, which CUDA graph capture forbids with or without fast paths."""
    block = model.transformer_blocks[2]
    gen = torch.Generator("cuda").manual_seed(1)
    dim = block.dim
    img = torch.randn(1, 64, dim, device="cuda", generator=gen).bfloat16()
    txt = torch.randn(1, 20, dim, device="cuda", generator=gen).bfloat16()
    temb = torch.randn(1, dim, device="cuda", generator=gen).bfloat16()
    rope = model.pos_embed(inputs["img_shapes"], max_txt_seq_len=20, device=img.device)
    return lambda: block(img, txt, None, temb, rope)[1]


def _graph_replay(call):
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call()
    graph.replay()
    torch.cuda.synchronize()
    return static_out.clone()


@pytest.mark.parametrize("which", ["flux2", "qwen"])
def test_compile_fullgraph_and_cuda_graph_identical(which, modelopt_exports):
    """Fast paths stay active under torch.compile(fullgraph=True) and CUDA graph capture.

    aot_eager keeps eager numerics, so compiled-on must equal eager-off; inductor changes the numerics of the
    unfused parts of the model by itself, so there compiled-on must equal compiled-off. CUDA graphs: the whole
    FLUX.2 transformer; for Qwen-Image one NVFP4 block (see ``_qwen_block_call``).
    """
    import torch._inductor.config as inductor_config

    model = load_nvfp4_transformer(modelopt_exports(which), device="cuda")
    inputs = _transformer_inputs(which, model)
    with torch.inference_mode():
        graph_call = (lambda: model(**inputs)[0]) if which == "flux2" else _qwen_block_call(model, inputs)
        off = model(**inputs)[0].clone()
        graph_off = graph_call().clone()
        inductor_config.emulate_precision_casts = True
        torch._dynamo.reset()
        inductor_off = torch.compile(model, fullgraph=True)(**inputs)[0].clone()
        enable_fast_paths(model)
        eager_on = model(**inputs)[0].clone()
        torch._dynamo.reset()
        aot_on = torch.compile(model, fullgraph=True, backend="aot_eager")(**inputs)[0].clone()
        torch._dynamo.reset()
        inductor_on = torch.compile(model, fullgraph=True)(**inputs)[0].clone()
        inductor_config.emulate_precision_casts = False
        graphed_on = _graph_replay(graph_call)
    report = fast_path_report(model)
    disable_fast_paths(model)
    assert torch.equal(eager_on, off)
    assert torch.equal(aot_on, off)
    assert torch.equal(inductor_on, inductor_off)
    assert torch.equal(graphed_on, graph_off)
    entry = next(iter(report.values()))
    # fused calls were counted at run time from inside the compiled graphs too
    assert sum(entry["fused_calls"].values()) >= 4 and not entry["fallbacks"], report
