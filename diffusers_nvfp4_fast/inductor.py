"""Inductor settings under which a compiled model gives the same bytes with fast paths on and off, and again at every
compile (docs/design.md §1): inductor rounds BF16 intermediates as eager does, and its kernels pick reduction configs
without timing them, which in torch 2.11 takes torch's deterministic algorithms as well as inductor's own setting.
Also the pass that lets NVFP4 layers reading one activation quantize it once (``ShareActivationQuantize``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from .ops import shared_quantize  # noqa: F401 - registers nvfp4_fast::quantized_linears, which compiled code calls
from .ops.gelu_quantize import check_compiled_gelu


@contextlib.contextmanager
def exact_inductor() -> Iterator[None]:
    """Compile and run inside this block: inductor rounds every intermediate to its dtype where eager does
    (``emulate_precision_casts``), picks reduction configs without timing them (``deterministic``), and compiles
    and runs under ``torch.use_deterministic_algorithms(True, warn_only=True)`` without filling fresh memory (a mode
    the user set stays as set).
    NVFP4 layers that read one activation quantize it once (``SHARE_ACTIVATION_QUANTIZE``, the same bytes), unless
    another ``post_grad_custom_pre_pass`` is set. On a GPU, the first entry per device compiles GELU (tanh) once and
    compares it with torch's on every BF16/FP16 value (``check_compiled_gelu``, about a second): where they agree,
    Qwen-Image's GELU site also runs in compiled graphs.

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
            settings["post_grad_custom_pre_pass"] = SHARE_ACTIVATION_QUANTIZE
        with inductor_config.patch(settings):
            if torch.cuda.is_available():  # the Qwen-Image GELU site runs compiled where this finds the bytes equal
                check_compiled_gelu(torch.device("cuda", torch.cuda.current_device()))
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        deterministic.fill_uninitialized_memory = before[2]


class ShareActivationQuantize(CustomGraphPass):
    """Inductor post-grad pass: the ``quantized_linear`` nodes that read one activation with one recipe and output
    dtype become one ``quantized_linears`` node (the activation quantized once where their global scales agree,
    ``ops/shared_quantize.py``): a block's query, key and value projections. ``rewritten`` counts the nodes."""

    def __init__(self) -> None:
        self.rewritten = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
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
                self._rewrite(graph, first.args[0], fast_math, out_dtype, nodes)

    def _rewrite(self, graph: torch.fx.Graph, x: Any, fast_math: bool, out_dtype: torch.dtype,
                 nodes: list[torch.fx.Node]) -> None:
        import operator

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
        self.rewritten += len(nodes)

    def uuid(self) -> str:
        return _source_hash()


_VIEWS = ("aten.reshape.default", "aten.view.default", "aten._unsafe_view.default", "aten.clone.default")


def _same_values(x: Any) -> Any:
    """A key equal for nodes that hold the same values: each layer reshapes the shared input itself."""
    if isinstance(x, torch.fx.Node) and x.op == "call_function" and str(x.target) in _VIEWS and not x.kwargs:
        return (str(x.target), _same_values(x.args[0]), repr(x.args[1:]))
    return x


@functools.cache
def _source_hash() -> str:
    """This module's source hash: inductor's FX graph cache keys on the pass's uuid, so a changed pass must not reuse
    code the old one compiled."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


SHARE_ACTIVATION_QUANTIZE = ShareActivationQuantize()
