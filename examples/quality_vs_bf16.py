"""How close NVFP4 images are to BF16 ones: PSNR and SSIM for the same prompts and seeds.

    python examples/quality_vs_bf16.py --tiny --model klein           # CPU, seconds: tiny model, made here
    python examples/quality_vs_bf16.py --pipeline black-forest-labs/FLUX.2-dev --nvfp4 flux2-dev-nvfp4 \\
        --prompts "a red fox in fresh snow" "a street market at dusk" --seeds 0 1 --device cuda

SSIM is the mean structural similarity of Wang, Bovik, Sheikh and Simoncelli, "Image quality assessment: from error
visibility to structural similarity", IEEE TIP 13(4), 2004: an 11x11 Gaussian window (sigma 1.5), K1 = 0.01,
K2 = 0.03, dynamic range L = 255, on each RGB channel, averaged. PSNR is ``10 log10(255^2 / MSE)`` over all pixels.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

SSIM_WINDOW, SSIM_SIGMA, SSIM_K1, SSIM_K2, DATA_RANGE = 11, 1.5, 0.01, 0.03, 255.0


def _pixels(image) -> torch.Tensor:
    """PIL image -> float64 ``[3, H, W]`` in 0..255."""
    import numpy as np

    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float64)).permute(2, 0, 1)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two ``[C, H, W]`` 0..255 images (inf when equal)."""
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10.0 * math.log10(DATA_RANGE**2 / mse)


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean SSIM (Wang et al. 2004) of two ``[C, H, W]`` 0..255 images, per channel then averaged; windows that do
    not fit the image are left out ("valid" filtering), so images must be at least 11x11."""
    if min(a.shape[-2:]) < SSIM_WINDOW:
        raise ValueError(f"SSIM needs images of at least {SSIM_WINDOW}x{SSIM_WINDOW}, got {tuple(a.shape[-2:])}")
    window = _gaussian_window(SSIM_WINDOW, SSIM_SIGMA)
    x, y = a[:, None].double(), b[:, None].double()  # channels as a batch of one-channel images

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, window)

    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    c1, c2 = (SSIM_K1 * DATA_RANGE) ** 2, (SSIM_K2 * DATA_RANGE) ** 2
    index = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return float(index.mean())


def compare(bf16_images: list, nvfp4_images: list) -> dict:
    """Per-image and mean PSNR / SSIM of NVFP4 against BF16."""
    rows = [{"psnr_db": psnr(_pixels(a), _pixels(b)), "ssim": ssim(_pixels(a), _pixels(b))}
            for a, b in zip(bf16_images, nvfp4_images)]
    return {"images": rows, "mean_psnr_db": sum(r["psnr_db"] for r in rows) / len(rows),
            "mean_ssim": sum(r["ssim"] for r in rows) / len(rows)}


def _generate(pipe, prompts: list[str], seeds: list[int], call: dict) -> list:
    images = []
    for prompt in prompts:
        for seed in seeds:
            with torch.inference_mode():
                images.append(pipe(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed),
                                   **call).images[0])
    return images


def tiny_run(model: str, prompts: list[str], seeds: list[int], size: int, steps: int) -> dict:
    """Tiny ``model`` pipeline: BF16 images, then its transformer quantized by ``quantize_transformer``."""
    from diffusers_nvfp4_fast import enable_fast_paths, load_nvfp4_transformer, quantize_transformer
    from diffusers_nvfp4_fast.testing import tiny

    pipe, kwargs = tiny.TINY_PIPELINES[model]()
    pipe.set_progress_bar_config(disable=True)
    call = {**{k: v for k, v in kwargs.items() if k != "prompt"}, "height": size, "width": size,
            "num_inference_steps": steps}
    bf16 = _generate(pipe, prompts, seeds, call)
    with tempfile.TemporaryDirectory() as tmp:
        pipe.transformer.save_pretrained(Path(tmp) / "bf16")
        quantize_transformer(Path(tmp) / "bf16", Path(tmp) / "nvfp4", pipeline=pipe, prompts=prompts,
                             call_kwargs={k: v for k, v in call.items() if k != "num_inference_steps"},
                             num_inference_steps=steps, progress=False)
        pipe.transformer = load_nvfp4_transformer(Path(tmp) / "nvfp4")
    enable_fast_paths(pipe)
    return compare(bf16, _generate(pipe, prompts, seeds, call))


def full_run(args: argparse.Namespace) -> dict:
    """The BF16 pipeline ``args.pipeline``, then the same with ``args.nvfp4`` as its transformer."""
    from diffusers import DiffusionPipeline

    from diffusers_nvfp4_fast import enable_fast_paths, load_nvfp4_transformer

    call = {"height": args.size, "width": args.size, "num_inference_steps": args.steps}
    pipe = DiffusionPipeline.from_pretrained(args.pipeline, torch_dtype=torch.bfloat16).to(args.device)
    pipe.set_progress_bar_config(disable=True)
    bf16 = _generate(pipe, args.prompts, args.seeds, call)
    del pipe.transformer
    pipe.transformer = load_nvfp4_transformer(args.nvfp4, device=args.device)
    enable_fast_paths(pipe)
    return compare(bf16, _generate(pipe, args.prompts, args.seeds, call))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny offline model, quantized here (CPU, seconds)")
    parser.add_argument("--model", default="klein", choices=["flux2", "klein", "qwen"], help="with --tiny")
    parser.add_argument("--pipeline", help="the BF16 pipeline (directory or repo id)")
    parser.add_argument("--nvfp4", help="the NVFP4 transformer checkpoint (anything load_nvfp4_transformer reads)")
    parser.add_argument("--prompts", nargs="+", default=["a red fox in fresh snow", "a street market at dusk"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--size", type=int, help="image height and width (default 1024; 32 with --tiny)")
    parser.add_argument("--steps", type=int, help="inference steps (default 28; 2 with --tiny)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if args.tiny:
        result = tiny_run(args.model, args.prompts, args.seeds, args.size or 32, args.steps or 2)
    elif args.pipeline and args.nvfp4:
        args.size, args.steps = args.size or 1024, args.steps or 28
        result = full_run(args)
    else:
        parser.error("pass --tiny, or --pipeline and --nvfp4")
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for i, row in enumerate(result["images"]):
            print(f"image {i}: PSNR {row['psnr_db']:.2f} dB, SSIM {row['ssim']:.4f}")
        print(f"mean: PSNR {result['mean_psnr_db']:.2f} dB, SSIM {result['mean_ssim']:.4f} (NVFP4 vs BF16)")
    return result


if __name__ == "__main__":
    main()
