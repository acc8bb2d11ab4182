"""The fused-op registry (``ops/registry.py``): every declared op is listed, only the checked forms are torch ops,
each form's fake gives its reference's shapes, and each form's kernel equals its reference byte for byte: on the
CPU under the Triton interpreter (small probes, the precise recipe) where the interpreter's arithmetic is the
reference's, on the GPU for every form in both recipes (``gpu``)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from diffusers_nvfp4_fast.ops import fused, registry
from diffusers_nvfp4_fast.ops.fused import Probe
from diffusers_nvfp4_fast.ops.verify import bytes_equal
from support.interpreter import run_interpreted

# Forms whose kernel, under the interpreter, computes a stand-in of the GPU's arithmetic (so its bytes are compared
# with an emulation by the kernel's own test file, not with the torch reference here): form -> why.
INTERPRETER_STAND_INS = {
    "swiglu_quantize": "the interpreter's exp is NumPy's (test_swiglu_quantize.py)",
    "swiglu_gate_up_quantize": "the interpreter's exp is NumPy's (test_swiglu_quantize.py)",
    "gelu_quantize": "no libdevice: tanh is 1 - 2 / (exp(2x) + 1) (test_gelu_quantize.py)",
    "gelu_quantize_decoded": "no libdevice: tanh is 1 - 2 / (exp(2x) + 1) (test_gelu_quantize.py)",
    "resnorm_quantize": "torch's CPU LayerNorm is another algorithm than its CUDA one (test_layer_norm_quantize.py)",
    "resnorm_quantize_decoded": "torch's CPU LayerNorm is another algorithm (test_layer_norm_quantize.py)",
    "adaln_quantize": "torch's CPU LayerNorm is another algorithm (test_layer_norm_quantize.py)",
    "adaln_quantize_decoded": "torch's CPU LayerNorm is another algorithm (test_layer_norm_quantize.py)",
    "flux2_qk_norm_rotary": "rsqrt correctly rounded for rsqrt.approx (test_qk_norm_rotary.py)",
    "qk_norm_rotary": "rsqrt correctly rounded for rsqrt.approx (test_qk_norm_rotary.py)",
    "qwen_rotary": "torch's CPU complex product is not the CUDA build's FMA form (test_qk_norm_rotary.py)",
    "rotary": "a few results in the subnormal range differ under the interpreter (test_rotary.py, and on the GPU)",
}


def _cases(device: str, small: bool, fast_math: bool = False):
    gen = torch.Generator(device=device).manual_seed(0)
    for op in registry.FUSED_OPS:
        for case in op.probe(Probe(torch.device(device), gen, fast_math, small=small)):
            for form in op.forms:
                yield form, case


def _outputs(value) -> tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _bytes_equal(got, want) -> bool:
    got, want = _outputs(got), _outputs(want)
    return len(got) == len(want) and all(bytes_equal(a, b) for a, b in zip(got, want))


def test_every_declared_op_is_registered():
    """A FusedOp declared in an op file and missing from FUSED_OPS would escape the selftest and the tests here."""
    assert [id(op) for op in fused.DECLARED] and {id(op) for op in fused.DECLARED} == {
        id(op) for op in registry.FUSED_OPS}
    names = [form.name for form in registry.forms()]
    assert len(names) == len(set(names)), names


def test_only_the_checked_forms_are_torch_ops():
    """The package registers 19 ops in nvfp4_fast (32 before the plain forms became functions): one checked op per
    form, and the six unfused ones (quantize, the NVFP4 linears, the GELU-fed FC2)."""
    import diffusers_nvfp4_fast.api  # noqa: F401 - imports every op the package registers
    import diffusers_nvfp4_fast.inductor  # noqa: F401

    registered = sorted(n.removeprefix("nvfp4_fast::") for n in torch._C._dispatch_get_all_op_names()
                        if n.startswith("nvfp4_fast::") and not n.startswith("nvfp4_fast::test_"))
    checked = sorted(f"{form.name}_checked" for form in registry.forms())
    others = ["gelu_linear", "linear", "linear_fp16_x", "quantize", "quantized_linear", "quantized_linears"]
    assert registered == sorted(checked + others), registered
    assert len(registered) <= 20


def test_fakes_give_the_references_shapes():
    """What torch.compile traces (the fake) has the structure, shapes and dtypes of what runs (the reference)."""
    for form, case in _cases("cpu", small=True):
        want, fake = _outputs(form.reference(*case.args)), _outputs(form.fake(*case.args))
        assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in want], form.name
        assert len(want) == len(form.outputs), form.name


def test_forms_run_their_reference_off_the_gpu():
    """On the CPU a form (and its checked op, through the dispatcher) is its reference, byte for byte."""
    from diffusers_nvfp4_fast.ops.site import Site
    from diffusers_nvfp4_fast.ops.verify import drop_stats, new_stats

    stats_id, _ = new_stats("first")
    try:
        for form, case in _cases("cpu", small=True):
            want = form.reference(*case.args)
            assert _bytes_equal(form(*case.args), want), form.name
            checked_op = form._checked_op(*case.args, stats_id, "flux2_rotary")  # through torch's dispatcher
            assert _bytes_equal(checked_op, want), form.name
            assert _bytes_equal(form.checked(Site(stats_id, "flux2_rotary"), *case.args), want), form.name
    finally:
        drop_stats(stats_id)


def interpreted_forms() -> dict:
    """Each form's kernel under the interpreter against its reference, on the small probes, precise recipe."""
    from diffusers_nvfp4_fast.ops import dispatch

    result = {}
    for form, case in _cases("cpu", small=True):
        got = form.kernel(dispatch.kernels, *case.args)
        key = f"{form.name} {case.title} {case.shape}"
        result[key] = {"form": form.name, "equal": _bytes_equal(got, form.reference(*case.args)),
                       "shapes": [list(t.shape) for t in _outputs(got)],
                       "want": [list(t.shape) for t in _outputs(form.reference(*case.args))]}
    return result


@pytest.mark.slow
def test_interpreted_kernels_equal_their_references():
    """Byte equality for every form whose interpreter arithmetic is the reference's; the others (stand-ins, listed
    with the test that checks them against an emulation) must still run and give the reference's shapes."""
    result = run_interpreted(__name__, "interpreted_forms")
    assert {r["form"] for r in result.values()} == {form.name for form in registry.forms()}
    for key, r in result.items():
        assert r["shapes"] == r["want"], key
        if r["form"] not in INTERPRETER_STAND_INS:
            assert r["equal"], key


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [False, True])
def test_every_form_equals_its_reference_on_the_gpu(fast_math):
    """Every form's kernel on the selftest's probes (FLUX.2-dev / Qwen-Image widths), byte for byte against its
    reference (fast-math with the GPU's own reciprocal), except where this GPU keeps the op off (``unused_here``)."""
    from diffusers_nvfp4_fast.ops import dispatch
    from diffusers_nvfp4_fast.ops.verify import exact_fast_math_reference

    if not torch.cuda.is_available():
        pytest.skip("the forms' kernels were not compared on a GPU: none here; this runs on the GPU machine "
                    "(pytest -m gpu tests/test_fused_registry.py)")
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(0)
    differing, compared = [], 0
    for op in registry.FUSED_OPS:
        if op.unused_here(device) is not None:
            continue
        for case in op.probe(Probe(device, gen, fast_math)):
            for form in op.forms:
                assert form.runs(case.args[0]), form.name
                got = form.kernel(dispatch.kernels, *case.args)
                with exact_fast_math_reference() if fast_math else contextlib.nullcontext():
                    want = form.reference(*case.args)
                compared += 1
                if not _bytes_equal(got, want):
                    differing.append(f"{form.name} {case.title} {case.shape}")
    assert compared and not differing, differing

