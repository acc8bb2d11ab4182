"""``diffusers-nvfp4-fast``: parses arguments and hands over to ``loaders.inspect``, ``demo`` or ``selftest``.

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
    sub.add_parser("demo", help="quantize, load and run an embedded tiny model offline, fast paths off and on "
                                "(options: diffusers-nvfp4-fast demo --help)")
    sub.add_parser("selftest", help="check every kernel this GPU (or CPU) would use against its torch reference, byte "
                                    "for byte (options: diffusers-nvfp4-fast selftest --help)")
    return parser


def _inspect(path: Path, as_json: bool, check_scales: bool) -> int:
    """``inspect`` exits 1 when the loader dry run or the metadata found problems, 2 when the file cannot be read."""
    if not path.exists():
        print(f"diffusers-nvfp4-fast inspect: {path}: no such file or directory", file=sys.stderr)
        return 2
    from .loaders.inspect import format_report, inspect_checkpoint

    try:
        facts = inspect_checkpoint(path, check_scales=check_scales)
    except (OSError, ValueError) as e:
        print(f"diffusers-nvfp4-fast inspect: {e}", file=sys.stderr)
        return 2
    print(json.dumps(facts, indent=1, default=str) if as_json else format_report(facts))
    dry = facts.get("loader_dry_run") or {}
    return 1 if dry.get("problems") or dry.get("error") or facts["metadata_problems"] else 0


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
    return 2
