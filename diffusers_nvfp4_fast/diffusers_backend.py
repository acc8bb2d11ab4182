"""This package as a diffusers quantization backend: ``quant_method: "diffusers-nvfp4-fast"`` (what this package's
``save_pretrained`` and ``quantize_transformer``'s own method write) is read by diffusers' own ``from_pretrained``, and
``from_pretrained(bf16, quantization_config=NVFP4FastConfig(...))`` quantizes while it loads (docs/checkpoints.md).

The one module that touches diffusers' private quantizer internals. It follows diffusers 0.42.1
(``DIFFUSERS_API_VERSION``), whose ``ModelMixin.from_pretrained`` (models/modeling_utils.py) looks a checkpoint's
``quant_method`` up in ``diffusers.quantizers.auto``'s ``AUTO_QUANTIZATION_CONFIG_MAPPING`` and
``AUTO_QUANTIZER_MAPPING`` and calls the ``DiffusersQuantizer`` it finds, in this order: ``validate_environment``,
``update_torch_dtype``, ``maybe_update_loaded_keys(keys, checkpoint_files)``, ``preprocess_model`` (->
``_process_model_before_weight_loading``, on the meta-device model), per weight shard ``maybe_update_state_dict``
(models/model_loading_utils.py ``_load_shard_file``), ``postprocess_model`` (->
``_process_model_after_weight_loading``).
``DiffusionPipeline.save_pretrained`` is wrapped so that a component's refusal comes before anything is written.
Registration (``registration.py``) checks that the installed diffusers has what this uses (``missing_api``) and
warns, naming the version and the missing names, where it does not; tests/test_diffusers_backend.py checks it and
the call sites against the installed source. The loading itself lives in ``loaders/diffusers_load.py`` and
``quantize/on_load.py``, which know nothing of diffusers' internals.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, cast

import torch
from diffusers.quantizers.base import DiffusersQuantizer
from diffusers.quantizers.quantization_config import QuantizationConfigMixin

DIFFUSERS_API_VERSION = "0.42.1"
QUANT_METHOD = "diffusers-nvfp4-fast"  # loaders.common.PRODUCER: the quant_method of this package's checkpoints

# What registration needs (module -> names), checked before anything is changed.
USED_API: dict[str, tuple[str, ...]] = {
    "diffusers.quantizers.auto": ("AUTO_QUANTIZER_MAPPING", "AUTO_QUANTIZATION_CONFIG_MAPPING",
                                  "DiffusersAutoQuantizer"),
    "diffusers.quantizers.base": ("DiffusersQuantizer",),
    "diffusers.quantizers.quantization_config": ("QuantizationConfigMixin",),
}
# The DiffusersQuantizer members NVFP4FastQuantizer overrides or relies on diffusers calling.
QUANTIZER_HOOKS = (
    "validate_environment", "update_torch_dtype", "maybe_update_loaded_keys", "preprocess_model",
    "_process_model_before_weight_loading", "maybe_update_state_dict", "postprocess_model",
    "_process_model_after_weight_loading", "supports_parallel_loading", "is_serializable", "is_trainable",
    "is_compileable",
)
# Where diffusers calls them: (module, qualified name) -> calls its source must contain (checked by the tests).
CALL_SITES: dict[tuple[str, str], tuple[str, ...]] = {
    ("diffusers.models.modeling_utils", "ModelMixin.from_pretrained"): (
        "hf_quantizer.validate_environment(", "hf_quantizer.update_torch_dtype(",
        "hf_quantizer.maybe_update_loaded_keys(loaded_keys, checkpoint_files)", "hf_quantizer.preprocess_model(",
        "hf_quantizer.postprocess_model(model)"),
    ("diffusers.models.model_loading_utils", "_load_shard_file"): ("hf_quantizer.maybe_update_state_dict(",),
    ("diffusers.quantizers.base", "DiffusersQuantizer.preprocess_model"): ("_process_model_before_weight_loading(",),
    ("diffusers.quantizers.base", "DiffusersQuantizer.postprocess_model"): ("_process_model_after_weight_loading(",),
}
PIPELINE_SAVE = ("diffusers.pipelines.pipeline_utils", "DiffusionPipeline", "save_pretrained")
PIPELINE_SAVE_ARGUMENTS = ("save_directory", "safe_serialization", "use_flashpack")


class NVFP4FastMethod(str, Enum):
    """The ``quant_method`` (diffusers reads ``quant_method.value``; a str, so it equals the JSON string)."""

    NVFP4_FAST = QUANT_METHOD


def _installed_version() -> str:
    return str(getattr(sys.modules.get("diffusers"), "__version__", "unknown"))


def missing_api() -> list[str]:
    """The names this module uses that the installed diffusers lacks (empty: all there)."""
    missing = []
    for module_name, names in USED_API.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        missing += [f"{module_name}.{n}" for n in names if not hasattr(module, n)]
    auto = sys.modules.get("diffusers.quantizers.auto")
    for table in USED_API["diffusers.quantizers.auto"][:2]:
        if auto is not None and hasattr(auto, table) and not isinstance(getattr(auto, table), dict):
            missing.append(f"diffusers.quantizers.auto.{table} as a dict")
    missing += [f"DiffusersQuantizer.{n}" for n in QUANTIZER_HOOKS if not hasattr(DiffusersQuantizer, n)]
    return missing


def _known_version(version: str) -> bool:
    """The release diffusers' quantizer API is followed from, up to the patch number."""
    return version.split(".")[:2] == DIFFUSERS_API_VERSION.split(".")[:2]


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def register_quantizer() -> bool:
    """Put ``NVFP4FastConfig`` / ``NVFP4FastQuantizer`` into diffusers' quantizer tables; True when registered
    (idempotent).

    On a diffusers that lacks a name this uses, nothing is changed and a ``RuntimeWarning`` names the version and what
    is missing; on another release than the one followed, it registers and warns."""
    if is_registered():
        return True
    version, missing = _installed_version(), missing_api()
    if missing:
        _warn_once(
            f"diffusers-nvfp4-fast follows the quantizer API of diffusers {DIFFUSERS_API_VERSION}; diffusers {version} "
            f"lacks {', '.join(missing)}, so '{QUANT_METHOD}' was NOT registered: diffusers' from_pretrained cannot "
            "read this package's checkpoints. Load them with diffusers_nvfp4_fast.load_nvfp4_transformer")
        return False
    auto = importlib.import_module("diffusers.quantizers.auto")
    auto.AUTO_QUANTIZER_MAPPING[QUANT_METHOD] = NVFP4FastQuantizer
    auto.AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] = NVFP4FastConfig
    if not _known_version(version):
        _warn_once(
            f"diffusers-nvfp4-fast follows the quantizer API of diffusers {DIFFUSERS_API_VERSION}; diffusers {version} "
            f"has every name it uses, so '{QUANT_METHOD}' was registered, but its calls are unchecked: if "
            "from_pretrained of an NVFP4 checkpoint fails, load it with diffusers_nvfp4_fast.load_nvfp4_transformer")
    return True


def is_registered() -> bool:
    auto = sys.modules.get("diffusers.quantizers.auto")
    return auto is not None and getattr(auto, "AUTO_QUANTIZER_MAPPING", {}).get(QUANT_METHOD) is NVFP4FastQuantizer


def guard_pipeline_save() -> bool:
    """Wrap ``DiffusionPipeline.save_pretrained`` so that an NVFP4 component that would refuse its save (a LoRA held,
    ``safe_serialization=False``...) refuses before diffusers writes any component; True when wrapped (idempotent).
    On a diffusers without the method or its arguments, a ``RuntimeWarning`` names the version and what is missing."""
    module_name, class_name, method = PIPELINE_SAVE
    cls = getattr(sys.modules.get(module_name), class_name, None)
    original = getattr(cls, method, None)
    if getattr(original, "_nvfp4_guarded", False):
        return True
    signature = inspect.signature(original) if callable(original) else None
    absent = ([f"{module_name}.{class_name}.{method}"] if signature is None else
              [f"its argument {p}" for p in PIPELINE_SAVE_ARGUMENTS if p not in signature.parameters])
    if signature is None or absent:
        _warn_once(f"diffusers-nvfp4-fast follows diffusers {DIFFUSERS_API_VERSION}; diffusers {_installed_version()} "
                   f"lacks {', '.join(absent)}: a pipeline save that an NVFP4 model refuses may write the other "
                   "components first")
        return False
    original = cast(Callable[..., Any], original)

    @functools.wraps(original)
    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        save = sys.modules.get("diffusers_nvfp4_fast.loaders.save")  # not imported: no NVFP4 model in this process
        if save is not None:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            save.refuse_pipeline_save(self, a["save_directory"], a["safe_serialization"], a["use_flashpack"])
        return original(self, *args, **kwargs)

    save_pretrained._nvfp4_guarded = True  # type: ignore[attr-defined]
    setattr(cls, method, save_pretrained)
    return True


def _single_device(device_map: Any) -> torch.device | None:
    """The one device of ``device_map`` (diffusers turns ``"cuda"`` into ``{"": device}``); None for none."""
    if device_map is None:
        return None
    values = set(device_map.values()) if isinstance(device_map, dict) else {device_map}
    if len(values) == 1 and isinstance(value := values.pop(), (str, int, torch.device)) and value not in (
            "disk", "auto", "balanced", "balanced_low_0", "sequential"):
        return torch.device(value)
    raise ValueError(f"device_map={device_map!r}: an NVFP4 model loads onto one device (device_map='cuda', 'cpu' or "
                     "a torch.device); to offload, load it whole and use pipe.enable_model_cpu_offload(), "
                     "enable_sequential_cpu_offload() or diffusers_nvfp4_fast.fit_to_budget(pipe, GiB)")


class NVFP4FastConfig(QuantizationConfigMixin):
    """Quantize a BF16 FLUX.2 / Qwen-Image transformer to NVFP4 while diffusers loads it:
    ``Flux2Transformer2DModel.from_pretrained(repo, subfolder="transformer", dtype=torch.bfloat16,
    quantization_config=NVFP4FastConfig(dynamic=True))``.

    The result equals ``load_nvfp4_transformer(quantize_transformer(...))`` tensor for tensor: the same BF16-kept
    layers (ModelOpt's recipe for the class, quantize/recipes.py, or ``exclude``), the same precise quantizer, q/k/v
    groups sharing ``weight_scale_2``. Weights are quantized on ``device_map``'s device (default: the CPU).

    Args:
        dynamic: every NVFP4 layer computes its activation scale per call (``amax(input) / 2688``; not a calibrated
            recipe, and the fused paths fall back for those layers).
        input_scales: instead, each quantized layer's calibrated ``input_scale``: ``{layer name: value}`` or a JSON
            file (``calibrate_input_scales``' output, or the ``input_scale`` tensors of a ``quantize_transformer``
            checkpoint written out). It must name every quantized layer and nothing else.
        exclude: fnmatch patterns of Linears to keep BF16, instead of the recipe of the model's class.

    A checkpoint this package wrote (``quant_method: "diffusers-nvfp4-fast"``) needs no config: diffusers reads it
    through ``from_dict`` once ``diffusers_nvfp4_fast`` is imported.
    """

    def __init__(self, *, dynamic: bool = False, input_scales: str | os.PathLike | Mapping[str, float] | None = None,
                 exclude: Sequence[str] | None = None) -> None:
        if dynamic == (input_scales is not None):
            raise ValueError("NVFP4FastConfig quantizes activations with either dynamic=True (a scale per call) or "
                             "input_scales={layer: value} / 'scales.json' (calibrated: calibrate_input_scales or "
                             "quantize_transformer(pipeline=...) make them), not both or neither")
        if isinstance(exclude, str):
            raise TypeError(f"exclude={exclude!r}: give a list of fnmatch patterns, e.g. [{exclude!r}]")
        self.quant_method = NVFP4FastMethod.NVFP4_FAST  # type: ignore[assignment]  # diffusers types its own enum
        self.dynamic = bool(dynamic)
        self.input_scales: str | dict[str, float] | None = None
        self._scales: dict[str, float] | None = None
        if input_scales is not None:
            from .loaders.bfl.input_scales import read_input_scales

            self._scales = read_input_scales(input_scales)
            as_path = isinstance(input_scales, (str, os.PathLike))
            self.input_scales = str(input_scales) if as_path else dict(self._scales)
        self.exclude = None if exclude is None else [str(p) for p in exclude]
        self.checkpoint: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any) -> Any:
        """The ``quantization_config`` of a checkpoint this package wrote (diffusers calls this for config.json)."""
        config = cls.__new__(cls)
        config.quant_method = NVFP4FastMethod.NVFP4_FAST  # type: ignore[assignment]  # (as in __init__)
        config.dynamic, config.input_scales, config._scales, config.exclude = False, None, None, None
        config.checkpoint = {**copy.deepcopy(dict(config_dict)), "quant_method": QUANT_METHOD}
        return (config, kwargs) if return_unused_kwargs else config

    def to_dict(self) -> dict[str, Any]:
        if self.checkpoint is not None:
            return copy.deepcopy(self.checkpoint)
        return {"quant_method": QUANT_METHOD, "dynamic": self.dynamic, "input_scales": copy.deepcopy(self.input_scales),
                "exclude": copy.deepcopy(self.exclude)}

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVFP4FastConfig) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, like diffusers' configs

    def scales(self) -> dict[str, float] | None:
        """Each quantized layer's ``input_scale`` (None: computed per call)."""
        return None if self._scales is None else dict(self._scales)


class NVFP4FastQuantizer(DiffusersQuantizer):
    """diffusers' quantizer for ``quant_method: "diffusers-nvfp4-fast"``: a checkpoint of this package read into
    ``NVFP4Linear`` layers as ``load_nvfp4_transformer`` reads it, or a BF16 model quantized while it loads."""

    requires_calibration = False

    def __init__(self, quantization_config: NVFP4FastConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.torch_dtype = torch.bfloat16
        self.device: torch.device | None = None
        self.files: list[str] = []
        self.model: Any = None
        self.load: Any = None  # PrequantizedLoad or QuantizeOnLoad, for one from_pretrained

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        self.device = _single_device(kwargs.get("device_map"))

    def update_torch_dtype(self, torch_dtype: torch.dtype | None) -> torch.dtype:
        """``dtype=`` (or diffusers' older ``torch_dtype=``) of unquantized weights and biases; default BF16, as
        ``load_nvfp4_transformer``."""
        self.torch_dtype = torch_dtype if torch_dtype is not None else torch.bfloat16
        return self.torch_dtype

    def maybe_update_loaded_keys(self, loaded_keys: list[str], checkpoint_files: Sequence[str]) -> list[str]:
        self.files = [str(f) for f in checkpoint_files]
        return loaded_keys

    def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> None:
        config = cast(NVFP4FastConfig, self.quantization_config)
        source = str(Path(self.files[0]).parent) if self.files else type(model).__name__
        if self.pre_quantized:
            from .loaders.diffusers_load import PrequantizedLoad

            if config.checkpoint is None:
                raise ValueError(f"{source}: a pre-quantized model without '{QUANT_METHOD}' checkpoint facts")

            self.load = PrequantizedLoad(model, self.files, config.to_dict(), self.torch_dtype)
        elif config.checkpoint is not None:
            raise ValueError(f"{source}: this NVFP4FastConfig describes a saved checkpoint; to quantize a BF16 model "
                             "while loading it pass NVFP4FastConfig(dynamic=True) or NVFP4FastConfig(input_scales=...)")
        else:
            from .quantize.on_load import QuantizeOnLoad, plan_layers

            plan = plan_layers(model, config.exclude, config.scales(), source)
            self.load = QuantizeOnLoad(model, plan, self.torch_dtype, self.device or torch.device("cpu"), source)
        self.model = model

    def maybe_update_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.load is None:
            raise ValueError(f"'{QUANT_METHOD}' loads through from_pretrained only: for a single file use "
                             "diffusers_nvfp4_fast.load_nvfp4_transformer (NVFP4) or quantize_transformer (BF16)")
        return self.load.take(self.model, state_dict)

    def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        load, self.load, self.model = self.load, None, None  # the model holds this quantizer: no cycle left
        load.finish(model)
        return model

    @property
    def supports_parallel_loading(self) -> bool:
        return False  # a layer's tensors may lie in two shards: they are collected in order

    @property
    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _run_pending_steps() -> None:
    """Steps that ``registration`` skipped because they came while this module was being imported."""
    if "diffusers.quantizers.auto" in sys.modules:
        register_quantizer()
    if PIPELINE_SAVE[0] in sys.modules:
        guard_pipeline_save()


READY = True
_run_pending_steps()
