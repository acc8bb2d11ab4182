"""Shared helpers of the GPU benchmarks: timing, copy bandwidth, result files (docs/design.md §10)."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def time_us(fn, *, warmup: int = 5, iters: int = 50, graph: bool = True) -> float:
    """Median GPU microseconds of one ``fn()``.

    With ``graph`` (default) the calls are captured into a CUDA graph and its replays are timed with CUDA events,
    so the figure is the GPU's time and not Python's launch overhead; without, back-to-back eager calls are timed.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    reps = 10
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(reps):
                fn()
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(iters // reps, 5)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / reps)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second, in GB/s) measured now."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    # Eager: inside a CUDA graph a device-to-device copy becomes a copy-engine memcpy node, which is slower.
    us = time_us(lambda: y.copy_(x), warmup=5, iters=30, graph=False)
    return 2 * nbytes / (us * 1e-6) / 1e9


def bandwidth_cases(shape: dict, us: dict[str, float], nbytes: int, copy_gbps: float, exact: bool,
                    compiled_exact: bool) -> list[dict]:
    """One case per variant of a memory-bound kernel benchmark (``us``: variant -> microseconds; "compiled" gets
    ``compiled_exact``): its time, the bandwidth ``nbytes`` imply, their fraction of the copy bandwidth measured in
    the same run, and the speedup against each other variant."""
    cases = []
    for variant, t in us.items():
        gbps = nbytes / (t * 1e-6) / 1e9
        cases.append({"shape": shape, "variant": variant, "us": round(t, 2), "GBps": round(gbps, 1),
                      "bw_fraction": round(gbps / copy_gbps, 3),
                      "speedup_vs": {o: round(us[o] / t, 2) for o in us if o != variant},
                      "exact": exact if variant != "compiled" else compiled_exact})
    return cases


def print_bandwidth_cases(cases: list[dict], copy_gbps: float, path) -> None:
    print(f"copy bandwidth {copy_gbps:.0f} GB/s -> {path}")
    for c in cases:
        print(f"{str(c['shape']):40s} {c['variant']:9s} {c['us']:9.1f} us {c['bw_fraction'] * 100:5.1f}% bw "
              f"{c['speedup_vs']} exact={c['exact']}")


def device_slug(name: str | None = None) -> str:
    """A file tag for the device ``name`` (default: the current CUDA device's)."""
    name = (name or torch.cuda.get_device_name()).lower()
    for tag in ("h200", "h100", "b200", "gb200", "b100", "rtx 5090", "l40s", "a100"):
        if tag in name:
            return tag.replace(" ", "")
    return name.replace("nvidia ", "").replace(" ", "_")


def header(benchmark: str, copy_gbps: float) -> dict:
    import triton

    return {
        "benchmark": benchmark,
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__.split("+")[0],
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "copy_bandwidth_GBps": round(copy_gbps, 1),
        "cases": [],
    }


def write_result(result: dict, name: str | None = None, folder: Path = RESULTS) -> Path:
    """``result`` as ``<name or its benchmark>-<device>.json`` in ``folder`` (benchmarks/results by default)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name or result['benchmark']}-{device_slug()}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def shared_quantize_nodes() -> int:
    """NVFP4 layer nodes that ``exact_inductor``'s pass rewrote to share one activation quantize in this process (0
    where inductor's cache served the compiled code)."""
    from diffusers_nvfp4_fast.inductor import SHARE_ACTIVATION_QUANTIZE

    return SHARE_ACTIVATION_QUANTIZE.rewritten


class StageTimer:
    """Wall seconds spent in ``pipe.encode_prompt`` and ``pipe.vae.decode`` (synchronized around each call); the rest
    of a pipeline call is denoising."""

    def __init__(self, pipe, cuda: bool):
        self.seconds = {"text": 0.0, "decode": 0.0}
        self.cuda = cuda
        pipe.encode_prompt = self._wrap(pipe.encode_prompt, "text")
        pipe.vae.decode = self._wrap(pipe.vae.decode, "decode")

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _wrap(self, fn, stage: str):
        def timed(*args, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self._sync()
            self.seconds[stage] += time.perf_counter() - t0
            return out

        return timed

    def split(self, total_s: float, before: dict[str, float]) -> dict[str, float]:
        """``total_s`` of one call as text / denoise / decode seconds, ``before`` being ``seconds`` at its start."""
        spent = {k: self.seconds[k] - before.get(k, 0.0) for k in self.seconds}
        return {"text": spent["text"], "denoise": total_s - sum(spent.values()), "decode": spent["decode"]}
