"""``kernels.triton_compat``, the one module that reads Triton's and torch's private launch internals, checked against
the installed Triton's real objects on the CPU (no GPU): whether direct launch is on or off and why, the binder, the
compiled kernel of an ahead-of-time SM90 build, the C launcher and descriptor encoding of Triton 3.6, the Gluon
descriptor and layout shortcuts, and the specialization key against Triton's own specialization."""

import ast
import importlib
import inspect
import textwrap
import types

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed, so the Triton seam tests did not run; they "
                                               "run wherever Triton is installed, as in CI (pip install -e '.[test]')")

compat = importlib.import_module("diffusers_nvfp4_fast.kernels.triton_compat")
launch_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.launch")
quantize_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.quantize_nvfp4")


def _fake_nvidia_driver(monkeypatch):
    """Triton 3.6's NVIDIA driver module as far as ``direct_launch`` reads it: the C launcher's argument head, the
    launcher class and the attributes its ``__init__`` sets, the descriptor wrapper's closure, the TMA encoder and
    dtype map (the installed Triton's own module is checked by ``test_installed_triton_...`` below)."""


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
    monkeypatch.setattr(compat, "_driver_module", lambda: driver)
    monkeypatch.setattr(compat, "INTERPRETING", False)
    return driver


def _wrap_like_triton_36(launcher, tensordesc_indices, tensordesc_meta):
    """The shape of Triton 3.6's ``wrap_handle_tensordesc``: a wrapper whose closure holds the C launch function and
    the descriptors' metadata."""
    def inner(*args):
        return launcher(*args), tensordesc_indices, tensordesc_meta
    return inner


def _compiled(run):


    return types.SimpleNamespace(run=run, function=1234, packed_metadata=(8, 1, 4096))


def test_direct_launch_reads_triton_36s_launcher_and_refuses_anything_else(monkeypatch):
    """``direct_launch`` takes the C launch function itself (or, for a kernel with tensor-descriptor arguments, the one
    inside Triton's descriptor wrapper, with the descriptors' metadata) and refuses another launcher layout, scratch
    memory or a wrapper it does not know: those launches keep Triton's own path."""
    driver = _fake_nvidia_driver(monkeypatch)
    c_launch = len  # any builtin stands for the compiled C function
    plain = compat.direct_launch(_compiled(driver.CudaLauncher(c_launch)))
    assert plain is not None and plain.launch is c_launch and plain.descriptor_meta is None
    assert (plain.function, plain.metadata, plain.cooperative, plain.pdl) == (1234, (8, 1, 4096), False, False)

    meta = [{"swizzle": 128, "elem_size": 2, "elem_type": 1, "block_size": [64, 64], "fp4_padded": False}]

    wrap = _wrap_like_triton_36
    wrapped = compat.direct_launch(_compiled(driver.CudaLauncher(wrap(c_launch, {0}, meta))))
    assert wrapped is not None and wrapped.launch is c_launch and wrapped.descriptor_meta is meta
    assert compat.direct_launch(_compiled(driver.CudaLauncher(wrap(c_launch, {0}, [None])))) is None
    assert compat.direct_launch(_compiled(driver.CudaLauncher(lambda *a: a))) is None
    scratch = driver.CudaLauncher(c_launch)
    scratch.global_scratch_size = 64
    assert compat.direct_launch(_compiled(scratch)) is None
    driver._BASE_ARGS_FORMAT = "iiiKKpOOOO"
    assert compat.direct_launch(_compiled(driver.CudaLauncher(c_launch))) is None
    assert compat.direct_launch_unavailable() == (f"Triton {triton.__version__}'s C launcher starts with "
                                                      "'iiiKKpOOOO', not Triton 3.6's 'iiiKKppOOOOOO'")
    driver._BASE_ARGS_FORMAT = "iiiKKppOOOOOO"
    del driver.CudaUtils
    assert compat.direct_launch(_compiled(driver.CudaLauncher(c_launch))) is None
    assert compat.direct_launch_unavailable().endswith("NVIDIA driver module lacks CudaUtils")


def test_descriptor_encoding_gives_the_c_launchers_descriptor_arguments(monkeypatch):
    """A tensor-descriptor argument becomes (tensor map, shape..., strides...), the map encoded for the given address
    with the compiled metadata (host dtype code, fp4-padded last dimension doubled, NaN padding flag), as Triton 3.6's
    ``make_tensordesc_arg`` does; only the address changes between calls."""
    import sys


    _fake_nvidia_driver(monkeypatch)
    calls = []
    active = types.SimpleNamespace(utils=types.SimpleNamespace(fill_tma_descriptor=lambda *a: calls.append(a) or "map"))
    monkeypatch.setitem(sys.modules, "triton.runtime.driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(sys.modules["triton.runtime"], "driver", sys.modules["triton.runtime.driver"],
                        raising=False)
    desc = types.SimpleNamespace(shape=[4096, 1536], strides=[1536, 1], padding="zero")
    meta = {"swizzle": 128, "elem_size": 1, "elem_type": 8, "block_size": [128, 64], "fp4_padded": True}
    encoding = compat.DescriptorEncoding(desc, meta)
    assert encoding.arguments(0x1000) == ("map", 4096, 3072, 1536, 1)
    assert encoding.arguments(0x2000) == ("map", 4096, 3072, 1536, 1)
    assert encoding.arguments(0x1000) == ("map", 4096, 3072, 1536, 1)  # an address seen before: no new encoding
    assert calls == [(0x1000, 128, 1, 10, [128, 64], [4096, 3072], [1536, 1], 0),
                     (0x2000, 128, 1, 10, [128, 64], [4096, 3072], [1536, 1], 0)]
    for address in range(encoding.ADDRESSES + 1):  # bounded: past the limit the table starts again
        encoding.arguments(0x10000 + address)
    assert 0x1000 not in encoding.by_address and len(encoding.by_address) < encoding.ADDRESSES


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
    (bound arguments, specialization, options) and runs the binary with the arguments ``run_compiled`` passes."""
    from triton.runtime.jit import JITFunction

    tree = _code_of(JITFunction.run)
    statements = {ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Assign)}
    assert "bound_args, specialization, options = binder(*args, **kwargs)" in statements
    caches = [s for s in statements if s.endswith("= self.device_caches[device]")]
    assert len(caches) == 1 and caches[0].split("=")[0].split(",")[-1].strip() == "binder", caches
    assert _call_arguments(tree, "kernel.run") == [
        ["grid_0", "grid_1", "grid_2", "stream", "kernel.function", "kernel.packed_metadata", "launch_metadata",
         "knobs.runtime.launch_enter_hook", "knobs.runtime.launch_exit_hook", "*bound_args.values()"]]


def _triton_version() -> tuple[int, int]:
    return tuple(int(part) for part in triton.__version__.split(".")[:2])  # type: ignore[return-value]


def test_installed_triton_has_the_direct_launch_verdict_of_its_version():
    """Triton 3.6 is launched directly; Triton 3.7 to 3.9 (one C launch function for all kernels, arguments as one
    tuple) keep ``CompiledKernel.run``, and ``direct_launch_unavailable`` says so."""
    reason = compat.direct_launch_unavailable()
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
    if compat.direct_launch_unavailable() is not None:
        pytest.skip(f"not launched directly with this Triton ({compat.direct_launch_unavailable()}); this runs "
                    "with Triton 3.6, as on the GPU machine")
    driver = compat._driver_module()
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


def test_run_compiled_passes_what_jitfunction_run_passes():
    """``run_compiled`` calls ``CompiledKernel.run`` with JITFunction.run's arguments (no launch metadata or hooks)."""
    from triton.runtime.jit import JITFunction

    theirs = _call_arguments(_code_of(JITFunction.run), "kernel.run")[0]
    ours = _call_arguments(_code_of(compat.run_compiled), "compiled.run")[0]
    assert len(ours) == len(theirs) and ours[4:6] == ["compiled.function", "compiled.packed_metadata"]
    assert ours[6:9] == ["None"] * 3 and theirs[6:9] == ["launch_metadata", "knobs.runtime.launch_enter_hook",
                                                         "knobs.runtime.launch_exit_hook"]
    assert (ours[-1], theirs[-1]) == ("*values", "*bound_args.values()")


def _binder(kernel, monkeypatch):
    """``kernel``'s binder built by the installed Triton as ``JITFunction.create_binder`` builds it for an SM90 device,
    installed in its ``device_caches`` for device 0 (no GPU: the target is given)."""
    from triton.backends.compiler import GPUTarget

    jit = importlib.import_module("triton.runtime.jit")
    active = types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32))
    monkeypatch.setattr(jit, "driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(kernel, "device_caches", {0: kernel.create_binder()})


def _quantize_call(rows: int, x: torch.Tensor, **changes) -> tuple[tuple, dict]:
    g, words, scales = torch.ones(1), torch.zeros(64, 256, dtype=torch.int64), torch.zeros(128, 64, dtype=torch.uint8)
    options = {"BLOCK_R": 8, "BLOCK_C": 32, "IS_BF16": True, **compat_options(), **changes}
    return (x, g, words, scales, rows, 1024, 256, 64, 2), options


def compat_options() -> dict:
    return launch_mod.launch_options(torch.device("cpu"), True)


def test_the_installed_binder_binds_and_specializes_as_launch_reads_it(monkeypatch):
    """``bind``: the installed binder returns every parameter's value in signature order (the positional arguments
    themselves first, plain constants after them, so ``launch_by_site`` records such a call) and a specialization
    that tells rows equal to 1, divisible by 16 or not, and 16-byte-aligned inputs or not apart."""
    kernel = quantize_mod._quantize_nvfp4_kernel
    _binder(kernel, monkeypatch)
    assert compat.has_binder(kernel, 0) and not compat.has_binder(kernel, 1)
    words = torch.zeros(64, 256, dtype=torch.int64)

    def specialization(rows: int, x: torch.Tensor) -> tuple:
        args, options = _quantize_call(rows, x)
        bound, found = compat.bind(kernel, 0, args, options)
        values = tuple(bound.values())
        assert list(bound) == kernel.arg_names and all(v is a for v, a in zip(values, args))
        assert all(type(v) in launch_mod._CONSTANT_TYPES for v in values[len(args):])
        return tuple(found)

    aligned, unaligned = words, words.view(-1)[1:]  # the second starts 8 bytes past a 16-byte boundary
    assert specialization(16, aligned) == specialization(32, aligned)
    assert len({specialization(16, aligned), specialization(17, aligned), specialization(1, aligned),
                specialization(16, unaligned)}) == 4


def test_make_binder_builds_the_binder_triton_builds_at_a_first_launch(monkeypatch):
    """``make_binder``: the installed Triton's ``device_caches`` builds the kernel's binder when read, as its first
    launch would (the compile-only pass builds it on the calling thread before compiling on others)."""
    from triton.backends.compiler import GPUTarget

    jit = importlib.import_module("triton.runtime.jit")
    active = types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32))
    monkeypatch.setattr(jit, "driver", types.SimpleNamespace(active=active))
    kernel = quantize_mod._quantize_nvfp4_kernel
    monkeypatch.setattr(kernel, "device_caches", type(kernel.device_caches)(kernel.create_binder))
    assert not compat.has_binder(kernel, 0)
    compat.make_binder(kernel, 0)
    assert compat.has_binder(kernel, 0) and not compat.has_binder(kernel, 1)
    bound, _ = compat.bind(kernel, 0, *_quantize_call(16, torch.zeros(64, 256, dtype=torch.int64)))
    assert list(bound) == kernel.arg_names


def test_specialization_key_is_at_least_as_fine_as_tritons(monkeypatch):
    """``specialization_key`` by Triton's own rules: over calls that differ in every property Triton specializes on
    (integers equal to 1, divisible by 16 or not, 64-bit; tensor dtype and 16-byte alignment; constexprs; a bool
    against the integer 1), two calls with equal keys always have equal Triton specializations (so a keyed launch runs
    the binary Triton would pick), and calls Triton tells apart get different keys."""
    kernel = quantize_mod._quantize_nvfp4_kernel
    _binder(kernel, monkeypatch)
    base = torch.zeros(4096, dtype=torch.int64)
    tensors = [base, base[1:], base[2:], base.view(torch.float64), base.view(torch.int32)[1:]]
    calls = []
    for x in tensors:
        for rows in (1, 2, 16, 17, 32, 2**33):
            calls.append(_quantize_call(rows, x))
    calls += [_quantize_call(True, base), _quantize_call(16, base, BLOCK_R=16), _quantize_call(16, base, IS_BF16=1),
              _quantize_call(16, base, IS_BF16=False), _quantize_call(16, base, FAST_MATH=False)]
    seen: dict[tuple, tuple] = {}
    for args, options in calls:
        _, triton_spec = compat.bind(kernel, 0, args, options)
        triton_key = (tuple(triton_spec), tuple(options.items()))
        key = compat.specialization_key(args, options)
        assert seen.setdefault(key, triton_key) == triton_key, (key, triton_key)
    triton_keys = {(tuple(compat.bind(kernel, 0, a, o)[1]), tuple(o.items())) for a, o in calls}
    assert len(seen) >= len(triton_keys) > 12


def _sm90_module():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                        reason="this Triton has no Gluon Hopper API, so the SM90 GEMM's seam was not checked; it runs "
                               "with Triton >= 3.6, as CI installs")
    return importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm_sm90")


def test_gluon_descriptor_shortcuts_and_key_agree_with_triton(monkeypatch):
    """A descriptor from ``descriptor_over`` has the fields of one built by ``from_tensor`` over the new base; a
    layout from ``layout_with_fixed_repr`` is an equal instance of its class with the same repr, so Triton's
    specialization of a descriptor argument (the text of its dtype, block and layout) is unchanged; and
    ``specialization_key`` tells descriptors apart wherever Triton's specialization does."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _sm90_module()
    plain = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float16)
    fixed = compat.layout_with_fixed_repr(plain)
    assert isinstance(fixed, gl.NVMMASharedLayout) and repr(fixed) == repr(plain)
    assert {k: v for k, v in vars(fixed).items() if k != "repr_once"} == vars(plain)
    x, y = torch.zeros(256, 64, dtype=torch.float16), torch.ones(256, 64, dtype=torch.float16)
    built = TensorDescriptor.from_tensor(x, [64, 64], fixed)
    fields = compat.descriptor_fields(built)
    assert fields is not None and fields["base"] is None
    over, want = compat.descriptor_over(TensorDescriptor, fields, y), TensorDescriptor.from_tensor(y, [64, 64], fixed)
    assert type(over) is TensorDescriptor and over.base is y
    assert {k: v for k, v in vars(over).items() if k != "base"} == {k: v for k, v in vars(want).items() if k != "base"}

    def triton_spec(desc) -> tuple:
        return native_specialize_impl(BaseBackend, desc, False, True, True)

    assert triton_spec(over) == triton_spec(want) == triton_spec(TensorDescriptor.from_tensor(y, [64, 64], plain))
    variants = [want, over, TensorDescriptor.from_tensor(y, [128, 64], plain),
                TensorDescriptor.from_tensor(y.to(torch.bfloat16), [64, 64],
                                             gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)),
                TensorDescriptor.from_tensor(y, [64, 32], gl.NVMMASharedLayout.get_default_for([64, 32], gl.float16))]
    seen: dict = {}
    for desc in variants:
        key = compat.specialization_key((desc,), {})
        assert seen.setdefault(key, triton_spec(desc)) == triton_spec(desc)
    assert len(seen) >= len({triton_spec(d) for d in variants}) == 4


def test_compiled_kernel_of_an_sm90_build_has_what_launch_reads():
    """An SM90 build made ahead of time on the CPU by the installed Triton is a ``CompiledKernel`` with the
    ``function`` and ``packed_metadata`` that ``run_compiled`` and ``direct_launch`` read and a ``run`` property that
    loads the binary on first access (``load_binary``)."""
    from triton.compiler.compiler import CompiledKernel

    from support.sass_count import compile_kernel

    compiled = compile_kernel("quantize", 90, True)
    assert isinstance(compiled, CompiledKernel)
    assert isinstance(inspect.getattr_static(CompiledKernel, "run"), property)
    assert "function" in vars(compiled) and compiled.packed_metadata is not None
    assert compat.load_binary(types.SimpleNamespace()) is False


def test_the_installed_torch_has_the_raw_stream_getter():
    """``current_raw_stream`` is torch's private stream-handle getter where torch is a CUDA build."""
    if torch.version.cuda is None:
        pytest.skip(f"torch {torch.__version__} is a CPU build without CUDA stream functions, so the raw stream was "
                    "not checked; this runs with a CUDA build of torch, as on the GPU machine")
    assert callable(compat.raw_stream_getter())


def test_the_verdict_on_direct_launch_for_the_installed_triton_is_stated():
    """The installed Triton's verdict, as the test log shows it: on (Triton 3.6's per-kernel C launcher) or off and
    why (Triton 3.7 - 3.9: one C launcher taking a tuple; any other layout: the part that differs)."""
    reason = compat.direct_launch_unavailable()
    head = compat.launcher_head()
    print(f"Triton {triton.__version__}: direct launch {'on' if reason is None else 'off: ' + reason}")
    assert (reason is None) == (head == compat.LAUNCHER_HEAD and not compat._missing_launcher_parts(
        compat._driver_module()))


def test_the_compile_listener_hears_a_compile_then_a_cache_load_and_chains(monkeypatch, tmp_path):
    """An SM90 build on the CPU by the installed Triton reaches ``add_compile_listener``'s callback with the kernel's
    name and module: compiled the first time, loaded from the same (empty at first) cache directory the second time.
    A listener installed before keeps hearing every event, and removing ours puts it back."""
    from support.sass_count import compile_kernel

    assert compat.compile_listener_unavailable() is None, "Triton 3.6 - 3.9 all have knobs.compilation.listener"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert compat.triton_cache_dir() == str(tmp_path)
    users, ours = [], []
    user_listener = lambda **kw: users.append(kw["cache_hit"])  # noqa: E731
    monkeypatch.setattr(triton.knobs.compilation, "listener", user_listener)
    remove = compat.add_compile_listener(ours.append)
    try:
        compile_kernel("quantize", 90, True)
        compile_kernel("quantize", 90, True)
    finally:
        remove()
    assert triton.knobs.compilation.listener is user_listener
    name = "_quantize_nvfp4_kernel"
    assert [(e.name, e.cache_hit) for e in ours] == [(name, False), (name, True)]
    assert ours[0].module.endswith("kernels.quantize_nvfp4") and ours[0].seconds > ours[1].seconds >= 0
    assert users == [False, True]
    spec = ours[0].specialization  # what the cache key is made of, by argument name; the cache load has the same
    assert spec == ours[1].specialization and spec["fn"] and spec["signature"]["x_ptr"].startswith("*")
    assert spec["constants"]["BLOCK_R"] == "8" and spec["constants"]["FAST_MATH"] == "True"


def test_the_cache_key_parts_computed_ahead_are_the_ones_a_compile_uses(monkeypatch, tmp_path):
    """``compute_cache_key_parts(90)`` computes Triton's own key and the sm_90 backend's ``ptxas`` version once; an
    SM90 build (a miss, then a hit) afterwards computes neither again and reads both (they are what its cache key is
    made of, so the first compile or cache load of a process no longer pays 0.3 s for them)."""
    from triton.backends.nvidia.compiler import get_ptxas_version
    from triton.runtime.cache import triton_key

    from support.sass_count import compile_kernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    triton_key.cache_clear()
    get_ptxas_version.cache_clear()
    compat.compute_cache_key_parts(90)
    assert (triton_key.cache_info().misses, get_ptxas_version.cache_info().misses) == (1, 1)
    compile_kernel("quantize", 90, True)
    compile_kernel("quantize", 90, True)
    keys, ptxas = triton_key.cache_info(), get_ptxas_version.cache_info()
    assert (keys.misses, ptxas.misses) == (1, 1), "a compile computed a part again: Triton keys on something else"
    assert keys.hits >= 2 and ptxas.hits >= 1, (keys, ptxas)


def test_two_specializations_of_one_kernel_differ_where_their_keys_do():
    """``CompileEvent.specialization`` of two sources of one kernel that Triton keys apart (an alignment attribute)
    differ in that argument's entry and nowhere else."""
    from triton.compiler import ASTSource

    fn = quantize_mod._quantize_nvfp4_kernel
    signature = {name: "i32" for name in fn.arg_names}
    aligned, unaligned = (ASTSource(fn, signature, {}, attrs) for attrs in ({(0,): [["tt.divisibility", 16]]}, {}))
    assert aligned.hash() != unaligned.hash()
    a, b = (compat._specialization(src) for src in (aligned, unaligned))
    assert {k for k in a if a[k] != b[k]} == {"attrs"} and a["attrs"] == {fn.arg_names[0]: "[['tt.divisibility', 16]]"}


def test_a_removed_listener_under_another_stops_calling_back(monkeypatch):
    """Where a listener was installed on top of ours, removing ours leaves that one in place and silences ours."""
    monkeypatch.setattr(triton.knobs.compilation, "listener", None)
    ours: list = []
    remove = compat.add_compile_listener(ours.append)
    installed = triton.knobs.compilation.listener
    outer = lambda **kw: installed(**kw)  # noqa: E731 (a later listener that chains to ours)
    triton.knobs.compilation.listener = outer
    remove()
    assert triton.knobs.compilation.listener is outer
    outer(src=types.SimpleNamespace(name="k", fn=None), metadata={}, metadata_group={}, times=None, cache_hit=False)
    assert ours == []


def test_without_a_listener_knob_the_reason_names_the_triton(monkeypatch):
    monkeypatch.setattr(compat, "knobs", None)
    assert compat.compile_listener_unavailable() == (f"Triton {triton.__version__} has no compilation listener "
                                                     "(triton.knobs.compilation.listener, Triton 3.4 and later)")
    with pytest.raises(RuntimeError, match="no compilation listener"):
        compat.add_compile_listener(print)


_KEYS_IN_ORDER = """
import sys
from triton.runtime import jit
import diffusers_nvfp4_fast.kernels
callable_type = getattr(jit, "JITCallable", jit.JITFunction)
found = sorted((name + "." + attr, value) for name, module in list(sys.modules.items())
               if name.startswith("diffusers_nvfp4_fast.kernels.")
               for attr, value in vars(module).items()
               if isinstance(value, callable_type) and value.__module__ == name)
keys = {name: fn.cache_key for name, fn in (found[::-1] if sys.argv[1] == "callers_first" else found)}
print(sorted(keys.items()))
"""


def test_every_kernel_has_one_cache_key_whatever_is_hashed_first():
    """Triton 3.6 keys a caller differently when it is hashed before its callees, so a warm process that launched in
    another order than the cold one recompiled 12 of Qwen-Image's 21 binaries (benchmarks/results/first_image-h100.json,
    ``recompiled``). The package settles every key at import; two processes hashing in opposite orders agree."""
    import subprocess
    import sys

    def keys(order: str) -> str:
        run = subprocess.run([sys.executable, "-c", _KEYS_IN_ORDER, order], capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout

    first = keys("callees_first")
    assert "_quantize_nvfp4_kernel" in first and first == keys("callers_first")


def test_settling_hashes_the_callees_first(tmp_path, monkeypatch):
    """``settle_cache_keys`` computes a helper's key before its caller's, through a global and a module attribute."""
    source = textwrap.dedent('''
        import triton
        import triton.language as tl
        SCALE = tl.constexpr(2)

        @triton.jit
        def caller(ptr):  # defined first: settling in definition order would hash it first
            tl.store(ptr, helper(tl.load(ptr)))

        @triton.jit
        def helper(x):
            return leaf(x) + 1

        @triton.jit
        def leaf(x):
            return x * SCALE
    ''')
    (tmp_path / "settle_probe.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = importlib.import_module("settle_probe")
    order: list[str] = []
    cache_key = type(probe.leaf).cache_key

    def first_asked(fn):
        order.extend([] if fn.__name__ in order else [fn.__name__])
        return cache_key.fget(fn)

    monkeypatch.setattr(type(probe.leaf), "cache_key", property(first_asked))
    compat.settle_cache_keys("settle_probe")
    assert order == ["leaf", "helper", "caller"]


def test_settling_leaves_a_kernel_triton_cannot_hash_to_its_first_compile(tmp_path, monkeypatch):
    """A kernel whose key Triton refuses (it names a plain Python function) must not break the package's import."""
    source = textwrap.dedent('''
        import triton

        def plain(x):
            return x

        @triton.jit
        def refused(x):
            return plain(x)
    ''')
    for name in ("settle_refused", "settle_refused_probe"):  # Triton keeps a placeholder key after refusing once
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="Unsupported function referenced"):
        importlib.import_module("settle_refused_probe").refused.cache_key  # noqa: B018
    importlib.import_module("settle_refused")
    compat.settle_cache_keys("settle_refused")
