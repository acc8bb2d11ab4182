"""diffusers' own NVFP4 modules (``BFLQuantizationConfig``) vs the same model after ``enable_fast_paths``, on the GPU.

    python benchmarks/bench_native.py                 # one FLUX.2-dev-sized layer and a full FLUX.2-dev step
    python benchmarks/bench_native.py --step-from file  # the step model written to a file and read by diffusers
    python benchmarks/bench_native.py --skip-step     # the layer only

Layer: ``BFLNVFP4Linear`` 6144 -> 18432 at 4608 rows (a FLUX.2-dev feed-forward input projection at 1024x1024), random
packed weights and block scales, against the ``NVFP4Linear`` that ``enable_fast_paths`` converts it to. Step: a
full-size FLUX.2-dev transformer with random weights, NVFP4 where ``bench_transformer_step.py`` quantizes, written to a
file in this run's temporary directory in the layout diffusers reads (BFL names, low nibble first, linear scales),
loaded with ``Flux2Transformer2DModel.from_single_file(..., quantization_config=BFLQuantizationConfig())``, and timed
with diffusers' modules (below SM100 they dequantize every weight in every forward) and after ``enable_fast_paths``.
Writes benchmarks/results/native-<device>.json: cases ``{shape, variant, us | ms_per_step, peak_gib, speedup_vs}``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

ROWS, IN, OUT = 4608, 6144, 18432
GOALS = {"step_speedup_vs_diffusers": 2.0, "peak_memory_not_higher": True}


def random_nvfp4(n: int, k: int, device, gen) -> dict[str, torch.Tensor]:
    """Random packed weight (low nibble first), linear E4M3 block scales in [2^-3, 2^0), FP32 global scales."""
    return {
        "weight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen),
        "weight_scale": torch.randint(0x28, 0x38, (n, k // 16), dtype=torch.uint8, device=device,
                                      generator=gen).view(torch.float8_e4m3fn),
        "weight_scale_2": torch.tensor(1e-3, dtype=torch.float32, device=device),
        "input_scale": torch.tensor(8.0 / 2688.0, dtype=torch.float32, device=device),
    }


def _peak_gib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def layer_cases() -> list[dict]:
    from common import time_us
    from diffusers.quantizers.bfl.utils import BFLNVFP4Linear

    from diffusers_nvfp4_fast.loaders.diffusers_native import from_bfl_layer

    gen = torch.Generator("cuda").manual_seed(0)
    layer = BFLNVFP4Linear(IN, OUT, bias=False, compute_dtype=torch.bfloat16, device="meta")
    tensors = random_nvfp4(OUT, IN, "cuda", gen)
    layer.weight = nn.Parameter(tensors["weight"], requires_grad=False)
    for key in ("weight_scale", "weight_scale_2", "input_scale"):
        layer.register_buffer(key, tensors[key])
    ours = from_bfl_layer(layer)
    x = torch.randn(ROWS, IN, device="cuda", dtype=torch.bfloat16, generator=gen)
    shape = {"rows": ROWS, "in": IN, "out": OUT}
    with torch.inference_mode():
        us = {"diffusers": time_us(lambda: layer(x), graph=False), "fast_paths": time_us(lambda: ours(x), graph=False)}
        peak = {"diffusers": _peak_gib(lambda: layer(x)), "fast_paths": _peak_gib(lambda: ours(x))}
    return [{"shape": shape, "variant": v, "us": round(us[v], 1), "peak_gib": round(peak[v], 3),
             "speedup_vs": {"diffusers": round(us["diffusers"] / us[v], 3)}} for v in us]


def write_flux2_dev_file(path: Path) -> dict:
    """A full-size FLUX.2-dev file in the layout diffusers reads; returns the transformer config."""
    import bench_transformer_step as step

    from diffusers_nvfp4_fast.loaders.common import is_excluded

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the BFL writer is a test tool
    from support.bfl_writer import write_bfl_file

    model = step.empty_model("flux2-dev", tiny=False)
    config = dict(model.config)
    patterns = list(step.exclude_patterns("flux2-dev", config))
    gen = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not is_excluded(name, patterns) and module.in_features % 16 == 0:
            sd.update({f"{name}.{k}": v for k, v in random_nvfp4(module.out_features, module.in_features, "cpu",
                                                                   gen).items()})
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[0] + ".weight_scale" not in sd:
            sd[name] = (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)
    write_bfl_file(sd, config["num_layers"], config["num_single_layers"], path, nibble_order="lo_first",
                   swizzle=False, markers=False, header=False)
    return config


def load_from_file(tmp: Path) -> nn.Module:
    from diffusers import BFLQuantizationConfig, Flux2Transformer2DModel

    t0 = time.perf_counter()
    config = write_flux2_dev_file(tmp / "flux2-dev-native.safetensors")
    (tmp / "config").mkdir()
    Flux2Transformer2DModel.from_config(config).save_config(tmp / "config")
    t1 = time.perf_counter()
    model = Flux2Transformer2DModel.from_single_file(
        str(tmp / "flux2-dev-native.safetensors"), config=str(tmp / "config"),
        quantization_config=BFLQuantizationConfig(), torch_dtype=torch.bfloat16).to("cuda")
    print(f"file written in {t1 - t0:.0f} s, loaded by diffusers in {time.perf_counter() - t1:.0f} s")
    return model


def build_in_memory() -> nn.Module:
    """The modules ``from_single_file`` builds (``BFLNVFP4Linear`` where the file is NVFP4), made directly on the
    GPU: the same classes and forward code, without writing and reading 19 GB. Their tensors are those of
    ``bench_transformer_step.py``'s NVFP4 model (its packed weights, read low nibble first as diffusers reads them,
    and its block scales in diffusers' linear layout), so the step after ``enable_fast_paths`` multiplies the same
    values as the package's own loader route and the two step times compare."""
    import bench_transformer_step as step
    from diffusers.quantizers.bfl.utils import BFLNVFP4Linear

    from diffusers_nvfp4_fast import NVFP4Linear
    from diffusers_nvfp4_fast.format import unswizzle_scales

    model = step.empty_model("flux2-dev", tiny=False)
    step.materialize(model, "flux2-dev", torch.device("cuda"), nvfp4=True)
    for name, ours in list(model.named_modules()):
        if not isinstance(ours, NVFP4Linear):
            continue
        layer = BFLNVFP4Linear(ours.in_features, ours.out_features, bias=ours.bias is not None,
                               compute_dtype=torch.bfloat16, device="meta")
        layer.weight = nn.Parameter(ours.weight.data, requires_grad=False)
        scales = unswizzle_scales(ours.weight_scale.data, ours.out_features, ours.in_features // 16)
        layer.register_buffer("weight_scale", scales.view(torch.float8_e4m3fn))
        layer.register_buffer("weight_scale_2", ours.weight_scale_2.clone())
        layer.register_buffer("input_scale", ours.input_scale.clone())
        if ours.bias is not None:
            layer.bias = ours.bias
        model.set_submodule(name, layer)
    torch.cuda.empty_cache()
    return model


def step_cases(tmp: Path, source: str) -> list[dict]:
    """diffusers' modules, the same model after ``enable_fast_paths``, and (memory source) the package's own NVFP4
    model of the same tensors with its fast paths: step times side by side, and whether the two fast-path routes
    give the same output bytes."""
    import bench_transformer_step as step

    from diffusers_nvfp4_fast import enable_fast_paths

    device = torch.device("cuda")
    model = load_from_file(tmp) if source == "file" else build_in_memory()
    inputs = step.make_inputs("flux2-dev", model, 1024, 1024, 512, device)
    cases, ms, outs = [], {}, {}
    variants = [("diffusers", model), ("fast_paths", model)]
    if source == "memory":
        own = step.empty_model("flux2-dev", tiny=False)
        step.materialize(own, "flux2-dev", device, nvfp4=True)
        variants.append(("package_loader", own))
    for variant, net in variants:
        report = enable_fast_paths(net)["Flux2Transformer2DModel"] if variant != "diffusers" else None
        ms[variant], _, peak, outs[variant] = step.time_steps(net, inputs, 2, 5, device)
        cases.append({"shape": {"model": "FLUX.2-dev", "height": 1024, "width": 1024, "text_tokens": 512},
                      "variant": variant, "ms_per_step": round(ms[variant], 2),
                      "peak_gib": round(peak / 1.073741824, 3)})
        if report is not None:  # what the route fused
            done = enable_fast_paths(net)["Flux2Transformer2DModel"]
            cases[-1]["fast_path_report"] = {k: done.get(k) for k in ("sites", "fused_calls", "fallbacks",
                                                                        "converted")}
        print({k: v for k, v in cases[-1].items() if k != "fast_path_report"}, flush=True)
    for case in cases:
        case["speedup_vs"] = {"diffusers": round(ms["diffusers"] / case["ms_per_step"], 3)}
        case["model_source"] = source
    if "package_loader" in outs:
        same = step.same_bytes(outs["fast_paths"], outs["package_loader"])
        cases[-1]["same_bytes_as_converted_route"] = same
        print(f"converted route == package loader route, bytes: {same}", flush=True)
    return cases


def main() -> None:
    import common

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-step", action="store_true", help="time the layer only")
    ap.add_argument("--step-from", choices=("file", "memory"), default="memory",
                    help="file: write a 19 GB file and load it with from_single_file; memory: build the same "
                         "BFLNVFP4Linear modules on the GPU directly")
    args = ap.parse_args()
    result = common.header("native", common.copy_bandwidth_gbps())
    result["timing"] = ("layer: median CUDA-event time of eager calls; step: median of 5 eager forwards after 2 "
                        "warm-ups; peak_gib: layer: peak allocation above what was allocated before the call; "
                        "step: peak allocation of the process during the timed steps")
    result["goals"] = GOALS
    result["cases"] = layer_cases()
    print(result["cases"], flush=True)
    if not args.skip_step:
        with tempfile.TemporaryDirectory() as tmp:
            result["cases"] += step_cases(Path(tmp), args.step_from)
    print("wrote", common.write_result(result))
    for case in result["cases"]:
        value = f"{case['us']} us" if "us" in case else f"{case['ms_per_step']} ms/step"
        print(f"{case['variant']:<11} {value:>14}  peak {case['peak_gib']:.2f} GiB  {case['speedup_vs']}")


if __name__ == "__main__":
    main()
