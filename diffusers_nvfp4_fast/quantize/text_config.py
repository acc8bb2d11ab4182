"""The configuration files of a text-encoder export, as ModelOpt 0.47's ``export_hf_checkpoint`` writes them for a
transformers model quantized with ``NVFP4_DEFAULT_CFG``: ``config.json``'s ``quantization_config`` and
``hf_quant_config.json``, whose ``ignore`` / ``exclude_modules`` list the modules that carry a ModelOpt quantizer
(Linear, Embedding, Conv, BatchNorm) but are not quantized, summarised with prefix wildcards.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch import nn

from ..loaders.common import producer

MODELOPT_VERSION_WRITTEN = "0.47.0"  # the ModelOpt export these files follow
QUANTIZER_CARRIERS = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
                      nn.ConvTranspose2d, nn.ConvTranspose3d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _candidates(name: str) -> Iterator[tuple[str, ...]]:
    """Wildcard choices for one name, widest first: at each dot ``prefix*``, then ``{prefix, prefix.*}``; at last
    the name itself."""
    for i, char in enumerate(name):
        if char == ".":
            yield (name[:i] + "*",)
            yield (name[:i], name[:i] + ".*")
    yield (name,)


def summarize_ignore(unquantized: Iterable[str], quantized: Sequence[str]) -> list[str]:
    """The exclude list ModelOpt's export writes (``quant_utils._prefix_wildcard_summarize_exclude_modules``,
    modelopt 0.47; re-implemented here from its documented behaviour): for each unquantized module, the widest
    prefix wildcard at a dot that matches no quantized module; a ``{prefix, prefix.*}`` pair is written as
    ``prefix.*``."""
    exact = set(quantized)

    def blocked(wildcard: str) -> bool:
        if wildcard.endswith("*"):
            return any(q.startswith(wildcard[:-1]) for q in quantized)
        return wildcard in exact

    out: set[str] = set()
    for name in unquantized:
        for choice in _candidates(name):
            if any(blocked(w) for w in choice):
                continue
            if not all(w in out for w in choice):
                out.add(choice[-1])
            break
    return sorted(out)


def unquantized_carriers(skeleton: nn.Module, quantized: set[str]) -> list[str]:
    """In-memory names of the modules ModelOpt gives quantizers to that stay unquantized."""
    return [n for n, m in skeleton.named_modules() if isinstance(m, QUANTIZER_CARRIERS) and n not in quantized]


def export_configs(ignore: list[str], dynamic: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``config.json``'s ``quantization_config``, ``hf_quant_config.json``) for an NVFP4 export. ``dynamic``: the
    activation scales are computed per call (this package's ``--dynamic``; ModelOpt writes ``false``)."""
    group = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    qconfig = {
        "config_groups": {"group_0": {"input_activations": {**group, "dynamic": dynamic}, "weights": group,
                                      "targets": ["Linear"]}},
        "ignore": ignore, "quant_algo": "NVFP4", "producer": producer(), "quant_method": "modelopt",
    }
    hf_quant = {"producer": producer(), "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                                       "group_size": 16, "exclude_modules": ignore}}
    return qconfig, hf_quant
