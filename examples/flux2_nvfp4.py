"""FLUX.2 with NVFP4 weights: load, generate with fast paths on and off, compare the PNG bytes.

    python examples/flux2_nvfp4.py --tiny                      # offline, embedded tiny model, CPU or GPU
    python examples/flux2_nvfp4.py --nvfp4 PATH_OR_REPO [--subfolder transformer] \\
        [--filename flux2-dev-nvfp4.safetensors] --base black-forest-labs/FLUX.2-dev --prompt "a red fox in snow"

With ``--budget GIB`` the pipeline is fitted into that much GPU memory by diffusers' own offloading (README "Fitting a
24 GB GPU"): the fastest plan whose estimated peak fits is applied after ``enable_fast_paths``; ``--plan`` names one.
"""

import argparse

import torch
from diffusers import Flux2Pipeline

from diffusers_nvfp4_fast import budget, disable_fast_paths, enable_fast_paths, fast_path_report, load_nvfp4_transformer
from diffusers_nvfp4_fast.testing import export, tiny
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="use the embedded tiny model (no download)")
    ap.add_argument("--nvfp4", help="ModelOpt NVFP4 export (dir or repo) or a BFL/ComfyUI .safetensors file")
    ap.add_argument("--subfolder", default=None)
    ap.add_argument("--filename", default=None)
    ap.add_argument("--base", default="black-forest-labs/FLUX.2-dev", help="pipeline repo for the other components")
    ap.add_argument("--prompt", default="a red fox in fresh snow, morning light")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--budget", type=float, help="GPU memory budget in GiB, e.g. 24: pick an offload plan that fits")
    ap.add_argument("--plan", choices=budget.PLANS, help="apply this offload plan instead of choosing one")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    if args.tiny:
        checkpoint = export.quantize_tiny_pipeline("flux2", "flux2-tiny-nvfp4")
        pipe, call = tiny.tiny_flux2_pipeline(load_nvfp4_transformer(checkpoint))
        size, steps = 64, 3
    else:
        extra = {"filename": args.filename} if args.filename else {}
        transformer = load_nvfp4_transformer(args.nvfp4, subfolder=args.subfolder, **extra)
        pipe = Flux2Pipeline.from_pretrained(args.base, transformer=transformer, dtype=torch.bfloat16)
        call, size, steps = {"prompt": args.prompt}, args.size, args.steps
    offload = args.budget or args.plan
    if not offload:
        pipe.to(device)
    # Fast paths before any offload plan: diffusers' offload hooks wrap the modules that exist when they are applied.
    enable_fast_paths(pipe)  # scale layout fix, fused SwiGLU/rotary/token-cat quantize, FP4 GEMMs
    if offload:
        plan = args.plan or budget.choose_plan(pipe, args.budget)
        budget.apply_plan(pipe, plan, device)
        print(f"offload plan: {plan} (estimated peak {budget.plan_estimates(pipe)[plan]:.2f} GiB)")
    image_on = run_pipeline(pipe, call, size=size, steps=steps)
    print(fast_path_report(pipe))
    disable_fast_paths(pipe)
    image_off = run_pipeline(pipe, call, size=size, steps=steps)

    print("PNG SHA256 off:", png_sha256(image_off))
    print("PNG SHA256 on: ", png_sha256(image_on))
    image_on.save("flux2_nvfp4.png")


if __name__ == "__main__":
    main()
