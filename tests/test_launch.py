"""``kernels.launch``: host helpers that replace Triton's (CPU), and direct launches of the binary Triton's binder
picks, which must run the same binary as ``kernel[grid](...)``: same bytes, a new binary for every new
specialization, Triton's own path under launch hooks, capturable by CUDA graphs (``gpu``)."""

import ast
import importlib
import inspect
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed, so the launch tests did not run; they "
                                               "run wherever Triton is installed, as in CI (pip install -e '.[test]')")

from diffusers_nvfp4_fast import kernels  # noqa: E402
from diffusers_nvfp4_fast.format import quantize_nvfp4 as reference_quantize  # noqa: E402

launch_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.launch")
quantize_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.quantize_nvfp4")


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
    return sum(1 for kernel_of_entry, _ in launch_mod._COMPILED.values() if kernel_of_entry is kernel)


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
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    monkeypatch.setattr(launch_mod, "_COMPILED", {})
    monkeypatch.setattr(launch_mod, "_BY_SITE", {})


def test_launch_by_site_records_the_binders_binary_and_constants(monkeypatch):
    """The first call compiles (Triton's path), the second asks the binder and records the site, later calls with
    that site run the recorded binary with the positional arguments and the recorded constants, binder skipped."""
    _fake_cuda(monkeypatch)
    kernel = _FakeKernel(lambda args, kwargs: {"x": args[0], "n": args[1], "BLOCK": kwargs["BLOCK"]})
    x = object()
    for _ in range(4):
        launch_mod.launch_by_site(kernel, (1,), ("site", 1), x, 7, BLOCK=64)
    assert (kernel.compiles, kernel.binder_calls) == (1, 2)
    assert kernel.binary.runs == [(x, 7, 64)] * 3
    launch_mod.launch_by_site(kernel, (1,), ("site", 2), x, 7, BLOCK=64)  # another site: the binder again
    assert kernel.binder_calls == 3


def test_launch_by_site_never_records_what_the_binder_changed(monkeypatch):
    """A binder whose values are not the positional arguments themselves (converted), or whose remaining values
    are not plain constants (a tensor passed by keyword), keeps every call on the binder's path."""
    _fake_cuda(monkeypatch)
    converted = _FakeKernel(lambda args, kwargs: {"x": str(args[0]), "n": args[1], "BLOCK": kwargs["BLOCK"]})
    by_keyword = _FakeKernel(lambda args, kwargs: {"x": args[0], "n": args[1], "BLOCK": kwargs["BLOCK"]})
    block = torch.zeros(1)
    for _ in range(4):
        launch_mod.launch_by_site(converted, (1,), ("converted",), 5, 7, BLOCK=64)
        launch_mod.launch_by_site(by_keyword, (1,), ("by keyword",), 5, 7, BLOCK=block)
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



def test_launch_plans_are_built_at_the_second_call_of_a_class():
    """``ops.linear``'s plan table: no plan until a class (a key holding the layer tensors' addresses) was called
    twice the normal way, so a layer that offloading moves on every call never gets one; a launch hook or plans
    switched off (``DIRECT_LAUNCH``) send every call down the wrappers' path."""
    from diffusers_nvfp4_fast.ops import linear

    linear.forget_plans()
    built = []

    def build():
        built.append(1)
        return "plan"

    here, there = ("quantize", 128, 1), ("quantize", 128, 2)
    try:
        linear.learn_plan(here, build)
        linear.learn_plan(there, build)
        assert linear.plan_for(here) is None and built == []
        linear.learn_plan(here, build)
        assert built == [1] and linear.plan_for(here) == "plan" and linear.plan_for(there) is None
        linear.learn_plan(here, build)  # decided already
        assert built == [1]
        original = launch_mod.hooks_installed
        launch_mod.hooks_installed = lambda: True
        try:
            assert linear.plan_for(here) is None
        finally:
            launch_mod.hooks_installed = original
        launch_mod.DIRECT_LAUNCH = False
        try:
            assert linear.plan_key("decoded", torch.zeros(4, 4), torch.float16) is None
        finally:
            launch_mod.DIRECT_LAUNCH = True
    finally:
        linear.forget_plans()


def _plan_layer(k: int, n: int, bias: bool, dtype=torch.bfloat16):
    from diffusers_nvfp4_fast import NVFP4Linear

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    layer = NVFP4Linear.from_weight(w, b, 6.0 / 2688)
    return layer.to(dtype) if dtype != torch.bfloat16 else layer


def _built_plans() -> int:
    from diffusers_nvfp4_fast.ops import linear

    return sum(1 for plan in linear._PLANS.values() if plan is not None)


def test_a_plan_that_cannot_be_built_yet_is_tried_again():
    """A class whose kernels are not recorded yet (a kernel's first class in a process: its binary is recorded at its
    third launch) builds no plan at its second call; it is tried again, and marked as having none only after
    ``_PLAN_TRIES`` calls."""
    from diffusers_nvfp4_fast.ops import linear

    linear.forget_plans()
    results = iter([None, "plan"])
    late, never = ("quantize", 512, 1), ("quantize", 512, 2)
    try:
        for _ in range(3):
            linear.learn_plan(late, lambda: next(results))
        assert linear.plan_for(late) == "plan"
        tries = []
        for _ in range(linear._PLAN_TRIES + 2):
            linear.learn_plan(never, lambda: tries.append(1))
        assert len(tries) == linear._PLAN_TRIES - 1 and never in linear._PLANS and linear.plan_for(never) is None
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
            "print(sorted(type(p).__name__ for p in linear._PLANS.values()))\n")
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
        assert _built_plans() == before + planned, linear._PLANS


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
    """The packed quantize (``launch_block_quantize``) and the autotuned small-M GEMM launched by site key
    (``nvfp4_gemm._autotuned_launch``, after the autotuner chose for its key) run the binary Triton's binder picks,
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


def _fake_nvidia_driver(monkeypatch):
    """Triton 3.6's NVIDIA driver module as far as ``direct_launch`` reads it: the C launcher's argument head, the
    launcher class and the attributes its ``__init__`` sets, the descriptor wrapper's closure, the TMA encoder and
    dtype map (the installed Triton's own module is checked by ``test_installed_triton_...`` below)."""
    import types

    class CudaLauncher:
        def __init__(self, launch):
            self.launch = launch
            self.global_scratch_size = self.profile_scratch_size = 0
            self.launch_cooperative_grid = self.launch_pdl = False

    class CudaUtils:
        def __init__(self):
            self.fill_tma_descriptor = None

    driver = types.SimpleNamespace(_BASE_ARGS_FORMAT="iiiKKppOOOOOO", CudaLauncher=CudaLauncher, CudaUtils=CudaUtils,
                                   wrap_handle_tensordesc=_wrap_like_triton_36, TMA_DTYPE_DEVICE_TO_HOST={1: 1, 8: 10})
    monkeypatch.setattr(launch_mod, "_driver_module", lambda: driver)
    monkeypatch.setattr(launch_mod, "INTERPRETING", False)
    monkeypatch.setattr(launch_mod, "hooks_installed", lambda: False)
    return driver


def _wrap_like_triton_36(launcher, tensordesc_indices, tensordesc_meta):
    """The shape of Triton 3.6's ``wrap_handle_tensordesc``: a wrapper whose closure holds the C launch function and
    the descriptors' metadata."""
    def inner(*args):
        return launcher(*args), tensordesc_indices, tensordesc_meta
    return inner


def _compiled(run):
    import types

    return types.SimpleNamespace(run=run, function=1234, packed_metadata=(8, 1, 4096))


def test_direct_launch_reads_triton_36s_launcher_and_refuses_anything_else(monkeypatch):
    """``direct_launch`` takes the C launch function itself (or, for a kernel with tensor-descriptor arguments, the one
    inside Triton's descriptor wrapper, with the descriptors' metadata) and refuses another launcher layout, scratch
    memory or a wrapper it does not know: those launches keep Triton's own path."""
    driver = _fake_nvidia_driver(monkeypatch)
    c_launch = len  # any builtin stands for the compiled C function
    plain = launch_mod.direct_launch(_compiled(driver.CudaLauncher(c_launch)))
    assert plain is not None and plain.launch is c_launch and plain.descriptor_meta is None
    assert (plain.function, plain.metadata, plain.cooperative, plain.pdl) == (1234, (8, 1, 4096), False, False)

    meta = [{"swizzle": 128, "elem_size": 2, "elem_type": 1, "block_size": [64, 64], "fp4_padded": False}]

    wrap = _wrap_like_triton_36
    wrapped = launch_mod.direct_launch(_compiled(driver.CudaLauncher(wrap(c_launch, {0}, meta))))
    assert wrapped is not None and wrapped.launch is c_launch and wrapped.descriptor_meta is meta
    assert launch_mod.direct_launch(_compiled(driver.CudaLauncher(wrap(c_launch, {0}, [None])))) is None
    assert launch_mod.direct_launch(_compiled(driver.CudaLauncher(lambda *a: a))) is None
    scratch = driver.CudaLauncher(c_launch)
    scratch.global_scratch_size = 64
    assert launch_mod.direct_launch(_compiled(scratch)) is None
    driver._BASE_ARGS_FORMAT = "iiiKKpOOOO"
    assert launch_mod.direct_launch(_compiled(driver.CudaLauncher(c_launch))) is None
    assert launch_mod.direct_launch_unavailable() == (f"Triton {triton.__version__}'s C launcher starts with "
                                                      "'iiiKKpOOOO', not Triton 3.6's 'iiiKKppOOOOOO'")
    driver._BASE_ARGS_FORMAT = "iiiKKppOOOOOO"
    del driver.CudaUtils
    assert launch_mod.direct_launch(_compiled(driver.CudaLauncher(c_launch))) is None
    assert launch_mod.direct_launch_unavailable().endswith("NVIDIA driver module lacks CudaUtils")


def test_descriptor_encoding_gives_the_c_launchers_descriptor_arguments(monkeypatch):
    """A tensor-descriptor argument becomes (tensor map, shape..., strides...), the map encoded for the given address
    with the compiled metadata (host dtype code, fp4-padded last dimension doubled, NaN padding flag), as Triton 3.6's
    ``make_tensordesc_arg`` does; only the address changes between calls."""
    import sys
    import types

    _fake_nvidia_driver(monkeypatch)
    calls = []
    active = types.SimpleNamespace(utils=types.SimpleNamespace(fill_tma_descriptor=lambda *a: calls.append(a) or "map"))
    monkeypatch.setitem(sys.modules, "triton.runtime.driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(sys.modules["triton.runtime"], "driver", sys.modules["triton.runtime.driver"],
                        raising=False)
    desc = types.SimpleNamespace(shape=[4096, 1536], strides=[1536, 1], padding="zero")
    meta = {"swizzle": 128, "elem_size": 1, "elem_type": 8, "block_size": [128, 64], "fp4_padded": True}
    encoding = launch_mod.DescriptorEncoding(desc, meta)
    assert encoding.arguments(0x1000) == ("map", 4096, 3072, 1536, 1)
    assert encoding.arguments(0x2000) == ("map", 4096, 3072, 1536, 1)
    assert encoding.arguments(0x1000) == ("map", 4096, 3072, 1536, 1)  # an address seen before: no new encoding
    assert calls == [(0x1000, 128, 1, 10, [128, 64], [4096, 3072], [1536, 1], 0),
                     (0x2000, 128, 1, 10, [128, 64], [4096, 3072], [1536, 1], 0)]
    for address in range(encoding._ADDRESSES + 1):  # bounded: past the limit the table starts again
        encoding.arguments(0x10000 + address)
    assert 0x1000 not in encoding._by_address and len(encoding._by_address) < encoding._ADDRESSES


# The installed Triton itself (not a stand-in): what ``launch`` and ``launch_by_site`` call for every Triton, and what
# ``direct_launch`` reads where it launches directly (Triton 3.6; from 3.7 on it says why not).


def _code_of(function) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(function)))


def _call_arguments(tree: ast.AST, callee: str) -> list[list[str]]:
    """The arguments of every call of ``callee`` (as written, e.g. ``kernel.run``) in ``tree``, as source text."""
    return [[ast.unparse(a) for a in node.args] for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func) == callee]


def test_installed_triton_launches_binaries_the_way_launch_does():
    """``JITFunction.run`` takes the binder from ``device_caches[device]`` (last entry), unpacks what it returns as
    (bound arguments, specialization, options) and runs the binary with the arguments ``launch._run`` passes."""
    from triton.runtime.jit import JITFunction

    tree = _code_of(JITFunction.run)
    statements = {ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Assign)}
    assert "bound_args, specialization, options = binder(*args, **kwargs)" in statements
    caches = [s for s in statements if s.endswith("= self.device_caches[device]")]
    assert len(caches) == 1 and caches[0].split("=")[0].split(",")[-1].strip() == "binder", caches
    assert _call_arguments(tree, "kernel.run") == [
        ["grid_0", "grid_1", "grid_2", "stream", "kernel.function", "kernel.packed_metadata", "launch_metadata",
         "knobs.runtime.launch_enter_hook", "knobs.runtime.launch_exit_hook", "*bound_args.values()"]]


def test_binder_key_reads_the_installed_binder(monkeypatch):
    """The installed Triton's binder for the quantize kernel (built as ``JITFunction.create_binder`` builds it for an
    SM90 device): ``binder_key`` gets every parameter's value in signature order, the positional arguments themselves
    first and plain constants after them (so ``launch_by_site`` records such a site), and a key that tells rows equal
    to 1, divisible by 16 or not, and 16-byte-aligned inputs or not apart."""
    import types

    from triton.backends.compiler import GPUTarget

    jit = importlib.import_module("triton.runtime.jit")
    kernel = quantize_mod._quantize_nvfp4_kernel
    active = types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32))
    monkeypatch.setattr(jit, "driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(kernel, "device_caches", {0: kernel.create_binder()})
    words = torch.zeros(64, 256, dtype=torch.int64)
    g, scales = torch.ones(1), torch.zeros(128, 64, dtype=torch.uint8)
    options = {"BLOCK_R": 8, "BLOCK_C": 32, "IS_BF16": True, **launch_mod.launch_options(torch.device("cpu"), True)}

    def key(rows: int, x: torch.Tensor) -> tuple:
        args = (x, g, words, scales, rows, 1024, 256, 64, 2)
        bound, found = launch_mod.binder_key(kernel, 0, args, options)
        values = tuple(bound.values())
        assert list(bound) == kernel.arg_names and all(v is a for v, a in zip(values, args))
        assert all(type(v) in launch_mod._CONSTANT_TYPES for v in values[len(args):])
        return found

    aligned, unaligned = words, words.view(-1)[1:]  # the second starts 8 bytes past a 16-byte boundary
    assert key(16, aligned) == key(32, aligned)
    assert len({key(16, aligned), key(17, aligned), key(1, aligned), key(16, unaligned)}) == 4


def _triton_version() -> tuple[int, int]:
    return tuple(int(part) for part in triton.__version__.split(".")[:2])  # type: ignore[return-value]


def test_installed_triton_has_the_direct_launch_verdict_of_its_version():
    """Triton 3.6 is launched directly; Triton 3.7 to 3.9 (one C launch function for all kernels, arguments as one
    tuple) keep ``CompiledKernel.run``, and ``direct_launch_unavailable`` says so."""
    reason = launch_mod.direct_launch_unavailable()
    if _triton_version() < (3, 7):
        assert reason is None
    else:
        assert reason == (f"Triton {triton.__version__}'s C launcher takes the kernel arguments as one tuple with "
                          "their annotations (no _BASE_ARGS_FORMAT); only Triton 3.6's per-kernel launcher is "
                          "launched directly")


def test_installed_triton_36_launcher_takes_what_direct_launch_passes():
    """Where the installed Triton is launched directly: ``CudaLauncher.__call__`` hands the C launcher the grid,
    stream, function, the two launch flags, two scratch buffers and then its own arguments (kernel metadata, launch
    metadata, two hooks, the kernel's arguments), as ``DirectLaunch.run`` does; a tensor descriptor is encoded with
    the arguments and the doubled FP4-padded width ``DescriptorEncoding`` uses."""
    if launch_mod.direct_launch_unavailable() is not None:
        pytest.skip(f"not launched directly with this Triton ({launch_mod.direct_launch_unavailable()}); this runs "
                    "with Triton 3.6, as on the GPU machine")
    driver = launch_mod._driver_module()
    assert list(inspect.signature(driver.CudaLauncher.__call__).parameters) == [
        "self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
    assert _call_arguments(_code_of(driver.CudaLauncher.__call__), "self.launch") == [
        ["gridX", "gridY", "gridZ", "stream", "function", "self.launch_cooperative_grid", "self.launch_pdl",
         "global_scratch", "profile_scratch", "*args"]]
    encode = _code_of(driver.make_tensordesc_arg)
    assert _call_arguments(encode, "triton.runtime.driver.active.utils.fill_tma_descriptor") == [
        ["arg.base.data_ptr()", "swizzle", "elem_size", "TMA_DTYPE_DEVICE_TO_HOST[elem_type]", "block_size", "shape",
         "strides", "padding"]]
    assert "shape[-1] *= 2" in {ast.unparse(n) for n in ast.walk(encode) if isinstance(n, ast.AugAssign)}
