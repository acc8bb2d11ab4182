"""Study, last run 2026-12-03: where do two inductor compiles of the same BF16 block part? (docs/history.md,
"Compile repeatability"; the answer is exact_inductor's, docs/design.md §1)

    cd benchmarks/studies
    python 20261203_compile_diagnose.py            # H200: about 5 minutes (the patch matrix stops at --budget-s)
    python 20261203_compile_diagnose.py --quick    # about 2.5 minutes: the probes and two patches
    python 20261203_compile_diagnose.py --tiny     # small dims, CPU or GPU: the machinery only, no JSON

One full-size Qwen-Image BF16 block (``_block`` of the compile_repeatability study; ``--model flux2-dev`` for
FLUX.2's), compiled twice inside ``exact_inductor`` with inductor's caches off (A, then ``torch._dynamo.reset()`` and
B). The backend keeps inductor's compiled callable of each compile, so both can be called again, in any order, after
the other exists.

1. bytes: A's first call and a later one, B's, A called again after B, A under other stale memory (free allocator
   blocks overwritten), A on inputs at other addresses, and the eager block likewise. Which of them differ says
   whether the difference is fixed at compile or first run (A after B == A), or follows the memory state at run time.
2. code: inductor's generated wrapper of each compile (its Triton kernels are inline), diffed after masking what
   carries a compile counter or a cache path; the kernels whose source differs; the launch config each Triton kernel
   kept after its first-run autotuning, and how many it chose among.
3. kernels: a checksum of every Triton kernel's and aten op's (cuBLAS GEMMs, attention) inputs and outputs, in launch
   order, over one call of each compile. The first launch whose outputs differ, with its inputs equal, is where the
   compiles part; its config, or its operands' strides and address alignment, say why.
4. patches: inductor settings on top of ``exact_inductor``, most likely first, each compiled twice: do the bytes then
   repeat? Stops before a patch that would end past ``--budget-s``.

Writes benchmarks/studies/results/compile_diagnose-<device>.json (``--tiny``: prints only) and the two wrappers under
``--code-dir`` (default ``$OUT/compile_diagnose`` or /tmp/compile_diagnose), then prints a short table.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import study  # this folder's shared helpers; puts benchmarks/ on the path
import torch

# (name, settings on top of exact_inductor, the hypothesis it tests), most likely first. A key "torch.<...>" sets a
# torch attribute instead of an inductor setting.
PATCHES: list[tuple[str, dict[str, Any], str]] = [
    ("pointwise_autotune_off", {"triton.autotune_pointwise": False},
     "the one timing left under deterministic: pointwise configs benchmarked at first run"),
    ("compile_threads_1", {"compile_threads": 1},
     "Triton kernels compiled in worker processes (async compile) rather than in this one"),
    ("no_buffer_reuse", {"allow_buffer_reuse": False, "inplace_buffers": False, "reorder_for_peak_memory": False},
     "memory planning: buffer reuse, in-place kernels, node order for peak memory"),
    ("no_loop_reordering", {"loop_ordering_after_fusion": False},
     "loop order chosen after fusion"),
    ("cublas_no_reduced_precision", {"torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction": False},
     "cuBLAS split-K with BF16 partial sums (the extern GEMMs)"),
    ("no_pattern_matcher", {"pattern_matcher": False},
     "the joint-graph and post-grad pattern passes"),
    ("no_emulate_precision_casts", {"emulate_precision_casts": False},
     "exact_inductor's first setting itself"),
    ("deterministic_off", {"deterministic": False},
     "reference: inductor's default timing of reduction configs"),
]
QUICK_PATCHES = ("pointwise_autotune_off", "no_buffer_reuse")

# Settings that can make two compiles of one graph differ, recorded as the GPU machine's torch has them.
WATCHED = ["deterministic", "emulate_precision_casts", "max_autotune", "max_autotune_pointwise", "max_autotune_gemm",
           "coordinate_descent_tuning", "triton.autotune_pointwise", "triton.persistent_reductions",
           "triton.cooperative_reductions", "triton.multi_kernel", "triton.mix_order_reduction", "split_reductions",
           "benchmark_fusion", "benchmark_epilogue_fusion", "benchmark_kernel", "shape_padding",
           "comprehensive_padding", "force_same_precision", "use_mixed_mm", "triton.cudagraphs", "fallback_random",
           "size_asserts", "loop_ordering_after_fusion", "reorder_for_peak_memory", "allow_buffer_reuse",
           "inplace_buffers", "memory_planning", "dynamic_scale_rblock", "compile_threads", "fx_graph_cache",
           "autotune_local_cache", "pattern_matcher", "freezing", "triton.native_matmul", "graph_partition",
           "runtime_estimations_mms_benchmark"]

_QUIET = [False]  # set while a checksum runs its own torch ops, so that the aten trace skips them
_SKIP_ATEN = {"empty", "empty_strided", "empty_like", "as_strided", "view", "_reshape_alias", "t", "permute",
              "expand", "detach", "alias", "slice", "select", "unsqueeze", "squeeze", "_unsafe_view", "reshape",
              "transpose", "split", "split_with_sizes", "chunk", "unbind", "view_as_real", "view_as_complex",
              "lift_fresh", "resize_", "set_", "record_stream"}


# ---------------------------------------------------------------------------------------------------------------
# Checksums, settings


def digest(t: Any) -> str | None:
    """Two 64-bit sums of ``t``'s bytes (plain and position-weighted), computed on its device: equal for equal bytes,
    and different for any one changed element. None for what is not a tensor with data."""
    if not isinstance(t, torch.Tensor) or t.is_meta or t.numel() == 0:
        return None
    _QUIET[0] = True
    try:
        x = t.detach()
        if x.is_complex():
            x = torch.view_as_real(x)
        x = x.contiguous().reshape(-1)
        b = x.to(torch.uint8) if x.dtype == torch.bool else x.view(torch.uint8)
        w = (b.view(torch.int32) if b.numel() % 4 == 0 else b).to(torch.int64)
        idx = torch.arange(1, w.numel() + 1, device=w.device, dtype=torch.int64)
        return f"{int(w.sum()) & 0xFFFFFFFFFFFFFFFF:016x}{int((w * idx).sum()) & 0xFFFFFFFFFFFFFFFF:016x}"
    finally:
        _QUIET[0] = False


def output_bytes(out: Any) -> torch.Tensor:
    """The bytes of every tensor in ``out`` (a tensor or a nested tuple/list), concatenated."""
    flat = [t for t in _tensors(out)]
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in flat]).clone()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def setting(key: str) -> Any:
    """The value of an inductor setting (or a ``torch.`` attribute), or the string "absent"."""
    import torch._inductor.config as inductor_config

    owner, path = (torch, key.split(".")[1:]) if key.startswith("torch.") else (inductor_config, key.split("."))
    try:
        value = functools.reduce(getattr, path, owner)
    except AttributeError:
        return "absent"
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)


@contextlib.contextmanager
def patched(settings: dict[str, Any]) -> Iterator[None]:
    """``exact_inductor`` with ``settings`` on top; raises KeyError naming a setting this torch lacks."""
    import torch._inductor.config as inductor_config

    from diffusers_nvfp4_fast import exact_inductor

    missing = [k for k in settings if setting(k) == "absent"]
    if missing:
        raise KeyError(f"not in this torch: {missing}")
    inductor = {k: v for k, v in settings.items() if not k.startswith("torch.")}
    saved = {k: setting(k) for k in settings if k.startswith("torch.")}
    try:
        for key, value in settings.items():
            if key.startswith("torch."):
                *owner, attr = key.split(".")[1:]
                setattr(functools.reduce(getattr, owner, torch), attr, value)
        with exact_inductor(), inductor_config.patch(inductor):
            yield
    finally:
        for key, value in saved.items():
            *owner, attr = key.split(".")[1:]
            setattr(functools.reduce(getattr, owner, torch), attr, value)


# ---------------------------------------------------------------------------------------------------------------
# One compile: its callable, its inputs, its generated wrapper, its first-run configs


class Compiled:
    """One inductor compile of the block: ``fn`` called on ``inputs`` (the graph's own inputs, weights included)."""

    def __init__(self, fn: Callable, inputs: list, wrapper: str, module: Any, first: torch.Tensor, seconds: float,
                 counters: dict):
        self.fn, self.inputs, self.wrapper, self.module = fn, inputs, wrapper, module
        self.first, self.seconds, self.counters = first, seconds, counters

    def __call__(self, inputs: list | None = None) -> Any:
        args = list(self.inputs if inputs is None else inputs)
        with torch.inference_mode():
            return self.fn(*args)  # dynamo calls it unboxed

    def configs(self) -> dict[str, dict]:
        """Each Triton kernel of the wrapper: the config it launches with and how many it was chosen among."""
        try:
            from torch._inductor.runtime.triton_heuristics import CachingAutotuner
        except ImportError:
            return {}
        found = {}
        for name, obj in sorted(vars(self.module).items() if self.module is not None else [], key=lambda kv: kv[0]):
            if isinstance(obj, CachingAutotuner) and getattr(obj, "launchers", None):
                found[name] = {"config": config_text(obj.launchers[0].config),
                               "heuristic": str(getattr(obj, "heuristic_type", "")),
                               "candidates": _CANDIDATES.get(id(obj), len(obj.launchers))}
        return found


_CANDIDATES: dict[int, int] = {}  # id(CachingAutotuner) -> number of launchers before its first run


def config_text(config: Any) -> str:
    kwargs = ", ".join(f"{k}={v}" for k, v in sorted(getattr(config, "kwargs", {}).items()))
    return f"{kwargs}, num_warps={getattr(config, 'num_warps', '?')}, num_stages={getattr(config, 'num_stages', '?')}"


@contextlib.contextmanager
def _wrappers_loaded(store: list) -> Iterator[None]:
    """Collect (source, module) of every inductor wrapper module loaded meanwhile (fresh or from a cache)."""
    from torch._inductor.codecache import PyCodeCache

    original = PyCodeCache.__dict__["load_by_key_path"]

    def load(cls, key, path, *args, **kwargs):
        module = original.__func__(cls, key, path, *args, **kwargs)
        text = Path(path).read_text()
        if "async_compile = AsyncCompile()" in text and ("def call(" in text or "class Runner" in text):
            store.append((text, module))
        return module

    PyCodeCache.load_by_key_path = classmethod(load)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        PyCodeCache.load_by_key_path = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _first_runs_counted() -> Iterator[None]:
    """Remember how many configs each Triton kernel had before its first launch (its autotuning choice set)."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:
        yield
        return
    original = CachingAutotuner.run

    def run(self, *args, **kwargs):
        if id(self) not in _CANDIDATES:
            _CANDIDATES[id(self)] = len(self.launchers) or len(getattr(self, "configs", None) or [])
        return original(self, *args, **kwargs)

    CachingAutotuner.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        CachingAutotuner.run = original  # type: ignore[method-assign]


def compile_once(block: torch.nn.Module, args: tuple, kwargs: dict, settings: dict[str, Any],
                 caches: bool = False, route: str = "compile_fx") -> Compiled:
    """Compile ``block`` (``torch.compile(fullgraph=True)``, inductor) inside ``patched(settings)`` and run it once.
    ``route``: "compile_fx" (a backend calling inductor's ``compile_fx``), "wrapper" (a backend calling the object
    ``torch.compile(backend="inductor")`` builds) or "standard" (``backend="inductor"`` itself; its callable is not
    kept, so the result can only be compared, not called again)."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    kept: list = []

    def backend(gm, example_inputs):
        if route == "wrapper":
            fn = torch._TorchCompileInductorWrapper(None, None, None)(gm, example_inputs)
        else:
            fn = compile_fx(gm, example_inputs)
        kept.append((fn, list(example_inputs)))
        return fn

    wrappers: list = []
    torch._dynamo.reset()
    before = dict(counters["inductor"])
    start = time.perf_counter()
    with patched(settings), inductor_config.patch(force_disable_caches=not caches), _wrappers_loaded(wrappers), \
            _first_runs_counted(), torch.inference_mode():
        out = torch.compile(block, backend="inductor" if route == "standard" else backend, fullgraph=True)(
            *args, **kwargs)
        first = output_bytes(out)
    if route == "standard":
        kept.append((None, []))
    if first.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if len(kept) != 1:
        raise RuntimeError(f"expected one graph, dynamo compiled {len(kept)}")
    fn, inputs = kept[0]
    text, module = wrappers[-1] if wrappers else ("", None)
    delta = {k: v - before.get(k, 0) for k, v in counters["inductor"].items() if v != before.get(k, 0)}
    return Compiled(fn, inputs, text, module, first, seconds, delta)


# ---------------------------------------------------------------------------------------------------------------
# Kernel traces: checksums of every launch's operands, in launch order


@contextlib.contextmanager
def tracing(events: list) -> Iterator[None]:
    """Append one event per Triton kernel launch and per aten op (not views or allocations) while inside."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class AtenTrace(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if _QUIET[0] or func.overloadpacket.__name__ in _SKIP_ATEN:
                return func(*args, **kwargs)
            operands = [t for t in _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))]
            ins = [digest(t) for t in operands]
            out = func(*args, **kwargs)
            event = {"kind": "aten", "name": str(func), "ins": ins, "outs": [digest(t) for t in _tensors(out)],
                     "operands": [layout(t) for t in [*operands, *_tensors(out)]]}
            if func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "baddbmm"):
                # the same GEMM again, eagerly, into a fresh output: does cuBLAS repeat itself on these operands?
                plain = {k: v for k, v in kwargs.items() if k != "out"}
                _QUIET[0] = True
                try:
                    again = func.overloadpacket.default(*args, **plain)
                    event["recomputed_equal"] = torch.equal(again, next(_tensors(out)))
                finally:
                    _QUIET[0] = False
            events.append(event)
            return out

    restore = None
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        original = CachingAutotuner.run

        def run(self, *args, **kwargs):
            names = list(self.triton_meta.get("signature", {}).keys())
            named = dict(zip(names, args))
            ins = {n: digest(a) for n, a in named.items() if n.startswith(("in_ptr", "in_out_ptr"))}
            result = original(self, *args, **kwargs)
            outs = {n: digest(a) for n, a in named.items() if n.startswith(("out_ptr", "in_out_ptr"))}
            events.append({"kind": "triton", "name": self.fn.__name__, "ins": ins, "outs": outs,
                           "config": config_text(self.launchers[0].config) if self.launchers else "?"})
            return result

        CachingAutotuner.run = run  # type: ignore[method-assign]
        restore = (CachingAutotuner, original)
    except ImportError:
        pass
    try:
        with AtenTrace():
            yield
    finally:
        if restore:
            restore[0].run = restore[1]  # type: ignore[method-assign]


def layout(t: torch.Tensor) -> str:
    return (f"{tuple(t.shape)}/{tuple(t.stride())}+{t.storage_offset()} {t.dtype} "
            f"ptr%256={t.data_ptr() % 256}")


def trace(compiled: Compiled) -> list[dict]:
    events: list = []
    with tracing(events):
        compiled()
    return events


def first_divergence(a: list[dict], b: list[dict]) -> dict:
    """Where two traces of the same graph first differ, and how many launches differ in all."""
    report: dict = {"launches": [len(a), len(b)], "differing": 0, "first": None,
                    "gemms_not_repeating": [sum(1 for e in t if e.get("recomputed_equal") is False) for t in (a, b)]}
    for i, (ea, eb) in enumerate(zip(a, b)):
        if ea["name"] != eb["name"]:
            report["first"] = report["first"] or {"index": i, "why": "another kernel at this position",
                                                  "a": ea["name"], "b": eb["name"]}
            report["sequence_differs_at"] = i
            break
        if ea["outs"] != eb["outs"]:
            report["differing"] += 1
            if report["first"] is None:
                keys = ea["outs"].keys() if isinstance(ea["outs"], dict) else range(len(ea["outs"]))
                report["first"] = {"index": i, "kind": ea["kind"], "name": ea["name"],
                                   "inputs_equal": ea["ins"] == eb["ins"],
                                   "outputs_differing": [k for k in keys if ea["outs"][k] != eb["outs"][k]],
                                   "a": {k: ea[k] for k in ("config", "operands", "recomputed_equal") if k in ea},
                                   "b": {k: eb[k] for k in ("config", "operands", "recomputed_equal") if k in eb}}
    return report


# ---------------------------------------------------------------------------------------------------------------
# Generated code


_MASKS = [(re.compile(r"\d+_(inference|forward|backward)"), r"N_\1"),
          (re.compile(r"(/[\w.\-]+)+\.py"), "<path>"),
          (re.compile(r"\b[0-9a-f]{32,}\b"), "<hash>")]
_TRITON_SOURCE = re.compile(r"(\w+) = async_compile\.triton\('(\w+)', '''(.*?)'''", re.S)


def normalized(code: str) -> list[str]:
    """The wrapper's lines with compile counters, cache paths and hashes masked."""
    for pattern, repl in _MASKS:
        code = pattern.sub(repl, code)
    return code.splitlines()


def code_diff(a: str, b: str, context: int = 1, limit: int = 80) -> dict:
    """How two wrappers differ: count of differing lines, the first ``limit`` lines of a unified diff, the Triton
    kernels whose source differs and the extern calls of each."""
    la, lb = normalized(a), normalized(b)
    diff = [line for line in difflib.unified_diff(la, lb, "A", "B", n=context, lineterm="")]
    changed = sum(1 for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---"))
    ka = {m.group(1): m.group(3) for m in _TRITON_SOURCE.finditer(a)}
    kb = {m.group(1): m.group(3) for m in _TRITON_SOURCE.finditer(b)}
    extern = re.compile(r"(extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(")
    return {"identical": la == lb, "lines_changed": changed, "diff_head": diff[:limit],
            "kernels": [len(ka), len(kb)],
            "kernels_differing": sorted(k for k in ka.keys() & kb.keys() if normalized(ka[k]) != normalized(kb[k])),
            "kernels_only_a": sorted(ka.keys() - kb.keys()), "kernels_only_b": sorted(kb.keys() - ka.keys()),
            "extern_calls_equal": extern.findall(a) == extern.findall(b), "extern_calls": extern.findall(a)[:60]}


def configs_diff(a: dict[str, dict], b: dict[str, dict]) -> list[dict]:
    return [{"kernel": k, "a": a[k], "b": b[k]} for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]


# ---------------------------------------------------------------------------------------------------------------
# Memory probes


def overwrite_free_memory(seed: int = 7) -> int:
    """Fill the CUDA allocator's free blocks with random bytes (allocating each one's size, filling, releasing):
    a later call gets the same addresses but other stale contents. Returns the bytes overwritten."""
    sizes = [block["size"] for segment in torch.cuda.memory_snapshot() for block in segment["blocks"]
             if block["state"] == "inactive"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    held = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in sorted(sizes, reverse=True)]
    for t in held:
        t.random_(0, 256, generator=gen)
    torch.cuda.synchronize()
    del held
    return sum(sizes)


def moved(inputs: list) -> tuple[list, list]:
    """Copies of ``inputs`` at other addresses, behind a few odd-sized allocations that stay held (returned)."""
    held = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1 << 20 | 12345, 3 << 20 | 777, 4099)]
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs], held


def memory_probes(a: Compiled, eager: Callable[[], Any]) -> dict:
    if not torch.cuda.is_available() or a.first.device.type != "cuda":
        return {"skipped": "not on a CUDA device"}
    ref = output_bytes(a())
    overwritten = overwrite_free_memory()
    stale = output_bytes(a())
    inputs, held = moved(a.inputs)
    shifted = output_bytes(a(inputs))
    del inputs, held
    e1 = output_bytes(eager())
    overwrite_free_memory(seed=8)
    e2 = output_bytes(eager())
    return {"bytes_overwritten": overwritten, "a_under_other_stale_memory_equal": torch.equal(ref, stale),
            "a_on_moved_inputs_equal": torch.equal(ref, shifted), "eager_under_other_stale_memory_equal":
            torch.equal(e1, e2), "eager_equal_a": torch.equal(e1, ref)}


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    _block = study.load("compile_repeatability")._block

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen-image", choices=["qwen-image", "flux2-dev"])
    p.add_argument("--tiny", action="store_true", help="two heads, 64 + 16 tokens; runs on a CPU; writes no JSON")
    p.add_argument("--quick", action="store_true", help=f"patches {', '.join(QUICK_PATCHES)} only")
    p.add_argument("--patches", help="comma-separated patch names (default: all, most likely first)")
    p.add_argument("--budget-s", type=float, default=330.0, help="skip patches that would end past this")
    p.add_argument("--caches", action="store_true", help="leave inductor's caches on (default: off)")
    p.add_argument("--code-dir", type=Path,
                   default=Path(os.environ.get("OUT", "/tmp")) / "compile_diagnose")
    args = p.parse_args(argv)
    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        p.error("no CUDA device: run with --tiny")

    import common

    result: dict = (common.header("compile_diagnose", common.copy_bandwidth_gbps()) if not args.tiny
                    else {"benchmark": "compile_diagnose", "device": device, "torch": torch.__version__, "cases": []})
    result.update(model=args.model, tiny=args.tiny, caches=args.caches,
                  settings={k: setting(k) for k in WATCHED + [
                      "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
                      "torch.backends.cuda.matmul.allow_tf32"]})
    block, bargs, bkwargs = _block(args.model, False, device=device, tiny=args.tiny)
    block.eval()

    def eager():
        with torch.inference_mode():
            return block(*bargs, **bkwargs)

    a = compile_once(block, bargs, bkwargs, {}, args.caches)
    a_later = output_bytes(a())
    b = compile_once(block, bargs, bkwargs, {}, args.caches)
    b_later = output_bytes(b())
    a_after_b = output_bytes(a())
    bytes_case = {"experiment": "bytes", "compile_s": [round(a.seconds, 1), round(b.seconds, 1)],
                  "a_first_equal_later": torch.equal(a.first, a_later), "a_equal_b": torch.equal(a.first, b.first),
                  "b_first_equal_later": torch.equal(b.first, b_later),
                  "a_after_b_equal_a": torch.equal(a_later, a_after_b),  # both called directly
                  "elements_differing_a_b": int((a.first != b.first).sum()) if a.first.shape == b.first.shape
                  else "shapes differ",
                  "counters": [a.counters, b.counters], **memory_probes(a, eager)}
    result["cases"].append(bytes_case)
    print("bytes:", {k: v for k, v in bytes_case.items() if k != "counters"}, flush=True)

    args.code_dir.mkdir(parents=True, exist_ok=True)
    for name, compiled in (("a", a), ("b", b)):
        (args.code_dir / f"wrapper_{name}.py").write_text(compiled.wrapper)
    ca, cb = a.configs(), b.configs()
    code_case = {"experiment": "code", **code_diff(a.wrapper, b.wrapper), "configs_differing": configs_diff(ca, cb),
                 "autotuned_kernels": sum(1 for c in ca.values() if c["candidates"] > 1), "configs_a": ca,
                 "code_dir": str(args.code_dir)}
    result["cases"].append(code_case)
    print("code: identical", code_case["identical"], "| lines changed", code_case["lines_changed"],
          "| kernels differing", code_case["kernels_differing"][:8], "| configs differing",
          [c["kernel"] for c in code_case["configs_differing"]][:8], flush=True)

    try:
        kernels_case = {"experiment": "kernels", **first_divergence(trace(a), trace(b))}
    except Exception as e:  # a trace is a diagnosis aid: its failure must not lose the rest
        kernels_case = {"experiment": "kernels", "error": f"{type(e).__name__}: {e}"}
    result["cases"].append(kernels_case)
    print("kernels:", kernels_case, flush=True)
    result["cases"].append(routes_case(block, bargs, bkwargs, a, args.caches))
    print("routes:", {k: v for k, v in result["cases"][-1].items() if k != "first_differing"}, flush=True)
    print("routes, first differing:", str(result["cases"][-1].get("first_differing"))[:3000], flush=True)
    del a, b
    if device == "cuda":
        torch.cuda.empty_cache()

    chosen = [x for x in PATCHES if (args.patches and x[0] in args.patches.split(","))
              or (not args.patches and (not args.quick or x[0] in QUICK_PATCHES))]
    per_compile = max(bytes_case["compile_s"])
    for name, settings, hypothesis in chosen:
        case: dict = {"experiment": "patch", "patch": name, "settings": settings, "hypothesis": hypothesis}
        if time.perf_counter() - start + 2.2 * per_compile > args.budget_s:
            case["skipped"] = f"budget: {args.budget_s:.0f} s"
        else:
            try:
                x = compile_once(block, bargs, bkwargs, settings, args.caches)
                y = compile_once(block, bargs, bkwargs, settings, args.caches)
                case.update(same_bytes=torch.equal(x.first, y.first), compile_s=[round(x.seconds, 1),
                                                                                  round(y.seconds, 1)])
                del x, y
            except Exception as e:
                case["error"] = f"{type(e).__name__}: {e}"[:300]
        result["cases"].append(case)
        print("patch:", case, flush=True)
    result["seconds"] = round(time.perf_counter() - start, 1)
    _table(result)
    if not args.tiny:
        print("wrote", study.write_result(result, "compile_diagnose"))
    return result


ROUTES = ["standard", "standard", "standard", "wrapper", "wrapper", "compile_fx"]


def routes_case(block: torch.nn.Module, args: tuple, kwargs: dict, a: Compiled, caches: bool) -> dict:
    """More compiles after A and B, by the route users take (``backend="inductor"``), by a backend calling the
    object that route builds, and by A's: which equal A, and where does the first that does not part from A?"""
    case: dict = {"experiment": "routes", "routes": ROUTES, "equal_a": [], "compile_s": []}
    for route in ROUTES:
        c = compile_once(block, args, kwargs, {}, caches, route)
        case["equal_a"].append(torch.equal(c.first, a.first))
        case["compile_s"].append(round(c.seconds, 1))
        if not case["equal_a"][-1] and "first_differing" not in case:
            case["first_differing"] = {"route": route, "index": len(case["equal_a"]) - 1,
                                       **code_diff(a.wrapper, c.wrapper, limit=40),
                                       "configs_differing": configs_diff(a.configs(), c.configs())}
            if c.fn is not None:
                try:
                    case["first_differing"]["kernels"] = first_divergence(trace(a), trace(c))
                except Exception as e:
                    case["first_differing"]["kernels"] = f"{type(e).__name__}: {e}"
        del c
    return case


def _table(result: dict) -> None:
    cases = {c["experiment"]: c for c in result["cases"] if c["experiment"] not in ("patch", "routes")}
    b, c, k = cases["bytes"], cases["code"], cases["kernels"]
    print(f"\n{result['model']} BF16 block, compiled twice inside exact_inductor ({result['seconds']} s)")
    for key in ("a_first_equal_later", "a_equal_b", "a_after_b_equal_a", "a_under_other_stale_memory_equal",
                "a_on_moved_inputs_equal", "eager_under_other_stale_memory_equal", "eager_equal_a"):
        print(f"  {key:40s} {b.get(key, b.get('skipped', '-'))}")
    print(f"  {'wrappers identical':40s} {c['identical']} ({c['lines_changed']} lines changed, "
          f"{len(c['kernels_differing'])} kernels differ, {len(c['configs_differing'])} launch configs differ)")
    first = k.get("first")
    print(f"  {'first differing launch':40s} {first if first else k.get('error', 'none')}")
    print(f"\n  {'patch on top of exact_inductor':32s} same bytes  compile s")
    for case in result["cases"]:
        if case["experiment"] == "patch":
            verdict = case.get("same_bytes", case.get("skipped", case.get("error", "-")))
            print(f"  {case['patch']:32s} {str(verdict):11s} {case.get('compile_s', '')}")


if __name__ == "__main__":
    main()
