"""What a captured CUDA graph bakes in, as hashable keys: a call's arguments and the model's state.

A graph replays fixed kernels with fixed pointers and fixed scalar arguments. So a replay is the eager call only when
everything the capture read from Python is the same: every tensor argument's shape, strides, dtype, device and
alignment, every other argument's value, and the model's state (which tensors its parameters and buffers are, the
forwards and processors installed, LoRA adapters and their scales, hooks, global switches that pick kernels).
``call_key`` and ``ModelWatch`` build those keys; docs/design.md §8 ("CUDA graphs") lists them.
"""

from __future__ import annotations

import enum
import itertools
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import state_probes
from ..module_hooks import hooks_on, is_lora_layer
from ..switches import CALL_TIME_SWITCHES, env_value

# Kernels pick code paths by pointer alignment (torch passes cuBLASLt the alignment up to 256 bytes): a static input
# reproduces its argument's alignment up to this many bytes. CPU kernels look no further than 64.
ALIGN = {"cuda": 256, "cpu": 64}
_SCALARS = (bool, int, str, bytes, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class UnkeyableCall(Exception):
    """A call whose arguments cannot be keyed (the message says which and why): it runs eagerly."""


def alignment(t: torch.Tensor) -> int:
    """The largest power of two dividing ``t``'s address, capped at what kernels on its device look at."""
    cap = ALIGN.get(t.device.type, 256)
    ptr = t.data_ptr()
    return min(ptr & -ptr, cap) if ptr else cap


def tensor_signature(t: torch.Tensor) -> tuple:
    """Everything about a tensor argument that a capture bakes in, except its values."""
    return (tuple(t.shape), t.stride(), t.dtype, t.device, alignment(t), t.requires_grad)


def _key(obj: Any, tensors: list[torch.Tensor], path: str) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return tensor_signature(obj)
    kind = type(obj)
    if kind in _SCALARS or isinstance(obj, enum.Enum):
        return kind, obj
    if kind is float:
        return kind, obj.hex()  # tells -0.0 from 0.0; NaN keys equal each other
    if kind in (tuple, list):
        return kind, tuple(_key(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj))
    if kind is dict:
        return kind, tuple((k, _key(v, tensors, f"{path}[{k!r}]")) for k, v in obj.items())
    raise UnkeyableCall(f"argument {path} is a {kind.__name__}")


def call_key(args: tuple, kwargs: dict) -> tuple[tuple, list[torch.Tensor]]:
    """(hashable key of the call's structure and non-tensor values, its tensor arguments in traversal order).

    Raises ``UnkeyableCall`` for an argument of another type (a KV-cache object, say) and for tensor arguments that
    share memory (static copies would not), naming the argument.
    """
    tensors: list[torch.Tensor] = []
    key = (_key(args, tensors, "args"), _key(kwargs, tensors, "kwargs"))
    storages = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    if len(storages) != sum(1 for t in tensors if t.numel()):
        raise UnkeyableCall("two tensor arguments share memory")
    return key, tensors


def substitute(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with its tensors replaced, in ``call_key``'s order, by ``tensors`` (consumed from the front)."""
    if isinstance(obj, torch.Tensor):
        return tensors.pop(0)
    if type(obj) in (tuple, list):
        return type(obj)(substitute(v, tensors) for v in obj)
    if type(obj) is dict:
        return {k: substitute(v, tensors) for k, v in obj.items()}
    return obj


def _broadcast_dims(t: torch.Tensor) -> list[int]:
    return [d for d in range(t.dim()) if t.stride(d) == 0 and t.shape[d] > 1]


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share an address: with its dimensions sorted by stride, each stride must reach
    past the span of the smaller ones (true of every view of a contiguous tensor that is not a broadcast)."""
    span = 0
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def writable_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` narrowed to one element along its broadcast (stride-0) dimensions: each memory location once."""
    for d in _broadcast_dims(t):
        t = t.narrow(d, 0, 1)
    return t


def static_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor with ``t``'s shape, strides (broadcast dimensions included), dtype, device and
    ``alignment``: the buffer a graph reads in place of the argument ``t``.

    Raises ``UnkeyableCall`` for a tensor whose elements overlap other than by broadcasting (copying into such a buffer
    is ambiguous)."""
    if not _broadcast_dims(t) and _overlaps(t):
        raise UnkeyableCall(f"a tensor argument {tuple(t.shape)} with strides {t.stride()} overlaps itself")
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    cap, want = ALIGN.get(t.device.type, 256), alignment(t)
    base = torch.empty(span + 2 * cap // t.element_size(), dtype=t.dtype, device=t.device)
    # the first address past base with exactly `want` as its alignment: a multiple of `want`, not of 2 * want
    start = -(-base.data_ptr() // cap) * cap + (want if want < cap else 0)
    return base.as_strided(t.shape, t.stride(), (start - base.data_ptr()) // t.element_size())


def copy_into(static: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value``'s elements into ``static`` (same shape and strides: ``call_key`` matched them)."""
    writable_view(static).copy_(writable_view(value))


_EPOCH = [0]  # bumped whenever any module, parameter or buffer is registered or reassigned (set_submodule, LoRA)
_WATCHING: list = []


def _bump(*_: Any) -> None:
    _EPOCH[0] += 1


def watch_registrations() -> None:
    """Install torch's global registration hooks once: they make ``ModelWatch`` re-read a model's structure."""
    if not _WATCHING:
        module = torch.nn.modules.module
        _WATCHING.extend(register(_bump) for register in (
            module.register_module_module_registration_hook, module.register_module_parameter_registration_hook,
            module.register_module_buffer_registration_hook))


def _global_switches() -> tuple:
    """Process-wide settings that change which kernels a capture records, or what our ops do: the environment
    switches read at call time (a graph keeps the values it saw) and the registered state probes among them."""
    cuda = torch.backends.cuda
    return (
        tuple(map(env_value, CALL_TIME_SWITCHES)), torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cuda"), cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
        cuda.matmul.allow_bf16_reduced_precision_reduction, cuda.matmul.allow_fp16_reduced_precision_reduction,
        cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
        cuda.cudnn_sdp_enabled(), torch.are_deterministic_algorithms_enabled(), _diffusers_attention_backend(),
        state_probes.read_all(),
    )


def _diffusers_attention_backend() -> Any:
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    except ImportError:
        return None
    return getattr(_AttentionBackendRegistry, "_active_backend", None)


def _lora_state(layer: Any) -> tuple:  # a peft tuner layer
    active = tuple(layer.active_adapters)
    scaling = layer.scaling
    return (active, bool(layer.disable_adapters), tuple(layer.merged_adapters), tuple(scaling.get(a) for a in active))


def _processor_state(processor: Any) -> tuple:
    return (id(processor), getattr(processor, "_attention_backend", None),
            id(getattr(processor, "_parallel_config", None)))


class ModelWatch:
    """The state of one model that its captured graphs depend on, read at every call in about a millisecond.

    ``state()`` returns ``(weights, config, reason)``: ``weights`` a version number that changes whenever a
    parameter or buffer is another tensor or sits at another address (a graph reads them in place), ``config`` a
    version number of everything else a capture bakes in (instance forwards, attention processors and backends,
    LoRA adapters and scales, global switches), ``reason`` why no graph may run in this state (a hook inside the
    model, a dropout or batch norm in training mode) or None. The module list is re-read only when torch reports a
    registration (``watch_registrations``). Reads go through C-level ``map`` loops: a Qwen-Image transformer has
    2,300 modules and 6,300 tensors.
    """

    def __init__(self, model: nn.Module):
        watch_registrations()
        self.model = model
        self._epoch = -1
        self._weights = self._config = 0
        self._last_config: tuple | None = None
        self._config_numbers: dict[tuple, int] = {}
        self._configs_seen = 0
        self._tensors: list[torch.Tensor | None] = []  # kept across refreshes: a refresh alone is no change
        self._ptrs: list[int | None] = []
        self._indices: list[int] = []
        self._slot_dicts: list[dict] = []
        self._slot_names: list[str] = []

    def _refresh(self) -> None:
        modules = list(self.model.named_modules())
        self._names = [name for name, _ in modules]
        self._modules = [m for _, m in modules]
        self._dicts = [m.__dict__ for _, m in modules]
        # Modules whose output depends on their training flag (random masks, batch statistics).
        self._stochastic = [(name, m.__dict__) for name, m in modules if isinstance(m, _STOCHASTIC) and
                            getattr(m, "p", 1.0) != 0]
        slots = [(m._parameters, n) for _, m in modules for n in m._parameters]
        slots += [(m._buffers, n) for _, m in modules for n in m._buffers]
        self._slot_dicts = [d for d, _ in slots]
        self._slot_names = [n for _, n in slots]
        self._probes: list[tuple[nn.Module, Callable[[nn.Module], Any]]] = []
        for _, m in modules:
            if is_lora_layer(m):
                self._probes.append((m, _lora_state))
            if "processor" in m.__dict__:
                self._probes.append((m, lambda m: _processor_state(m.__dict__["processor"])))
        self._epoch = _EPOCH[0]

    def _current(self) -> list[torch.Tensor | None]:
        return list(map(operator.getitem, self._slot_dicts, self._slot_names))

    def _weights_version(self) -> int:
        current = self._current()
        same = len(current) == len(self._tensors) and all(map(operator.is_, current, self._tensors))
        if same:
            present: list = [t for t in current if t is not None]
            same = torch._C._tensors_data_ptrs_at_indices_equal(present, self._ptrs, self._indices)
        if not same:
            self._tensors = current
            ptrs: list[int | None] = [t.data_ptr() for t in current if t is not None]
            self._ptrs = ptrs
            self._indices = list(range(len(self._ptrs)))
            self._weights += 1
        return self._weights

    def _reason(self) -> str | None:
        for name, d in self._stochastic:
            if d["training"]:
                return f"{name} ({type(self._modules[self._names.index(name)]).__name__}) is in training mode"
        inner = self._dicts[1:]  # hooks on the model itself run at every call, outside the graph
        if any(map(_FORWARD_HOOKS, inner)) or any(map(_PRE_HOOKS, inner)) or any(
                map(operator.contains, inner, itertools.repeat("_diffusers_hook"))) or any(
                map(operator.contains, inner, itertools.repeat("_hf_hook"))):
            for name, module in zip(self._names[1:], self._modules[1:]):
                hooks = hooks_on(module)
                if hooks:
                    return f"hook on {name}: {', '.join(hooks)}"
        return None

    def state(self) -> tuple[int, int, str | None]:
        if self._epoch != _EPOCH[0]:
            self._refresh()
        weights = self._weights_version()
        config = (tuple(map(id, map(_FORWARD, self._dicts))), tuple(probe(m) for m, probe in self._probes),
                  _global_switches())
        if config != self._last_config:  # a configuration seen before gets its number back (LoRA 1.0 -> 0.5 -> 1.0)
            self._last_config = config
            if config not in self._config_numbers:
                self._configs_seen += 1
                self._config_numbers[config] = self._configs_seen
            self._config = self._config_numbers[config]
            while len(self._config_numbers) > _MAX_CONFIGS:
                self._config_numbers.pop(next(iter(self._config_numbers)))
        return weights, self._config, self._reason()

    def tensors(self) -> list[torch.Tensor]:
        """The model's parameters and buffers now (the tensors graphs may read without owning)."""
        return [t for t in self._current() if t is not None]


_MAX_CONFIGS = 64
_STOCHASTIC = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)
_FORWARD_HOOKS = operator.itemgetter("_forward_hooks")
_PRE_HOOKS = operator.itemgetter("_forward_pre_hooks")
_FORWARD = operator.methodcaller("get", "forward")
