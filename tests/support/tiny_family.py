"""Tiny offline pipelines of every FLUX.2 and Qwen-Image pipeline class diffusers 0.42.1 ships: the pipeline matrix
(tests/test_pipeline_matrix.py, the table in docs/pipelines.md).

Each case takes an NVFP4 transformer and returns ``(pipe, call kwargs)``; ``generate`` runs it. Two things make the
image-conditioned Qwen-Image pipelines buildable offline and cheap, and change no code path:
- ``ImageOnlyQwen2VLProcessor`` / ``ImageOnlyQwen3VLProcessor``: transformers' processors without their video
  processor, which needs torchvision (the pipelines never pass videos);
- ``small_target_areas``: the pipelines size their condition and output images from fixed pixel areas (1024x1024,
  384x384, 640x640); inside it every such area is divided by ``AREA_DIVISOR`` (1024x1024 -> 64x64).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from PIL import Image
from torch import nn
from transformers import Qwen2VLProcessor, Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

from diffusers_nvfp4_fast.loaders.common import is_excluded
from diffusers_nvfp4_fast.testing import tiny
from diffusers_nvfp4_fast.testing.export import calibrate_input_amax, export_nvfp4
from diffusers_nvfp4_fast.utils import png_sha256

AREA_DIVISOR = 256  # 1024x1024 -> 64x64: Qwen-Image's fixed target areas, scaled for a 4x-downsampling tiny VAE
_AREA_MODULES = (
    "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit",
    "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus",
    "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_inpaint",
    "diffusers.pipelines.qwenimage.pipeline_qwenimage_layered",
    "diffusers.pipelines.qwenimage21.pipeline_qwenimage21",
)
SIZE = 32  # output height and width of every case
PICTURE = 64  # input images and masks (FLUX.2 refuses reference images under 64 px; its inpaint case uses SIZE)
QWEN_TEXT_TOKENS = 64  # max_sequence_length: the pipelines that truncate their text tokens keep this many
QWEN21_EXCLUDE = ("img_in", "txt_in*", "proj_out", "norm_out*", "time_text_embed*", "modulation*")


@contextlib.contextmanager
def small_target_areas() -> Iterator[None]:
    """Inside: each Qwen-Image pipeline's ``calculate_dimensions(target_area, ratio)`` sees the area divided by
    ``AREA_DIVISOR`` (its rounding to multiples of 32 is diffusers' own)."""
    with contextlib.ExitStack() as stack:
        for name in _AREA_MODULES:
            module = importlib.import_module(name)
            original = module.calculate_dimensions

            def scaled(target_area, ratio, _original=original):
                return _original(target_area / AREA_DIVISOR, ratio)

            stack.enter_context(mock.patch.object(module, "calculate_dimensions", scaled))
        yield


# ---------------------------------------------------------------------------------------------------------------
# Vision-language text encoders: tokenizer with vision tokens, processors without torchvision.
# ---------------------------------------------------------------------------------------------------------------

_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def qwen_vl_tokenizer():
    """``tiny.qwen_tokenizer``'s byte vocabulary (ids 0-258) plus the vision tokens at ids 259-262."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = tiny._byte_vocab(specials)
    for token in _VISION_TOKENS:
        vocab[token] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], chat_template=tiny._QWEN_TEMPLATE)
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in [*specials[1:], *_VISION_TOKENS]],
                   special_tokens=True)
    return tok


def _vision_ids(tokenizer) -> dict[str, Any]:
    ids = tokenizer.convert_tokens_to_ids(list(_VISION_TOKENS))
    return dict(vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2],
                video_token_id=ids[3])


def _init_without_video(processor, image_processor, tokenizer, chat_template) -> None:
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    processor.video_token_id = tokenizer.convert_tokens_to_ids(processor.video_token)
    ProcessorMixin.__init__(processor, image_processor, tokenizer, chat_template=chat_template)


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with an image processor and a tokenizer only: its video processor needs torchvision.
    transformers reads a processor's parts from its ``__init__`` signature."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        _init_without_video(self, image_processor, tokenizer, chat_template)


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` without its video processor (as above)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        _init_without_video(self, image_processor, tokenizer, chat_template)
        self.vision_start_token = "<|vision_start|>"
        self.vision_end_token = "<|vision_end|>"
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)


def tiny_qwen_vl_parts() -> dict[str, Any]:
    """The tiny Qwen2.5-VL text encoder (BF16), its tokenizer and processor: the image-conditioned Qwen-Image
    pipelines' ``text_encoder``, ``tokenizer`` and ``processor``. Its vision tower reads 14x14 patches."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    tokenizer = qwen_vl_tokenizer()
    text = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=272, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                rope_theta=1e6)
    vision = dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16)
    config = Qwen2_5_VLConfig(  # type: ignore[call-arg]  # transformers' configs take extra attributes as kwargs
        text_config=text, vision_config=vision, hidden_size=16, vocab_size=272, **_vision_ids(tokenizer))
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval().to(torch.bfloat16)
    processor = ImageOnlyQwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer)
    return dict(text_encoder=text_encoder, tokenizer=tokenizer, processor=processor)


# ---------------------------------------------------------------------------------------------------------------
# Transformers beyond tiny.py's: Qwen-Image variants and Qwen-Image 2.1.
# ---------------------------------------------------------------------------------------------------------------


MATRIX_QWEN_LAYERS = 5
MATRIX_QWEN_EXCLUDE = tiny.qwen_exclude(MATRIX_QWEN_LAYERS)  # blocks 0, 1, 3, 4 BF16: block 2 is NVFP4


def tiny_matrix_qwen_transformer(seed: int = 0, latent_channels: int = 4, **flags: bool) -> nn.Module:
    """The matrix's Qwen-Image transformer: 5 blocks of width 256 (2 heads x 128), block 2 NVFP4 under the public
    exclusion rule (cheaper than ``tiny.tiny_qwen_transformer``). Config flags: ``zero_cond_t``
    (Qwen-Image-Edit-2511), ``use_additional_t_cond`` and ``use_layer3d_rope`` (Qwen-Image-Layered)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(  # type: ignore[attr-defined]  # mypy picks diffusers' dummy placeholder
        patch_size=2, in_channels=4 * latent_channels, out_channels=latent_channels, num_layers=MATRIX_QWEN_LAYERS,
        attention_head_dim=128, num_attention_heads=2, joint_attention_dim=16, guidance_embeds=False,
        axes_dims_rope=(16, 56, 56), **flags,
    ).to(torch.bfloat16).eval()


def tiny_qwen21_transformer(seed: int = 0, **config: Any) -> nn.Module:
    """Qwen-Image 2.1: 2 blocks of width 256 (2 heads x 128), 16 latent channels, causal condition (KV cache);
    ``config`` overrides diffusers' arguments (e.g. ``causal_condition=False``)."""
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(seed)
    return QwenImage21Transformer2DModel(  # type: ignore[attr-defined]  # (as above)
        **{**dict(patch_size=1, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=128,
                  num_attention_heads=2, context_in_dim=16, mlp_ratio=3, axes_dims_rope=(32, 48, 48)), **config},
    ).to(torch.bfloat16).eval()


def calibrated_amax(pipe, kwargs: dict, exclude: tuple[str, ...]) -> dict[str, float]:
    """Max |input| of each non-excluded Linear of ``pipe.transformer`` over one 1-step generation."""
    model = pipe.transformer
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not is_excluded(n, list(exclude))]

    def run() -> None:
        generate(pipe, kwargs, steps=1)

    return calibrate_input_amax(model, run, names)


def write_matrix_transformers(out_dir: str | Path) -> dict[str, Path]:
    """Write the matrix's own NVFP4 transformers (``VARIANTS``) as ModelOpt-style exports with this package's writer
    (``export.export_nvfp4``), calibrated on one generation; returns {variant: export directory}. The Qwen-Image
    variants share their calibration: their quantized layers have the same names and weights (same seed)."""
    out_dir = Path(out_dir)
    base, kwargs = qwen_text_to_image(tiny_matrix_qwen_transformer())
    base.set_progress_bar_config(disable=True)
    qwen_amax = calibrated_amax(base, kwargs, MATRIX_QWEN_EXCLUDE)
    qwen21, qwen21_kwargs = tiny_qwen21_pipeline()
    qwen21.set_progress_bar_config(disable=True)
    amax = {"qwen21": calibrated_amax(qwen21, qwen21_kwargs, QWEN21_EXCLUDE)}
    written = {}
    for name, (make, exclude) in VARIANTS.items():
        written[name] = export_nvfp4(make(), out_dir / name, exclude, amax.get(name, qwen_amax))
    return written


# ---------------------------------------------------------------------------------------------------------------
# Pipelines.
# ---------------------------------------------------------------------------------------------------------------


def _picture(seed: int = 0, size: int = PICTURE, mode: str = "RGB") -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size, size, len(mode)), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), mode=mode)


def _mask(size: int = PICTURE) -> Image.Image:
    mask = torch.zeros(size, size, dtype=torch.uint8)
    mask[size // 4: 3 * size // 4, size // 4: 3 * size // 4] = 255
    return Image.fromarray(mask.numpy(), mode="L")


def _sized(kwargs: dict) -> dict:
    return {**kwargs, "height": SIZE, "width": SIZE}


def flux2_text_to_image(transformer: nn.Module):
    pipe, kwargs = tiny.tiny_flux2_pipeline(transformer)
    return pipe, _sized(kwargs)


def flux2_reference_image(transformer: nn.Module):
    """Flux2Pipeline with one reference image: its latents join the image tokens."""
    pipe, kwargs = tiny.tiny_flux2_pipeline(transformer)
    return pipe, _sized({**kwargs, "image": [_picture(1)]})


def klein_text_to_image(transformer: nn.Module):
    pipe, kwargs = tiny.tiny_klein_pipeline(transformer)
    return pipe, _sized(kwargs)


def _klein_as(name: str, transformer: nn.Module):
    import diffusers

    base, kwargs = tiny.tiny_klein_pipeline(transformer)
    return getattr(diffusers, name).from_pipe(base, torch_dtype=torch.bfloat16), kwargs


def klein_kv(transformer: nn.Module):
    """Flux2KleinKVPipeline with a reference image: step 0 runs ``kv_cache_mode="extract"``, later steps
    ``"cached"``."""
    pipe, kwargs = _klein_as("Flux2KleinKVPipeline", transformer)
    kwargs = {k: v for k, v in kwargs.items() if k != "guidance_scale"}  # distilled: no guidance argument
    return pipe, _sized({**kwargs, "image": [_picture(1)]})


def klein_inpaint(transformer: nn.Module):
    pipe, kwargs = _klein_as("Flux2KleinInpaintPipeline", transformer)
    return pipe, _sized({**kwargs, "image": _picture(1, SIZE), "mask_image": _mask(SIZE), "strength": 0.9})


def qwen_text_to_image(transformer: nn.Module):
    pipe, kwargs = tiny.tiny_qwen_pipeline(transformer)
    return pipe, _sized({**kwargs, "max_sequence_length": QWEN_TEXT_TOKENS})


def _qwen_as(name: str, transformer: nn.Module, **components):
    import diffusers

    base, kwargs = tiny.tiny_qwen_pipeline(transformer)
    pipe = getattr(diffusers, name).from_pipe(base, **components, torch_dtype=torch.bfloat16)
    return pipe, {**kwargs, "max_sequence_length": QWEN_TEXT_TOKENS}


def qwen_img2img(transformer: nn.Module):
    pipe, kwargs = _qwen_as("QwenImageImg2ImgPipeline", transformer)
    return pipe, _sized({**kwargs, "image": _picture(1), "strength": 0.9})


def qwen_inpaint(transformer: nn.Module):
    pipe, kwargs = _qwen_as("QwenImageInpaintPipeline", transformer)
    return pipe, _sized({**kwargs, "image": _picture(1), "mask_image": _mask(), "strength": 0.9})


def qwen_edit(transformer: nn.Module):
    """QwenImageEditPipeline: the condition image's latents join the image tokens, the text encoder sees it."""
    pipe, kwargs = _qwen_as("QwenImageEditPipeline", transformer, **tiny_qwen_vl_parts())
    return pipe, _sized({**kwargs, "image": _picture(1)})


def qwen_edit_plus(transformer: nn.Module):
    """QwenImageEditPlusPipeline with two condition images."""
    pipe, kwargs = _qwen_as("QwenImageEditPlusPipeline", transformer, **tiny_qwen_vl_parts())
    return pipe, _sized({**kwargs, "image": [_picture(1), _picture(2)]})


def qwen_edit_inpaint(transformer: nn.Module):
    pipe, kwargs = _qwen_as("QwenImageEditInpaintPipeline", transformer, **tiny_qwen_vl_parts())
    return pipe, _sized({**kwargs, "image": _picture(1), "mask_image": _mask(), "strength": 0.9})


LAYERED_LATENT_CHANNELS = 8  # not 4: the layered pipeline takes a 4-channel input for latents when z_dim is 4


def tiny_rgba_vae() -> nn.Module:
    """Qwen-Image-Layered's VAE shape: RGBA in and out, ``LAYERED_LATENT_CHANNELS`` latent channels, 4x down."""
    from diffusers import AutoencoderKLQwenImage

    z = LAYERED_LATENT_CHANNELS
    torch.manual_seed(0)
    return AutoencoderKLQwenImage(base_dim=24, z_dim=z, dim_mult=[1, 2, 4], num_res_blocks=1,
                                  temperal_downsample=[False, True], input_channels=4, latents_mean=[0.0] * z,
                                  latents_std=[1.0] * z).to(torch.bfloat16)  # type: ignore[attr-defined]


def qwen_layered(transformer: nn.Module):
    """QwenImageLayeredPipeline: 2 layers from an RGBA image; the output size follows ``resolution``."""
    pipe, kwargs = _qwen_as("QwenImageLayeredPipeline", transformer, vae=tiny_rgba_vae(), **tiny_qwen_vl_parts())
    return pipe, {**kwargs, "image": _picture(1, mode="RGBA"), "layers": 2, "resolution": 640}


def tiny_qwen_controlnet(extra_condition_channels: int = 0, seed: int = 1) -> nn.Module:
    """A 2-block Qwen-Image ControlNet of ``tiny_matrix_qwen_transformer``'s width, its zero-initialized
    projections drawn at random (so its residuals are not zero)."""
    from diffusers import QwenImageControlNetModel

    torch.manual_seed(seed)
    controlnet: Any = QwenImageControlNetModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=128, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(16, 56, 56), extra_condition_channels=extra_condition_channels,
    )
    with torch.no_grad():
        for module in [*controlnet.controlnet_blocks, controlnet.controlnet_x_embedder]:
            nn.init.normal_(module.weight, std=0.02)
    return controlnet.to(torch.bfloat16).eval()


def qwen_controlnet(transformer: nn.Module):
    pipe, kwargs = _qwen_as("QwenImageControlNetPipeline", transformer, controlnet=tiny_qwen_controlnet())
    return pipe, _sized({**kwargs, "control_image": _picture(3), "controlnet_conditioning_scale": 1.0})


def qwen_controlnet_inpaint(transformer: nn.Module):
    controlnet = tiny_qwen_controlnet(extra_condition_channels=4)  # the mask's 1 channel, packed 2x2
    pipe, kwargs = _qwen_as("QwenImageControlNetInpaintPipeline", transformer, controlnet=controlnet)
    return pipe, _sized({**kwargs, "control_image": _picture(3), "control_mask": _mask(),
                         "controlnet_conditioning_scale": 1.0})


def tiny_qwen21_pipeline(transformer: nn.Module | None = None):
    """QwenImage21Pipeline (Qwen3-VL text encoder, 16x VAE). Returns (pipe, call kwargs)."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = qwen_vl_tokenizer()
    text = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, head_dim=8, vocab_size=272, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                rope_scaling={"mrope_section": [2, 1, 1], "rope_type": "default"}, rope_theta=1e6)
    vision = dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                  deepstack_visual_indexes=[1], patch_size=16)
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **_vision_ids(tokenizer))
    torch.manual_seed(0)
    text_encoder = Qwen3VLForConditionalGeneration(config).eval()
    processor = ImageOnlyQwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil(patch_size=16),
                                          tokenizer=tokenizer, chat_template=tiny._QWEN_TEMPLATE)
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1, 1],
                                   num_res_blocks=1, latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
    pipe: Any = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                                    processor=processor, transformer=transformer or tiny_qwen21_transformer())
    pipe.to(torch.bfloat16)
    return pipe, dict(prompt="dance monkey", height=SIZE, width=SIZE)


# ---------------------------------------------------------------------------------------------------------------
# The matrix.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatrixCase:
    """One row of the pipeline matrix.

    ``transformer`` names the tiny NVFP4 transformer: ``"flux2"`` and ``"klein"`` are the ModelOpt exports of
    ``tiny.TINY_PIPELINES`` (tests/conftest.py ``modelopt_exports``); the others are ``VARIANTS``, written by
    ``write_matrix_transformers``. ``build`` maps that transformer to ``(pipe, call kwargs)``."""

    id: str
    pipeline: str
    transformer: str
    build: Callable[[nn.Module], tuple[Any, dict]]


VARIANTS: dict[str, tuple[Callable[[], nn.Module], tuple[str, ...]]] = {
    "qwen_small": (tiny_matrix_qwen_transformer, MATRIX_QWEN_EXCLUDE),
    "qwen_zero_cond_t": (lambda: tiny_matrix_qwen_transformer(zero_cond_t=True), MATRIX_QWEN_EXCLUDE),
    "qwen_layered": (lambda: tiny_matrix_qwen_transformer(latent_channels=LAYERED_LATENT_CHANNELS,
                                                          use_additional_t_cond=True, use_layer3d_rope=True),
                     MATRIX_QWEN_EXCLUDE),
    "qwen21": (tiny_qwen21_transformer, QWEN21_EXCLUDE),
}

MATRIX: tuple[MatrixCase, ...] = (
    MatrixCase("flux2", "Flux2Pipeline", "flux2", flux2_text_to_image),
    MatrixCase("flux2_reference", "Flux2Pipeline", "flux2", flux2_reference_image),
    MatrixCase("klein", "Flux2KleinPipeline", "klein", klein_text_to_image),
    MatrixCase("klein_kv", "Flux2KleinKVPipeline", "klein", klein_kv),
    MatrixCase("klein_inpaint", "Flux2KleinInpaintPipeline", "klein", klein_inpaint),
    MatrixCase("qwen", "QwenImagePipeline", "qwen_small", qwen_text_to_image),
    MatrixCase("qwen_img2img", "QwenImageImg2ImgPipeline", "qwen_small", qwen_img2img),
    MatrixCase("qwen_inpaint", "QwenImageInpaintPipeline", "qwen_small", qwen_inpaint),
    MatrixCase("qwen_edit", "QwenImageEditPipeline", "qwen_small", qwen_edit),
    MatrixCase("qwen_edit_plus", "QwenImageEditPlusPipeline", "qwen_small", qwen_edit_plus),
    MatrixCase("qwen_edit_plus_2511", "QwenImageEditPlusPipeline", "qwen_zero_cond_t", qwen_edit_plus),
    MatrixCase("qwen_edit_inpaint", "QwenImageEditInpaintPipeline", "qwen_small", qwen_edit_inpaint),
    MatrixCase("qwen_layered", "QwenImageLayeredPipeline", "qwen_layered", qwen_layered),
    MatrixCase("qwen_controlnet", "QwenImageControlNetPipeline", "qwen_small", qwen_controlnet),
    MatrixCase("qwen_controlnet_inpaint", "QwenImageControlNetInpaintPipeline", "qwen_small", qwen_controlnet_inpaint),
    MatrixCase("qwen21", "QwenImage21Pipeline", "qwen21", tiny_qwen21_pipeline),
)


def _images(output) -> list[Image.Image]:
    """The pipeline output's images, flattened (the layered pipeline returns a list of layers per prompt)."""
    flat: list[Image.Image] = []
    for item in output.images:
        flat.extend(item if isinstance(item, list) else [item])
    return flat


def generate(pipe, kwargs: dict, *, steps: int = 2, seed: int = 0) -> list[Image.Image]:
    """One deterministic generation of a matrix case (inside ``small_target_areas``); returns its images. The global
    RNG is seeded too, in a fork restored afterwards: QwenImageControlNetInpaintPipeline samples its control image's
    latents without the generator."""
    gen = torch.Generator("cpu").manual_seed(seed)
    with torch.random.fork_rng(devices=[]), torch.inference_mode(), small_target_areas():
        torch.manual_seed(seed)
        return _images(pipe(**kwargs, num_inference_steps=steps, generator=gen))


def images_sha256(images: list[Image.Image]) -> list[str]:
    """The PNG SHA256 of each image."""
    return [png_sha256(image) for image in images]
