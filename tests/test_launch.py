"""``kernels.launch``: host helpers that replace Triton's (CPU), and direct launches of the binary Triton's binder
picks, which must run the same binary as ``kernel[grid](...)``: same bytes, a new binary for every new
specialization, Triton's own path under launch hooks, capturable by CUDA graphs (``gpu``)."""

import importlib
import types

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed, so the launch tests did not run; they "
                                               "run wherever Triton is installed, as in CI (pip install -e '.[test]')")

from diffusers_nvfp4_fast import caches, kernels  # noqa: E402
from diffusers_nvfp4_fast.format import quantize_nvfp4 as reference_quantize  # noqa: E402

launch_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.launch")
quantize_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.quantize_nvfp4")
compat = importlib.import_module("diffusers_nvfp4_fast.kernels.triton_compat")


def test_host_cdiv_and_next_power_of_2_match_triton():
    """The plain host helpers that replace triton.cdiv / triton.next_power_of_2 in launch code give the same values."""
    from diffusers_nvfp4_fast.kernels.launch import cdiv, next_power_of_2

    values = [0, 1, 2, 15, 16, 17, 127, 128, 129, 4095, 4096, 4097, 70000, 2**31 - 1]
    for a in values:
        for b in (1, 2, 4, 16, 64, 128, 192, 256, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for n in [*range(1, 5000), 65535, 65536, 65537, 2**31 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def _entries(kernel) -> int:
    return len(launch_mod.compiled_binaries(kernel))


@pytest.mark.gpu
def test_gpu_direct_launches_match_reference_across_specializations():
    # Row counts 16 (divisible by 16), 1 (specialized to a constant), 17 and 16 again: Triton specializes integer
    # arguments on both properties, so the first three need their own binaries and the last reuses the first.
    g = torch.tensor([0.7], device="cuda")
    for rows in (16, 1, 17, 16, 1, 17):
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16) * 3
        want = reference_quantize(x, g, fast_math=False)  # exact in the precise recipe
        for _ in range(3):  # first call: Triton's path (compile, cache); then direct launches
            got = kernels.quantize_nvfp4_triton(x, g, fast_math=False)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"rows={rows}"
    assert _entries(quantize_mod._quantize_nvfp4_kernel) >= 3


@pytest.mark.gpu
def test_gpu_launch_hook_takes_tritons_path():
    g = torch.tensor([0.7], device="cuda")
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    kernels.quantize_nvfp4_triton(x, g, fast_math=False)
    kernels.quantize_nvfp4_triton(x, g, fast_math=False)  # now cached: the direct path would not call hooks
    seen = []

    def hook(metadata):
        seen.append(metadata)

    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        got = kernels.quantize_nvfp4_triton(x, g, fast_math=False)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert seen, "a registered launch hook must see the launch (Triton's own path)"
    want = reference_quantize(x, g, fast_math=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
def test_gpu_direct_launch_is_captured_by_cuda_graphs():
    g = torch.tensor([0.7], device="cuda")
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        kernels.quantize_nvfp4_triton(x, g, fast_math=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        packed, scales = kernels.quantize_nvfp4_triton(x, g, fast_math=False)
    x.copy_(torch.randn_like(x) * 5)
    graph.replay()
    torch.cuda.synchronize()
    want = reference_quantize(x, g, fast_math=False)
    assert torch.equal(packed, want[0]) and torch.equal(scales, want[1])


class _FakeBinary:
    """Stands in for a compiled Triton kernel: records what ``run`` got."""

    function = packed_metadata = None

    def __init__(self):
        self.runs = []

    def run(self, *values):
        self.runs.append(values[9:])  # after grid (3), stream, function, metadata and the three hook slots


class _FakeKernel:
    """Stands in for a ``@triton.jit`` kernel with parameters (x, n, BLOCK): a binder that specializes on nothing
    but returns ``bound`` as ``bound_of(args, kwargs)`` says, and ``kernel[grid](...)`` that compiles the binary."""

    def __init__(self, bound_of):
        self.binary = _FakeBinary()
        self.binder_calls = self.compiles = 0
        self.bound_of = bound_of
        self.device_caches = {0: (None, self._binder)}

    def _binder(self, *args, **kwargs):
        self.binder_calls += 1
        return self.bound_of(args, kwargs), ["spec"], {}

    def __getitem__(self, grid):
        def compile_and_run(*args, **kwargs):
            self.compiles += 1
            return self.binary
        return compile_and_run


def _fake_cuda(monkeypatch):
    monkeypatch.setattr(launch_mod, "INTERPRETING", False)
    monkeypatch.setattr(launch_mod, "hooks_installed", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(compat, "current_raw_stream", lambda device: 0)
    caches.reset("kernels.launch.compiled")
    caches.reset("kernels.launch.by_key")


def test_launch_by_site_records_the_binders_binary_and_constants(monkeypatch):
    """The first call compiles (Triton's path), the second asks the binder and records the call's specialization key,
    later calls with that key run the recorded binary with the positional arguments and the recorded constants,
    binder skipped."""
    _fake_cuda(monkeypatch)
    kernel = _FakeKernel(lambda args, kwargs: {"x": args[0], "n": args[1], "BLOCK": kwargs["BLOCK"]})
    x = object()
    for _ in range(4):
        launch_mod.launch_by_site(kernel, (1,), x, 7, BLOCK=64)
    assert (kernel.compiles, kernel.binder_calls) == (1, 2)
    assert kernel.binary.runs == [(x, 7, 64)] * 3
    launch_mod.launch_by_site(kernel, (1,), x, 7, BLOCK=128)  # another key: the binder again
    assert kernel.binder_calls == 3


def test_launch_by_site_never_records_what_the_binder_changed(monkeypatch):
    """A binder whose values are not the positional arguments themselves (converted), or whose remaining values
    are not plain constants (a tensor passed by keyword), keeps every call on the binder's path."""
    _fake_cuda(monkeypatch)
    converted = _FakeKernel(lambda args, kwargs: {"x": str(args[0]), "n": args[1], "BLOCK": kwargs["BLOCK"]})
    by_keyword = _FakeKernel(lambda args, kwargs: {"x": args[0], "n": args[1], "BLOCK": kwargs["BLOCK"]})
    block = torch.zeros(1)
    for _ in range(4):
        launch_mod.launch_by_site(converted, (1,), 5, 7, BLOCK=64)
        launch_mod.launch_by_site(by_keyword, (1,), 5, 7, BLOCK=block)
    assert converted.binder_calls == by_keyword.binder_calls == 4
    assert converted.binary.runs == [("5", 7, 64)] * 3
    assert by_keyword.binary.runs == [(5, 7, block)] * 3


@pytest.mark.gpu
def test_gpu_decoded_quantize_sites_run_the_binders_binary(monkeypatch):
    """The decoded quantize's site key (``launch_decoded_quantize``) picks the binary Triton's binder picks, for rows
    equal to 1, divisible by 16 or not, inputs 16-byte aligned or only 8, both recipes; keyed launches give the
    bytes of ``decode_nvfp4_rows(quantize(x))``."""
    from support.launch_sites import check_sites_against_binder

    gemm_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm")
    checked = check_sites_against_binder(quantize_mod, monkeypatch)
    g = torch.tensor([0.7], device="cuda")
    for rows in (1, 17):
        base = torch.randn(rows, 1024 + 4, device="cuda", dtype=torch.bfloat16) * 3
        for offset in (0, 4):  # 4 values = 8 bytes: the row starts lose 16-byte alignment
            x = base[:, offset:offset + 1024]
            for fast_math in (False, True):
                packed, scales = kernels.quantize_nvfp4_triton(x, g, fast_math=fast_math)
                want = gemm_mod.decode_nvfp4_rows(packed, scales, torch.float16).view(torch.int16)
                for call in range(4):  # Triton's path (twice at a kernel's first launch), recording, keyed
                    got = quantize_mod.quantize_nvfp4_decoded(x, g, fast_math=fast_math).view(torch.int16)
                    assert torch.equal(got, want), (rows, offset, fast_math, call)
    assert len(set(checked)) == 2 * 2 * 2, f"sites checked: {len(set(checked))} of 8"



_BUILT: list = []


def _build_plan() -> str:
    _BUILT.append(1)
    return "plan"


def test_launch_plans_are_built_at_the_second_call_of_a_class():
    """``ops.linear``'s plan table: no plan until a class (a key holding the layer tensors' addresses) was called
    twice the normal way, so a layer that offloading moves on every call never gets one; a launch hook or plans
    switched off (``DIRECT_LAUNCH``) send every call down the wrappers' path."""
    from diffusers_nvfp4_fast.ops import linear

    linear.forget_plans()
    built = _BUILT
    built.clear()

    here, there = ("quantize", 128, 1), ("quantize", 128, 2)
    try:
        linear.learn_plan(here, _build_plan, (), ())
        linear.learn_plan(there, _build_plan, (), ())
        assert linear.plan_for(here) is None and built == []
        linear.learn_plan(here, _build_plan, (), ())
        assert built == [1] and linear.plan_for(here) == "plan" and linear.plan_for(there) is None
        linear.learn_plan(here, _build_plan, (), ())  # decided already
        assert built == [1]
        original = launch_mod.hooks_installed
        launch_mod.hooks_installed = lambda: True
        try:
            assert linear.plan_for(here) is None
        finally:
            launch_mod.hooks_installed = original
        launch_mod.DIRECT_LAUNCH = False
        try:
            assert linear.plan_key("decoded", torch.zeros(4, 4), torch.float16, ()) is None
        finally:
            launch_mod.DIRECT_LAUNCH = True
    finally:
        linear.forget_plans()


def test_a_plan_builder_gets_exactly_the_keyed_tensors(monkeypatch):
    """A plan's builder is called with the call's tensors and the very values its key was made of; keyed values that
    are not the key's, or a builder that is a closure (which could read a tensor the key does not hold), are refused
    with an error that names them."""
    from diffusers_nvfp4_fast.ops import linear

    monkeypatch.setattr(linear, "kernels", types.SimpleNamespace(launch=types.SimpleNamespace(DIRECT_LAUNCH=True)))
    x, w, s = torch.zeros(4, 16), torch.zeros(8, 8), torch.zeros(2, 2)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda t: 0)
    key = linear.plan_key("decoded", x, torch.float16, (8, w, s, True))
    assert key is not None and key[-4:] == (8, w.data_ptr(), s.data_ptr(), True)
    got = []

    def record(*values):  # a closure over ``got``: refused
        got.append(values)

    linear.forget_plans()
    try:
        linear.learn_plan(key, got.append, ("call",), (8, w, s, True))  # first call: nothing built
        with pytest.raises(ValueError, match="not the ones key"):
            linear.learn_plan(key, got.append, ("call",), (8, torch.zeros(8, 8), s, True))
        with pytest.raises(ValueError, match="is a closure"):
            linear.learn_plan(key, record, ("call",), (8, w, s, True))
        linear.learn_plan(key, _collect, ("call",), (8, w, s, True))
        assert _COLLECTED == [("call", 8, w, s, True)]
    finally:
        linear.forget_plans()
        _COLLECTED.clear()


_COLLECTED: list = []


def _collect(*values) -> str:
    _COLLECTED.append(values)
    return "plan"


def _plan_layer(k: int, n: int, bias: bool, dtype=torch.bfloat16):
    from diffusers_nvfp4_fast import NVFP4Linear

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    layer = NVFP4Linear.from_weight(w, b, 6.0 / 2688)
    return layer.to(dtype) if dtype != torch.bfloat16 else layer


def _built_plans() -> int:
    from diffusers_nvfp4_fast.ops import linear

    return len(linear.planned())


_LATE = iter([None, "plan"])
_TRIES: list = []


def test_a_plan_that_cannot_be_built_yet_is_tried_again():
    """A class whose kernels are not recorded yet (a kernel's first class in a process: its binary is recorded at its
    third launch) builds no plan at its second call; it is tried again, and marked as having none only after
    ``_PLAN_TRIES`` calls."""
    from diffusers_nvfp4_fast.ops import linear

    linear.forget_plans()
    late, never = ("quantize", 512, 1), ("quantize", 512, 2)
    try:
        for _ in range(3):
            linear.learn_plan(late, next, (_LATE,), ())
        assert linear.plan_for(late) == "plan"
        _TRIES.clear()
        for _ in range(linear._PLAN_TRIES + 2):
            linear.learn_plan(never, _TRIES.append, (1,), ())
        assert len(_TRIES) == linear._PLAN_TRIES - 1 and linear.plan_for(never) is None
    finally:
        linear.forget_plans()


@pytest.mark.gpu
def test_gpu_the_first_layer_call_class_of_a_process_gets_its_plan():
    """In a fresh process, the first NVFP4 layer called (whose kernels are launched there for the first time) runs
    through a launch plan from its third call on."""
    import subprocess
    import sys

    if launch_mod.direct_launch_unavailable() is not None:
        pytest.skip(f"no launch plans with this Triton ({launch_mod.direct_launch_unavailable()}); this runs with "
                    "Triton 3.6, as on the GPU machine")

    code = ("import torch\nfrom diffusers_nvfp4_fast import NVFP4Linear\nfrom diffusers_nvfp4_fast.ops import linear\n"
            "layer = NVFP4Linear.from_weight(torch.randn(3072, 3072, device='cuda', dtype=torch.bfloat16) * 0.02, "
            "torch.randn(3072, device='cuda', dtype=torch.bfloat16), 8.0 / 2688)\n"
            "x = torch.randn(512, 3072, device='cuda', dtype=torch.bfloat16)\n"
            "for _ in range(4):\n    layer(x)\n"
            "print(sorted(type(p).__name__ for p in linear.planned()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['LinearPlan']", out.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [65, 512, 4097])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_layer_plans_give_the_wrappers_bytes(rows, dtype):
    """An ``NVFP4Linear`` call through its launch plan (decoded quantize + SM90 GEMM launched directly) gives the
    bytes of the same call through the kernel wrappers (``DIRECT_LAUNCH`` off), with and without bias, for plain
    BF16/FP16 input and for a fused producer's FP16 decode; the plan is built at the second call and used after."""
    from diffusers_nvfp4_fast.ops import linear

    linear.forget_plans()
    torch.manual_seed(rows)
    for k, n, bias in ((3072, 3072, True), (1024, 640, False)):
        layer = _plan_layer(k, n, bias, dtype)
        x = torch.randn(rows, k, device="cuda", dtype=dtype) * 2
        x16 = kernels.quantize_nvfp4_decoded(x, layer.input_scale_inv)
        launch_mod.DIRECT_LAUNCH = False
        try:
            want, want_decoded = layer(x), layer.forward_decoded(x16, dtype)
        finally:
            launch_mod.DIRECT_LAUNCH = True
        before = _built_plans()
        for call in range(4):
            assert torch.equal(layer(x).view(torch.int16), want.view(torch.int16)), (k, n, call)
            got = layer.forward_decoded(x16, dtype)
            assert torch.equal(got.view(torch.int16), want_decoded.view(torch.int16)), (k, n, call)
        planned = 2 if launch_mod.direct_launch_unavailable() is None else 0  # none with Triton 3.7+
        assert _built_plans() == before + planned, linear.planned()


@pytest.mark.gpu
def test_gpu_layer_plans_follow_moved_tensors_and_cuda_graphs():
    """A weight replaced in place (new storage) gives the call another key: it takes the wrappers' path and the new
    weight's bytes; a plan captured into a CUDA graph replays the eager bytes."""
    torch.manual_seed(0)
    layer = _plan_layer(3072, 3072, True)
    x = torch.randn(512, 3072, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        first = layer(x)
    other = _plan_layer(3072, 3072, True)
    layer.weight.data = other.weight.data.clone()
    layer.weight_scale.data = other.weight_scale.data.clone()
    layer.weight_scale_2.copy_(other.weight_scale_2)
    layer.refresh_derived_scales_()
    layer.bias.copy_(other.bias)
    want = other(x)
    assert not torch.equal(want, first)
    for _ in range(3):
        assert torch.equal(layer(x).view(torch.int16), want.view(torch.int16))
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
def test_gpu_packed_quantize_and_small_gemm_sites_run_the_binders_binary(monkeypatch):
    """The packed quantize (``launch_block_quantize``) and the small-M GEMM launched by site key
    (``nvfp4_gemm._configured_launch``, with the config its key looks up) run the binary Triton's binder picks,
    for rows equal to 1, divisible by 16 or not, inputs 16-byte aligned or only 8, both recipes, bias or not; keyed
    launches give the bytes of the first (Triton's own) call."""
    from support.launch_sites import check_sites_against_binder

    gemm_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm")
    checked = check_sites_against_binder(quantize_mod, monkeypatch)
    checked_gemm = check_sites_against_binder(gemm_mod, monkeypatch)
    g = torch.tensor([0.7], device="cuda")
    w_packed, w_scales = kernels.quantize_nvfp4_triton(torch.randn(640, 1024, device="cuda", dtype=torch.bfloat16), g)
    alpha = torch.tensor(1e-3, device="cuda")
    bias = torch.randn(640, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 17, 48):
        base = torch.randn(rows, 1024 + 4, device="cuda", dtype=torch.bfloat16) * 3
        for offset in (0, 4):  # 4 values = 8 bytes: the row starts lose 16-byte alignment
            x = base[:, offset:offset + 1024]
            for fast_math in (False, True):
                want = [t.clone() for t in kernels.quantize_nvfp4_triton(x, g, fast_math=fast_math)]
                want_out = {b is None: kernels.nvfp4_gemm(*want, w_packed, w_scales, alpha, bias=b)
                            for b in (None, bias)}
                for call in range(4):  # Triton's path (twice at a kernel's first launch), recording, keyed
                    got = kernels.quantize_nvfp4_triton(x, g, fast_math=fast_math)
                    assert all(torch.equal(a, b) for a, b in zip(got, want)), (rows, offset, fast_math, call)
                    for b in (None, bias):
                        out = kernels.nvfp4_gemm(*got, w_packed, w_scales, alpha, bias=b)
                        assert torch.equal(out.view(torch.int16), want_out[b is None].view(torch.int16))
    assert len(set(checked)) >= 3 * 2 * 2, f"quantize sites checked: {len(set(checked))}"
    assert len(set(checked_gemm)) >= 3, f"GEMM sites checked: {len(set(checked_gemm))}"
