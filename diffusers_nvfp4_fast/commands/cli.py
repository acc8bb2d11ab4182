"""``diffusers-nvfp4-fast``: parses arguments and hands over to ``loaders.inspect``, ``quantize``, ``demo`` or
``selftest``.

Nothing heavy is imported before a command runs, so ``--help`` answers without importing torch or diffusers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffusers-nvfp4-fast", description="NVFP4 fast paths for diffusers: tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="print a checkpoint's layout facts from its header (no weights are read)")
    ins.add_argument("path", help="a .safetensors file (BFL/ComfyUI single file) or a ModelOpt export directory")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.add_argument("--check-scales", action="store_true",
                     help="also read the block-scale tensors (not the weights) and test the 128x4 padding")
    _add_quantize(sub)
    sub.add_parser("demo", help="quantize, load and run an embedded tiny model offline, fast paths off and on "
                                "(options: diffusers-nvfp4-fast demo --help)")
    sub.add_parser("selftest", help="check every kernel this GPU (or CPU) would use against its torch reference, byte "
                                    "for byte (options: diffusers-nvfp4-fast selftest --help)")
    return parser


def _add_quantize(sub) -> None:
    q = sub.add_parser("quantize", help="make an NVFP4 checkpoint from a BF16 diffusers transformer, or from a "
                                        "pipeline's transformers text encoder (--subfolder text_encoder), streamed "
                                        "layer by layer (docs/checkpoints.md)",
                       epilog="Exit status: 0 written; 2 refused, with one line saying why (nothing is written); 130 "
                              "(Ctrl-C) or 143 (SIGTERM) stopped, its hidden work directory beside OUT removed. A "
                              "work directory left by a killed run (SIGKILL) is removed by the next run for the same "
                              "OUT.")
    q.add_argument("source", help="a diffusers transformer directory (config.json + safetensors) or a Hugging Face "
                                  "repo id")
    q.add_argument("out", help="the checkpoint directory to write (refused if not empty, unless --overwrite)")
    q.add_argument("--subfolder", help="e.g. 'transformer' inside a pipeline repo or directory")
    scales = q.add_mutually_exclusive_group(required=True)
    scales.add_argument("--pipeline", help="calibrate input scales by running --prompts through this pipeline "
                                           "(directory or repo id) with the BF16 transformer")
    scales.add_argument("--dynamic", action="store_true",
                        help="no calibration: every NVFP4 layer computes amax(input) / 2688 per call")
    q.add_argument("--prompts", nargs="+", help="calibration prompts (default: three generic ones)")
    q.add_argument("--steps", type=int, default=4,
                   help="inference steps per calibration prompt (at least 1; default 4)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--height", type=int, help="calibration image height (default: the pipeline's)")
    q.add_argument("--width", type=int, help="calibration image width (default: the pipeline's)")
    q.add_argument("--call-kwargs", default="{}",
                   help="JSON object of further pipeline call arguments, e.g. '{\"guidance_scale\": 4.0}'; a string "
                        "value (or list item) '@PATH' is an image file, loaded as diffusers' load_image does (RGB), "
                        "for Edit / Edit-Plus / img2img / inpaint / ControlNet pipelines: '{\"image\": \"@cat.png\", "
                        "\"mask_image\": \"@mask.png\"}' or '{\"image\": [\"@a.png\", \"@b.png\"]}' ('@@' "
                        "starts a string with a literal @)")
    q.add_argument("--offload", choices=["model", "sequential"],
                   help="calibrate with diffusers' model / sequential CPU offload instead of the whole pipeline on "
                        "--device")
    q.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the BF16-kept tensors and of the weights before quantization (default bfloat16)")
    q.add_argument("--device", default="cpu",
                   help="where weights are quantized and calibration runs: cuda, cuda:N or cpu (refused at once "
                        "where this machine has no such device)")
    q.add_argument("--exclude", nargs="+", metavar="PATTERN",
                   help="fnmatch patterns of Linears to keep BF16 (default: ModelOpt's recipe for the model class)")
    q.add_argument("--max-shard-size", default="10GB", help="bytes per safetensors file (default 10GB)")
    q.add_argument("--method", choices=["package", "modelopt"], default="package",
                   help="package: this package's precise quantizer, streamed (default); modelopt: ModelOpt's "
                        "quantizer and max calibration through --pipeline, written by its export_hf_checkpoint")
    q.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    q.add_argument("--allow-empty", action="store_true",
                   help="write the checkpoint even when --exclude or the recipe keeps every Linear BF16 (refused "
                        "otherwise)")
    q.add_argument("--no-progress", action="store_true", help="no progress bars")


def _image_argument(key: str, value: str):
    """The image file of a ``--call-kwargs`` value ``"@PATH"``, loaded as ``diffusers.utils.load_image`` does."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    path = Path(value[1:])
    if not path.is_file():
        raise ValueError(f"--call-kwargs {key}: {value!r}: {path}: no such file (a value starting with @ is an image "
                         "file; write @@ for a literal @)")
    try:
        with Image.open(path) as image:
            return ImageOps.exif_transpose(image).convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"--call-kwargs {key}: {path}: not an image PIL can read ({e})") from e


def _with_images(key: str, value):
    """``value`` with each string ``"@PATH"`` (also inside lists) replaced by its image; ``"@@..."`` -> ``"@..."``."""
    if isinstance(value, list):
        return [_with_images(key, item) for item in value]
    if isinstance(value, str) and value.startswith("@"):
        return value[1:] if value.startswith("@@") else _image_argument(key, value)
    return value


def _call_kwargs(text: str) -> dict:
    """``--call-kwargs``: a JSON object, image files loaded (``_with_images``). Raises ValueError naming the value."""
    try:
        call_kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--call-kwargs {text!r} is not a JSON object ({e})") from e
    if not isinstance(call_kwargs, dict):
        raise ValueError(f"--call-kwargs {text!r} is not a JSON object")
    return {key: _with_images(key, value) for key, value in call_kwargs.items()}


def _is_text_encoder(source: str, subfolder: str | None) -> bool:
    """Whether SOURCE (with --subfolder) is a transformers model (``architectures``, e.g. a pipeline's
    ``text_encoder``) rather than a diffusers one; unreadable sources go the transformer way, which names the
    problem."""
    from ..loaders.modelopt_export import read_json, resolve_dir
    from ..quantize.text_source import is_text_encoder_config

    try:
        return is_text_encoder_config(read_json(resolve_dir(source, subfolder) / "config.json"))
    except (OSError, ValueError):
        return False


TEXT_ENCODER_UNUSED = {"offload": "--offload", "allow_empty": "--allow-empty", "height": "--height",
                       "width": "--width"}


def _quantize_text_encoder(args: argparse.Namespace, call_kwargs: dict):
    """The text-encoder route: options that only a denoising run uses are refused (the prompts are encoded once)."""
    import torch

    from ..quantize.text_encoder import quantize_text_encoder

    given = [flag for name, flag in TEXT_ENCODER_UNUSED.items() if getattr(args, name)]
    if given or args.steps != 4:
        raise ValueError(f"{', '.join(given + (['--steps'] if args.steps != 4 else []))}: not used for a text "
                         "encoder (calibration runs the pipeline's encode_prompt once per prompt; --call-kwargs go "
                         "to encode_prompt)")
    return quantize_text_encoder(
        args.source, args.out, subfolder=args.subfolder, pipeline=args.pipeline, prompts=args.prompts,
        call_kwargs=call_kwargs, dynamic=args.dynamic, dtype=getattr(torch, args.dtype), device=args.device,
        exclude=args.exclude, overwrite=args.overwrite, max_shard_size=args.max_shard_size,
        progress=not args.no_progress, method=args.method)


def _quantize(args: argparse.Namespace) -> int:
    """``quantize`` exits 2 for a source, option or target it refuses (nothing is written), 0 when written, 130 on
    Ctrl-C and 128 + N on signal N (SIGTERM: 143), after removing its work directory."""
    try:
        call_kwargs = _call_kwargs(args.call_kwargs)
    except ValueError as e:
        print(f"diffusers-nvfp4-fast quantize: {e}", file=sys.stderr)
        return 2
    if not _is_text_encoder(args.source, args.subfolder):
        call_kwargs.update({k: v for k, v in (("height", args.height), ("width", args.width)) if v is not None})
    import torch

    from ..quantize import quantize_transformer
    from ..quantize.modelopt_route import ModelOptUnavailableError
    from ..quantize.workdir import Terminated

    try:
        if _is_text_encoder(args.source, args.subfolder):
            result = _quantize_text_encoder(args, call_kwargs)
        else:
            result = quantize_transformer(
                args.source, args.out, subfolder=args.subfolder, pipeline=args.pipeline, prompts=args.prompts,
                call_kwargs=call_kwargs, num_inference_steps=args.steps, seed=args.seed, dynamic=args.dynamic,
                dtype=getattr(torch, args.dtype), device=args.device, offload=args.offload, exclude=args.exclude,
                overwrite=args.overwrite, max_shard_size=args.max_shard_size, progress=not args.no_progress,
                method=args.method, allow_empty=args.allow_empty)
    except (OSError, ValueError, ModelOptUnavailableError) as e:
        print(f"diffusers-nvfp4-fast quantize: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as e:
        how, status = (e.signal_name, 128 + e.signum) if isinstance(e, Terminated) else ("Ctrl-C (SIGINT)", 130)
        print(f"diffusers-nvfp4-fast quantize: stopped by {how}; its unfinished work directory beside {args.out} "
              "was removed", file=sys.stderr)
        return status
    print(result.summary())
    return 0


def _inspect(path: Path, as_json: bool, check_scales: bool) -> int:
    """``inspect`` exits 1 exactly when ``load_nvfp4_transformer(path)`` would refuse the checkpoint (block scales:
    where ``--check-scales`` read them), 2 when the path cannot be read."""
    if not path.exists():
        print(f"diffusers-nvfp4-fast inspect: {path}: no such file or directory", file=sys.stderr)
        return 2
    from ..loaders.inspect import format_report, inspect_checkpoint

    try:
        facts = inspect_checkpoint(path, check_scales=check_scales)
    except (OSError, ValueError) as e:
        print(f"diffusers-nvfp4-fast inspect: {e}", file=sys.stderr)
        return 2
    print(json.dumps(facts, indent=1, default=str) if as_json else format_report(facts))
    return 1 if facts["refusals"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``diffusers-nvfp4-fast`` and ``python -m diffusers_nvfp4_fast``. Returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["demo"]:  # the demo owns its options: everything after "demo" goes to it untouched
        from .demo import main as demo_main

        return int(demo_main(args_list[1:]) or 0)
    if args_list[:1] == ["selftest"]:
        from .selftest import main as selftest_main

        return selftest_main(args_list[1:])
    args = _parser().parse_args(args_list)
    if args.command == "inspect":
        return _inspect(Path(args.path), args.json, args.check_scales)
    if args.command == "quantize":
        return _quantize(args)
    return 2
