"""The first image in a fresh process: an empty Triton cache (a new user's first run), the cache that run left, BF16.

    python benchmarks/bench_first_image.py --model flux2-klein-4b qwen-image flux2-dev   # --tiny: CPU dry run

Each case is a new process (``--child``) with its own ``TRITON_CACHE_DIR`` and ``CUDA_CACHE_PATH``: ``cold`` new empty
directories, ``warm`` the ones the cold run filled, BF16 (fast paths off) new ones too. CUDA's cache is kept per case
because something outside the process made the second process's first text encoding 1.2 s faster, inside torch's
attention (docs/performance.md): a BF16 case sharing the first case's caches would not pay what a new user pays.
The child times imports, build (``bench_pipeline.build``), ``enable_fast_paths``, the first and second 1024x1024
image, and splits the first image's extra time into the compile-only pass (wall), Triton compiles outside it by
kernel, autotune timing, first-use verification and plan building (each less the compiles inside it) and ``other``,
and each image into text, denoise and decode seconds (``stages``); ``pass_timeline``: when the compile-only pass
began and each of its binaries' start and end, in seconds from the first image's start; ``verifications``: the
report's passed and failed first-use checks (a fused kernel whose bytes differ falls back: same PNG, one failure).
Each compile's cache key parts are recorded; a binary the warm process compiles again is listed in its case
(``recompiled``) with how its key differs from the cold process's. ``--compile-workers N [N ...]`` adds per N an
NVFP4 cold case (its own empty caches) whose compile-only pass compiles in N worker processes
(``DIFFUSERS_NVFP4_COMPILE_WORKERS``), and a warm case with the first N's cache (the workers start and idle); these
cases say ``compile_workers``. Writes
benchmarks/results/first_image-<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

T_START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).parent))

STEPS = {"flux2-klein-4b": 4, "qwen-image": 30, "flux2-dev": 28}
CASES = (("nvfp4", "cold"), ("nvfp4", "warm"), ("bf16", "cold"))


class FirstUseClock:
    """Seconds spent in Triton compiles (by kernel), autotune timing, verification and plan building, each less the
    compiles nested in it."""

    def __init__(self) -> None:
        self.compiles: dict[str, list[float]] = defaultdict(list)
        self.events: list[dict] = []  # every compile or cache load: name, hit, what its cache key is made of
        self.spent: dict[str, float] = defaultdict(float)
        self._compile_total = self.pass_thread_s = 0.0
        self.in_pass = lambda: False
        self.timeline: list[dict] = []  # the compile-only pass: when it began, and each binary's task
        self.t0 = time.perf_counter()

    def _timed(self, what: str, fn):
        clock = self

        def wrapper(*args, **kwargs):
            if clock.in_pass():  # inside the compile-only pass: counted as the pass
                return fn(*args, **kwargs)
            start, compiled_before = time.perf_counter(), clock._compile_total
            try:
                return fn(*args, **kwargs)
            finally:
                clock.spent[what] += time.perf_counter() - start - (clock._compile_total - compiled_before)
        return wrapper

    def _heard(self, event) -> None:
        """A ``triton.compile`` (or its cache load), as the package's compile listener reports it; those on the
        compile-only pass's threads overlap, and are inside the pass's wall time instead of nested in a timer."""
        in_pass = threading.current_thread().name.startswith("nvfp4-compile")
        self.pass_thread_s += event.seconds if in_pass else 0.0
        self._compile_total += 0.0 if in_pass else event.seconds
        self.compiles[event.name].append(event.seconds)
        self.events.append({"name": event.name, "hit": event.cache_hit,
                            "spec": getattr(event, "specialization", {})})

    def _pass_clock(self, compile_only):
        """``launch.compile_only`` noting when a pass begins (seconds from ``t0``, the first image's start)."""
        @contextlib.contextmanager
        def wrapper(*args, **kwargs):
            self.timeline.append({"pass_begins_s": round(time.perf_counter() - self.t0, 3)})
            with compile_only(*args, **kwargs) as pending:
                yield pending
        return wrapper

    def _task_clock(self, compile_one):
        """``PendingCompiles.compile_one`` noting each binary's kernel, start and end (seconds from ``t0``)."""
        def wrapper(pending, kernel, *args, **kwargs):
            start = time.perf_counter()
            try:
                return compile_one(pending, kernel, *args, **kwargs)
            finally:
                self.timeline.append({"kernel": getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel)),
                                      "start_s": round(start - self.t0, 3),
                                      "end_s": round(time.perf_counter() - self.t0, 3)})
        return wrapper

    @contextlib.contextmanager
    def installed(self):
        """The compile listener, and timers on whatever of the other hooks this Triton and this project have (a
        missing one reads as 0)."""
        from triton.runtime import autotuner

        from diffusers_nvfp4_fast import caches
        from diffusers_nvfp4_fast.kernels import triton_compat
        from diffusers_nvfp4_fast.ops import dispatch, fused

        verdicts = caches.registered()["ops.verify.verdicts"].table
        self.in_pass = dispatch.compiling_only
        patches = [(autotuner.Autotuner, "_bench", lambda f: self._timed("autotune_s", f)),
                   (fused, "run_checked", self._verifying(verdicts))]
        with contextlib.suppress(ImportError):
            from diffusers_nvfp4_fast import kernels
            from diffusers_nvfp4_fast.kernels import launch

            patches += [(kernels, name, lambda f: self._timed("plan_build_s", f)) for name in ("linear_plan",
                                                                                                "row_plan")]
            patches += [(launch, "compile_only", self._pass_clock),
                        (launch.PendingCompiles, "compile_one", self._task_clock)]
        saved = []
        for owner, name, wrap in patches:
            if callable(getattr(owner, name, None)):
                saved.append((owner, name, getattr(owner, name)))
                setattr(owner, name, wrap(getattr(owner, name)))
        remove = triton_compat.add_compile_listener(self._heard)
        try:
            yield self
        finally:
            remove()
            for owner, name, original in saved:
                setattr(owner, name, original)

    def _verifying(self, verdicts):
        """``run_checked`` timed only where it verifies (its first call per call class)."""
        def wrap(run_checked):
            timed = self._timed("verification_s", run_checked)

            def wrapper(site, call_key, *rest):
                seen = f"{site.kind}|{call_key}" in verdicts
                return run_checked(site, call_key, *rest) if seen else timed(site, call_key, *rest)
            return wrapper
        return wrap

    def breakdown(self, extra_s: float, pass_s: float) -> dict:
        """``pass_s``: the compile-only pass's wall time (its compiles overlap: ``pass_compile_thread_s``)."""
        compile_s = sum(sum(v) for v in self.compiles.values())
        named = compile_s - self.pass_thread_s + pass_s + sum(self.spent.values())
        return {"extra_s": round(extra_s, 2), "triton_compile_s": round(compile_s, 2), "compile_only_pass_s": pass_s,
                "pass_compile_thread_s": round(self.pass_thread_s, 2),
                "triton_compiles": sum(len(v) for v in self.compiles.values()),
                "compiles_by_kernel": {k: {"n": len(v), "s": round(sum(v), 2)}
                                       for k, v in sorted(self.compiles.items(), key=lambda kv: -sum(kv[1]))},
                **{k: round(v, 2) for k, v in sorted(self.spent.items())},
                "other_s": round(extra_s - named, 2)}


def child(model: str, dtype: str, steps: int, size: int, tiny: bool) -> dict:
    """One case in this fresh process: times, PNG hashes and the first image's breakdown."""
    import bench_pipeline
    import common
    import diffusers  # noqa: F401  (the import is part of what a user waits for)
    import torch

    from diffusers_nvfp4_fast import enable_fast_paths, fast_path_report
    from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline

    record: dict = {"import_s": time.perf_counter() - T_START}
    _sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    t = time.perf_counter()
    pipe, call = bench_pipeline.build(model, dtype, tiny)
    pipe.set_progress_bar_config(disable=True)
    _sync()
    record["build_s"] = time.perf_counter() - t
    clock = FirstUseClock()
    with clock.installed():
        t = time.perf_counter()
        if dtype == "nvfp4":
            enable_fast_paths(pipe)
        _sync()
        record["enable_s"] = time.perf_counter() - t
        hashes, stages, timer = [], {}, common.StageTimer(pipe, torch.cuda.is_available())
        for which in ("first_image_s", "second_image_s"):
            before = dict(timer.seconds)
            t = time.perf_counter()
            if which == "first_image_s":
                clock.t0 = t
            with torch.inference_mode():
                hashes.append(png_sha256(run_pipeline(pipe, call, size=size, steps=steps)))
            _sync()
            record[which] = time.perf_counter() - t
            stages[which.split("_")[0]] = {k: round(v, 3) for k, v in timer.split(record[which], before).items()}
    record = {k: round(v, 3) for k, v in record.items()}
    record["stages"] = stages  # where the first image's extra time is: text encoding, denoising or decoding
    record["png_sha256"], record["png_equal_second"] = hashes[0], hashes[0] == hashes[1]
    prep = {name: entry["preparation"] for name, entry in fast_path_report(pipe).items()
            if dtype == "nvfp4" and isinstance(entry, dict) and entry.get("preparation")}
    pass_s = sum((p.get("parallel") or {}).get("seconds", 0.0) for p in prep.values())
    clock.spent["triton_key_wait_s"] = sum((p.get("triton_key") or {}).get("waited_s") or 0.0 for p in prep.values())
    record["breakdown"] = clock.breakdown(record["first_image_s"] - record["second_image_s"], round(pass_s, 2))
    record["preparation"] = prep
    record["verifications"] = {name: {k: entry["verifications"][k] for k in ("passed", "failed")}
                               for name, entry in fast_path_report(pipe).items()
                               if isinstance(entry, dict) and entry.get("verifications")}
    record["compiles"] = clock.events
    record["pass_timeline"] = clock.timeline  # seconds from the first image's start
    return record


def _spec_diff(cold: dict, warm: dict) -> dict:
    """Entry by entry, where two specializations of one kernel differ: {section: {argument: [cold, warm]}}."""
    out: dict = {}
    for section in sorted(set(cold) | set(warm)):
        a, b = cold.get(section), warm.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            diff = {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
            if diff:
                out[section] = diff
        elif a != b:
            out[section] = [a, b]
    return out


def explain_recompiles(cold: dict, warm: dict) -> None:
    """Sets ``warm["recompiled"]``: each binary the warm process compiled although the cold one left its cache, with
    how its key differs from the nearest cold binary of the same kernel ("same key": the cache missed otherwise);
    then keeps each compile's key as a short hash only."""
    import hashlib

    def key(event: dict) -> str:
        return hashlib.sha256(json.dumps(event["spec"], sort_keys=True).encode()).hexdigest()[:12]

    explained = []
    for event in [e for e in warm.get("compiles", []) if not e["hit"]]:
        same = [c for c in cold.get("compiles", []) if c["name"] == event["name"]]
        diffs = sorted((_spec_diff(c["spec"], event["spec"]) for c in same), key=lambda d: len(json.dumps(d)))
        explained.append({"name": event["name"],
                          "differs": (diffs[0] or "same key") if diffs else "kernel not compiled cold"})
    warm["recompiled"] = explained
    for case in (cold, warm):
        case["compiles"] = [{"name": e["name"], "hit": e["hit"], "key": key(e)} for e in case.get("compiles", [])]


def run_case(model: str, dtype: str, cache: str, cache_dir: Path, args, workers: int = 0) -> dict:
    """One case in a child process; ``workers``: the compile-only pass compiles in that many worker processes."""
    from diffusers_nvfp4_fast.switches import COMPILE_WORKERS
    command = [sys.executable, __file__, "--child", "--model", model, "--dtype", dtype, "--size", str(args.size),
               "--steps", str(args.steps or STEPS[model])] + (["--tiny"] if args.tiny else [])
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir / "triton"), "CUDA_CACHE_PATH": str(cache_dir / "cuda"),
           "PYTHONUNBUFFERED": "1", COMPILE_WORKERS: str(workers)}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    case = {"model": model, "dtype": dtype, "cache": cache, "steps": args.steps or STEPS[model], "size": args.size}
    if workers:
        case["compile_workers"] = workers
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:  # recorded (e.g. BF16 FLUX.2-dev does not fit an 80 GB GPU); the rest runs
        error = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"{model} {dtype} {cache}: the child failed ({done.returncode}):\n{done.stderr[-4000:]}", flush=True)
        return {**case, "error": f"exit {done.returncode}: {error[:400]}"}
    return {**case, **json.loads(lines[-1])}


def merge(before: dict, header: dict, cases: list[dict], wall_s: float) -> dict:
    """This run's cases over the file's: other models' cases stay, each with the date of its run, and so do the
    file's ``notes`` (what a run beside the file's measured, written by hand)."""
    fresh = {c["model"] for c in cases}
    result = dict(header)
    result["cases"] = [{"date": before.get("date"), **c} for c in before.get("cases", []) if c["model"] not in fresh]
    result["cases"] += [{**c, "date": header["date"]} for c in cases]
    result["wall_s"] = round(wall_s, 1)
    return result | ({"notes": before["notes"]} if "notes" in before else {})


def save(cases: list[dict], wall_s: float) -> None:
    import common

    path = common.RESULTS / f"first_image-{common.device_slug()}.json"
    before = json.loads(path.read_text()) if path.exists() else {}
    result = merge(before, common.header("first_image", common.copy_bandwidth_gbps()), cases, wall_s)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", path, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="+", choices=list(STEPS), required=True)
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's usual count)")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--tiny", action="store_true", help="tiny pipelines on CPU: checks the logic, no timing value")
    ap.add_argument("--compile-workers", type=int, nargs="+", default=[], metavar="N",
                    help="also an NVFP4 cold case per N whose compile-only pass compiles in N worker processes, "
                         "and a warm case with the first N (what idle workers cost)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="nvfp4", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tiny:
        args.size = 64
    if args.child:
        print(json.dumps(child(args.model[0], args.dtype, args.steps, args.size, args.tiny)), flush=True)
        return
    t0, cases = time.time(), []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.model:
            nvfp4_dir = Path(tmp, model, "nvfp4")
            runs = [(dtype, cache, nvfp4_dir if dtype == "nvfp4" else Path(tmp, model, dtype), 0)
                    for dtype, cache in CASES]
            for count in args.compile_workers:  # each count in its own caches; then warm with the first's
                runs.append(("nvfp4", "cold", Path(tmp, model, f"nvfp4-workers{count}"), count))
            if args.compile_workers:
                first = args.compile_workers[0]
                runs.append(("nvfp4", "warm", Path(tmp, model, f"nvfp4-workers{first}"), first))
            for dtype, cache, cache_dir, workers in runs:
                cases.append(run_case(model, dtype, cache, cache_dir, args, workers))
                c = cases[-1]
                if "error" not in c:
                    label = f"{cache}, {workers} worker processes" if workers else cache
                    print(f"[{time.time() - t0:6.1f}s] {model} {dtype} {label}: first {c['first_image_s']:.2f} s, "
                          f"second {c['second_image_s']:.2f} s, breakdown {json.dumps(c['breakdown'])}", flush=True)
            mine = [c for c in cases if c["model"] == model]
            cold, warm = (next((c for c in mine if (c["dtype"], c["cache"]) == ("nvfp4", k)
                                and not c.get("compile_workers")), None) for k in ("cold", "warm"))
            if cold is not None and warm is not None:
                explain_recompiles(cold, warm)
                if warm["recompiled"]:
                    print(f"{model}: the warm process compiled {len(warm['recompiled'])} binaries again: "
                          f"{json.dumps(warm['recompiled'])[:2000]}", flush=True)
            shas = {c.get("png_sha256") for c in mine if c["dtype"] == "nvfp4"}
            for c in mine:
                c["png_equal_cold_warm"] = len(shas) == 1 if c["dtype"] == "nvfp4" else None
            if not args.tiny:
                save(cases, time.time() - t0)
    if args.tiny:
        print(json.dumps(cases, indent=1))


if __name__ == "__main__":
    main()
