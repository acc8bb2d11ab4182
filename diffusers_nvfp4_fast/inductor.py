"""Inductor settings under which a compiled model gives the same bytes with fast paths on and off, and again at every
compile (docs/design.md §1): inductor rounds BF16 intermediates as eager does, and its kernels pick reduction configs
without timing them, which in torch 2.11 takes torch's deterministic algorithms as well as inductor's own setting.
Also the pass over the NVFP4 layer nodes (``ActivationQuantizePass``): layers reading one activation quantize it once,
and a layer's quantize to FP16 values is fused into the kernel that produces its activation.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import operator
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from .ops import quantize_values as _quantize_values_module
from .ops import shared_quantize  # noqa: F401 - registers nvfp4_fast::quantized_linears, which compiled code calls
from .ops.linear import takes_decoded_activation
from .ops.quantize_values import quantize_values, register_reciprocal_lowering


@contextlib.contextmanager
def exact_inductor() -> Iterator[None]:
    """Compile and run inside this block: inductor rounds every intermediate to its dtype where eager does
    (``emulate_precision_casts``), picks reduction configs without timing them (``deterministic``), and compiles
    and runs under ``torch.use_deterministic_algorithms(True, warn_only=True)`` without filling fresh memory (a mode
    the user set stays as set).
    NVFP4 layers that read one activation quantize it once, and a layer's quantize to FP16 values is fused into the
    kernel producing its activation (``ACTIVATION_QUANTIZE_PASS``, the same bytes), unless another
    ``post_grad_custom_pre_pass`` is set.

    Example::

        pipe.transformer.compile_repeated_blocks(fullgraph=True)
        with exact_inductor():
            image = pipe(prompt).images[0]  # compiles on the first call, inside the block

    Raises ``RuntimeError`` naming the torch version when its inductor has no deterministic mode.
    """
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "deterministic"):
        raise RuntimeError(f"torch {torch.__version__}: inductor has no `deterministic` setting; exact_inductor "
                           "needs a torch whose inductor can skip timing reduction configs")
    deterministic: Any = torch.utils.deterministic  # its module attribute is not in the stubs
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              deterministic.fill_uninitialized_memory)
    if not before[0]:
        # without it torch 2.11's kernels still timed reduction configs: compiles gave other bytes (design.md §1);
        # no NaN fill of fresh memory: a fill kernel per allocation (9 ms a Qwen-Image step) and no byte changes
        torch.use_deterministic_algorithms(True, warn_only=True)
        deterministic.fill_uninitialized_memory = False
    try:
        settings: dict[str, Any] = {"emulate_precision_casts": True, "deterministic": True}
        if inductor_config.post_grad_custom_pre_pass is None:
            settings["post_grad_custom_pre_pass"] = ACTIVATION_QUANTIZE_PASS
        with inductor_config.patch(settings):
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        deterministic.fill_uninitialized_memory = before[2]


class ActivationQuantizePass(CustomGraphPass):
    """Inductor post-grad pass over the NVFP4 layer nodes (docs/design.md §1, "compiled graphs"), two rewrites that
    keep every byte:

    * share: ``quantized_linear`` nodes that read one activation with one recipe and output dtype become one
      ``quantized_linears`` node (the activation quantized once where their global scales agree,
      ``ops/shared_quantize.py``): a block's query, key and value projections. ``shared`` counts the nodes.
    * decompose: a remaining ``quantized_linear`` node whose call quantizes to FP16 values (SM80-SM90, more than 64
      rows, ``ops.linear.takes_decoded_activation``) becomes ``ops.quantize_values``' torch ops and a
      ``linear_fp16_x`` node, so that inductor fuses the quantize into the kernel that produces the activation
      (a GELU, a LayerNorm's modulation, a copy) instead of storing it and reading it back. Not where the
      activation comes from a graph input or from a kernel inductor does not generate (a GEMM, attention): there
      the opaque quantize kernel is faster. ``decomposed`` counts the nodes; ``decompose = False`` turns it off.
    """

    def __init__(self) -> None:
        self.shared = 0
        self.decomposed = 0
        self.decompose = True

    def __call__(self, graph: torch.fx.Graph) -> None:
        self._share(graph)
        if self.decompose and register_reciprocal_lowering():
            for node in list(graph.nodes):
                if node.target is torch.ops.nvfp4_fast.quantized_linear.default and _decomposable(node):
                    self._decompose(graph, node)

    def _share(self, graph: torch.fx.Graph) -> None:
        single = torch.ops.nvfp4_fast.quantized_linear.default
        order = {node: i for i, node in enumerate(graph.nodes)}
        groups: dict[tuple, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            if node.target is single and len(node.args) == 9 and not node.kwargs:
                x, _, fast_math, *_, out_dtype, _ = node.args
                groups.setdefault((_same_values(x), fast_math, out_dtype), []).append(node)
        for (_, fast_math, out_dtype), nodes in groups.items():
            first = nodes[0]
            # a later layer's tensors must exist where the first one runs (they are graph inputs in a block)
            nodes = [first] + [n for n in nodes[1:] if all(order.get(a, -1) < order[first] for a in n.all_input_nodes
                                                          if a is not n.args[0])]
            if len(nodes) > 1:
                self._rewrite_shared(graph, first.args[0], fast_math, out_dtype, nodes)

    def _rewrite_shared(self, graph: torch.fx.Graph, x: Any, fast_math: bool, out_dtype: torch.dtype,
                        nodes: list[torch.fx.Node]) -> None:
        columns = list(zip(*(n.args for n in nodes)))  # per argument position, one entry per layer
        with graph.inserting_before(nodes[0]):
            shared = graph.call_function(torch.ops.nvfp4_fast.quantized_linears.default, (
                x, list(columns[1]), fast_math, list(columns[3]), list(columns[4]), list(columns[5]),
                list(columns[6]), out_dtype, list(columns[8])))
            shared.meta["val"] = [n.meta.get("val") for n in nodes]
            items = [graph.call_function(operator.getitem, (shared, i)) for i in range(len(nodes))]
        for item, node in zip(items, nodes):
            item.meta.update(node.meta)
            node.replace_all_uses_with(item)
            graph.erase_node(node)
        self.shared += len(nodes)

    def _decompose(self, graph: torch.fx.Graph, node: torch.fx.Node) -> None:
        from torch._dynamo.utils import detect_fake_mode
        from torch._inductor.pattern_matcher import fwd_only

        args: Any = node.args
        x, global_scale, fast_math, w_packed, w_scales, alpha, bias, out_dtype, _ = args
        example = [x.meta["val"], global_scale.meta["val"]]
        with detect_fake_mode(example) or contextlib.nullcontext():
            traced = fwd_only(functools.partial(quantize_values, fast_math=fast_math), example)
        inputs = [n for n in traced.graph.nodes if n.op == "placeholder"]
        with graph.inserting_before(node):
            x16 = graph.graph_copy(traced.graph, dict(zip(inputs, [x, global_scale])))
            gemm = graph.call_function(torch.ops.nvfp4_fast.linear_fp16_x.default,
                                       (x16, w_packed, w_scales, alpha, bias, out_dtype))
        # not the old node's eager_input_vals: they describe quantized_linear's arguments
        gemm.meta.update({k: v for k, v in node.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
        node.replace_all_uses_with(gemm)
        graph.erase_node(node)
        self.decomposed += 1

    def uuid(self) -> str:
        return f"{_source_hash()}-{self.decompose}"  # a switched pass must not reuse another setting's code


# Producers inductor does not generate: quantizing their output stays the opaque kernel's work.
_NOT_GENERATED = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten.convolution.", "nvfp4_fast.")


def _decomposable(node: torch.fx.Node) -> bool:
    """Whether ``node`` (a ``quantized_linear``) quantizes to FP16 values, with static shapes, an activation that an
    inductor kernel produces, and a call the decomposition can spell (K a multiple of 16)."""
    if len(node.args) != 9 or node.kwargs:
        return False
    args: Any = node.args
    x, global_scale, _, _, _, _, bias, out_dtype, w_swizzled = args
    if not isinstance(x, torch.fx.Node) or not isinstance(global_scale, torch.fx.Node):
        return False
    val, bias_val = x.meta.get("val"), bias.meta.get("val") if isinstance(bias, torch.fx.Node) else bias
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or not all(isinstance(d, int) for d in val.shape):
        return False
    if val.shape[1] % 16 or "val" not in global_scale.meta:
        return False
    if not takes_decoded_activation(val.shape[0], val.device, bias_val, out_dtype, w_swizzled):
        return False
    producer = _through_views(x)
    return producer.op == "call_function" and producer.target is not operator.getitem and not any(
        str(producer.target).startswith(prefix) for prefix in _NOT_GENERATED)


# Ops that only look at their input's memory another way (inductor generates no kernel for them).
_VIEW_OPS = ("aten.reshape.default", "aten.view.default", "aten._unsafe_view.default", "aten.slice.Tensor",
             "aten.select.int", "aten.permute.default", "aten.transpose.int", "aten.squeeze.dim",
             "aten.unsqueeze.default", "aten.expand.default", "aten.as_strided.default")


def _through_views(x: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory ``x`` views."""
    while x.op == "call_function" and str(x.target) in _VIEW_OPS and isinstance(x.args[0], torch.fx.Node):
        x = x.args[0]
    return x


_VIEWS = ("aten.reshape.default", "aten.view.default", "aten._unsafe_view.default", "aten.clone.default")


def _same_values(x: Any) -> Any:
    """A key equal for nodes that hold the same values: each layer reshapes the shared input itself."""
    if isinstance(x, torch.fx.Node) and x.op == "call_function" and str(x.target) in _VIEWS and not x.kwargs:
        return (str(x.target), _same_values(x.args[0]), repr(x.args[1:]))
    return x


@functools.cache
def _source_hash() -> str:
    """The pass's sources' hash: inductor's FX graph cache keys on the pass's uuid, so a changed pass (or quantize
    spelling) must not reuse code the old one compiled."""
    sources = (Path(__file__), Path(_quantize_values_module.__file__))
    return hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()


ACTIVATION_QUANTIZE_PASS = ActivationQuantizePass()
