"""Choose the Triton GEMM's configs offline and write them into the shipped table (kernels/gemm_configs.json).

Usage:
  python benchmarks/tune_gemm_configs.py [--models flux2-dev flux2-klein-4b qwen-image]   (GPU: this architecture)
  python benchmarks/tune_gemm_configs.py --seed-from benchmarks/results/gemm-h200.json    (CPU: from recorded picks)

Shape classes (``gemm_config_table``: variant, M bucket, N, K): every NVFP4 Linear's (N, K) of the models (their
transformer configs, built on the meta device, ModelOpt's BF16-kept layers left out), at M = 2..64 (the in-kernel-X
variant ``packed``) and at 1024x1024 with 512 text tokens, batch 1 and 2 (M = 512 text, 4096 image, 4608 joint
tokens, and twice that: the pre-decoded variant ``fp16_x``). On a GPU each class's candidates (those the bucket keeps,
``prune``) run at the smallest model M of the bucket as CUDA-graph replays (``common.time_us``: GPU time, not the
host's launch cost) and the fastest is written, with both times in its ``source``, as this architecture's part
(``sm_<major><minor>``, replaced whole); other architectures' parts stay. Every config gives the same bytes
(tests/test_gemm.py), so only speed is at stake. ``--seed-from`` takes the configs Triton's autotuner chose in a
``bench_gemm.py`` result instead (the ``nvfp4_gemm`` row at M <= 64, ``nvfp4_triton_kernel`` above; of several Ms
in one bucket, the nearest to the class's M); classes it lacks get the default rule's config, marked
``"source": "default rule"``, for a later GPU run to replace.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

MODELS = ("flux2-dev", "flux2-klein-4b", "qwen-image")
SMALL_M = (2, 4, 8, 16, 32, 64)
LARGE_M = (512, 1024, 4096, 4608, 8192, 9216)  # text, image, joint tokens at 1024x1024, batch 1 and 2
TABLE = Path(__file__).resolve().parent.parent / "kernels" / "gemm_configs.json"
ABOUT = ("Triton GEMM configs (kernels/nvfp4_gemm.py) per GPU architecture and shape class, key variant/M bucket/N/K "
         "(kernels/gemm_config_table.py); a class without an entry takes the default rule. A config changes the speed, "
         "never the bytes (docs/design.md, section 7). Written by benchmarks/tune_gemm_configs.py.")


def model_nk(model: str) -> set[tuple[int, int]]:
    """(N, K) of every Linear of ``model`` that its NVFP4 checkpoints quantize (module shapes are the GEMM shapes)."""
    from bench_transformer_step import empty_model, exclude_patterns
    from torch import nn

    from diffusers_nvfp4_fast.loaders.common import is_excluded

    net = empty_model(model, tiny=False)
    patterns = list(exclude_patterns(model, dict(net.config)))
    return {(mod.out_features, mod.in_features) for name, mod in net.named_modules()
            if isinstance(mod, nn.Linear) and mod.in_features % 16 == 0 and not is_excluded(name, patterns)}


def shape_classes(models=MODELS) -> dict[str, tuple[bool, int, int, int, int]]:
    """key -> (x_packed, M bucket, N, K, the smallest model M of the bucket), fp16_x first, then by bucket, N, K."""
    from diffusers_nvfp4_fast.kernels.gemm_config_table import m_bucket, table_key

    classes = {}
    for n, k in sorted(set().union(*(model_nk(m) for m in models))):
        for m in SMALL_M + LARGE_M:  # ascending per variant: the first M of a bucket is its smallest
            packed = m in SMALL_M
            classes.setdefault(table_key(packed, m_bucket(m), n, k), (packed, m_bucket(m), n, k, m))
    return dict(sorted(classes.items(), key=lambda item: item[1]))


def _entry(config, source: str) -> dict:
    from diffusers_nvfp4_fast.kernels.gemm_config_table import config_fields

    return {**config_fields(config), "source": source}


def _parse_config(label: str) -> dict:
    """``"BM32 BN128 BK128 w4 s4[ Wregs]"`` (bench_gemm.py's ``_config_str``) -> the table's fields."""
    words = dict((w.rstrip("0123456789"), int(w[len(w.rstrip("0123456789")):])) for w in label.split() if w != "Wregs")
    return {"BLOCK_M": words["BM"], "BLOCK_N": words["BN"], "BLOCK_K": words["BK"], "num_warps": words["w"],
            "num_stages": words["s"], "W_IN_REGS": "Wregs" in label.split()}


def seed_part(results: Path, classes: dict) -> dict:
    """One architecture's part from the autotuner's picks recorded in a bench_gemm.py result."""
    from diffusers_nvfp4_fast.kernels.gemm_config_table import default_config, m_bucket, table_key

    raw = json.loads(results.read_text())
    picks: dict[str, tuple[int, dict]] = {}
    for case in raw["cases"]:
        m, n, k = (case["shape"][d] for d in "MNK")
        packed = m <= raw["predecode_max_m"]
        if case["variant"] != ("nvfp4_gemm" if packed else "nvfp4_triton_kernel") or m == 1:
            continue
        key = table_key(packed, m_bucket(m), n, k)
        best = picks.get(key)
        if key in classes and (best is None or abs(m - classes[key][4]) < abs(best[0] - classes[key][4])):
            picks[key] = (m, {**_parse_config(case["config"]), "source": f"{results.name} M={m}"})
    configs = {key: picks[key][1] if key in picks else _entry(default_config(c[0], c[1]), "default rule")
               for key, c in classes.items()}
    return {"measured_on": {"file": f"benchmarks/results/{results.name}", "device": raw["device"],
                            "capability": raw["capability"], "date": raw["date"], "torch": raw["torch"],
                            "triton": raw["triton"], "how": "Triton's autotuner, in bench_gemm.py"},
            "configs": configs}


def tune_part(classes: dict, log=print) -> dict:
    """This GPU's part: every class's kept candidates timed, the fastest written."""
    import torch
    import triton
    from bench_gemm import make_input, make_weight
    from common import time_us

    from diffusers_nvfp4_fast.kernels import gemm_config_table as table
    from diffusers_nvfp4_fast.kernels import nvfp4_gemm as gemm

    configs, weights = {}, {}
    for key, (packed, bucket, n, k, m) in classes.items():
        if (n, k) not in weights:
            weights = {(n, k): make_weight(n, k, seed=n + k)}  # one weight held at a time
        _, wp, ws, w_scale_2 = weights[(n, k)]
        _, xp, xs, _, x_scale = make_input(m, k, seed=m)
        alpha = (x_scale * w_scale_2).to(torch.float32)
        mode = "in_kernel" if packed else "predecode"
        us = {}
        for cfg in table.prune(table.gemm_configs(packed), {"m_bucket": bucket}):
            call = lambda cfg=cfg: gemm.nvfp4_gemm(xp, xs, wp, ws, alpha, x_decode=mode, kernel="triton", config=cfg)  # noqa: E731
            us[id(cfg)] = (time_us(call), cfg)
        best_us, best = min(us.values(), key=lambda t: t[0])
        default_us = us[id(table.default_config(packed, bucket))][0]
        configs[key] = _entry(best, f"measured M={m}: {best_us:.1f} us (default rule {default_us:.1f} us)")
        log(f"{key}: {configs[key]}")
    return {"measured_on": {"file": "benchmarks/tune_gemm_configs.py", "device": torch.cuda.get_device_name(),
                            "capability": list(torch.cuda.get_device_capability()),
                            "date": datetime.date.today().isoformat(), "torch": torch.__version__.split("+")[0],
                            "triton": triton.__version__, "how": "CUDA-graph replays, median"},
            "configs": configs}


def dumps(raw: dict) -> str:
    """The table as JSON with one entry per line (readable diffs)."""
    parts = []
    for arch, part in sorted(raw["architectures"].items()):
        entries = ",\n".join(f"        {json.dumps(key)}: {json.dumps(e)}" for key, e in part["configs"].items())
        parts.append(f'    {json.dumps(arch)}: {{\n      "measured_on": {json.dumps(part["measured_on"])},\n'
                     f'      "configs": {{\n{entries}\n      }}\n    }}')
    body = ",\n".join(parts)
    return f'{{\n  "about": {json.dumps(raw["about"])},\n  "architectures": {{\n{body}\n  }}\n}}\n'


def write_part(arch: str, part: dict, path: Path = TABLE) -> None:
    raw = json.loads(path.read_text()) if path.exists() else {"architectures": {}}
    raw = {"about": ABOUT, "architectures": {**raw["architectures"], arch: part}}
    text = dumps(raw)
    from diffusers_nvfp4_fast.kernels.gemm_config_table import parse_table

    parse_table(json.loads(text), str(path))  # every entry a candidate, before anything is written
    path.write_text(text)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--seed-from", type=Path, help="a bench_gemm.py result: its autotuner picks, no GPU needed")
    ap.add_argument("--table", type=Path, default=TABLE, help="the table to update (default: the shipped one)")
    args = ap.parse_args(argv)
    from diffusers_nvfp4_fast.kernels.gemm_config_table import arch_name

    classes = shape_classes(args.models)
    if args.seed_from:
        part = seed_part(args.seed_from, classes)
    else:
        part = tune_part(classes)
    arch = arch_name(part["measured_on"]["capability"])
    write_part(arch, part, args.table)
    sources = [e["source"] for e in part["configs"].values()]
    print(f"{args.table}: {arch}, {len(sources)} classes, {sources.count('default rule')} by the default rule")


if __name__ == "__main__":
    main()
