"""The readable form of ``fast_path_report``: still the dict it always was, printed as a table per site.

Every line is grouped under the site kind that was installed (``sites``), so one name is used everywhere: the
FLUX.2 single-stream site ``flux2_token_cat`` counts its calls with SwiGLU folded in (``flux2_token_cat_swiglu``)
under the same heading, and its fallbacks under that heading too.
"""

from __future__ import annotations

import re

# fused-call / fallback kinds that belong to another installed site
SITE_OF = {"flux2_token_cat_swiglu": "flux2_token_cat"}
_INDEXED = re.compile(r"^(.*?\.)(\d+)(\..*|\s.*|)$")


def _ranges(indices: list[int]) -> str:
    out, start, prev = [], indices[0], indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def compact_names(names: list[str]) -> str:
    """``transformer_blocks.0.attn, transformer_blocks.1.attn`` -> ``transformer_blocks.[0-1].attn``."""
    groups: dict[tuple[str, str], list[int]] = {}
    plain = []
    for name in names:
        m = _INDEXED.match(name)
        if m is None:
            plain.append(name)
        else:
            groups.setdefault((m.group(1), m.group(3)), []).append(int(m.group(2)))
    parts = [f"{head}[{_ranges(sorted(set(ix)))}]{tail}" if len(ix) > 1 else f"{head}{ix[0]}{tail}"
             for (head, tail), ix in groups.items()]
    return ", ".join(parts + plain)


def _site_lines(entry: dict) -> list[str]:
    modules = entry.get("site_modules", {})
    kinds = list(dict.fromkeys([*entry.get("sites", {}), *(SITE_OF.get(k, k) for k in entry.get("fused_calls", {})),
                                *(SITE_OF.get(k.split(": ", 1)[0], k.split(": ", 1)[0])
                                  for k in entry.get("fallbacks", {}))]))
    lines = []
    for site in kinds:
        n = entry.get("sites", {}).get(site, 0)
        where = compact_names(modules.get(site, []))
        lines.append(f"  {site}: {n} site(s)" + (f" on {where}" if where else ""))
        calls = {k: v for k, v in entry.get("fused_calls", {}).items() if SITE_OF.get(k, k) == site}
        if calls:
            detail = "" if list(calls) == [site] else " (" + ", ".join(f"{k} {v}" for k, v in calls.items()) + ")"
            lines.append(f"    fused: {sum(calls.values())} call(s){detail}")
        for key, count in entry.get("fallbacks", {}).items():
            kind, reason = key.split(": ", 1)
            if SITE_OF.get(kind, kind) == site:
                label = "" if kind == site else f" [{kind}]"
                lines.append(f"    fell back{label}: {reason} ({count})")
    return lines


def format_entry(name: str, entry: dict) -> str:
    """One transformer's report as lines of text."""
    if not entry.get("enabled"):
        return f"{name}: fast paths off ({entry.get('nvfp4_linears', 0)} NVFP4 linears)"
    if not entry.get("fused", True):
        fused = "fused paths off (fused=False)"
    elif not entry.get("fused_paths", True):
        fused = f"no fused paths for {name}: NVFP4 GEMMs only"
    else:
        fused = "fused paths on"
    lines = [f"{name}: fast paths on, {fused}, {entry['nvfp4_linears']} NVFP4 linears, GEMM backend "
             f"{entry.get('gemm_backend')}, verify {entry.get('verify')!r}"]
    if entry.get("converted"):
        lines.append("  converted: " + ", ".join(f"{n} from {src}" for src, n in entry["converted"].items()))
    lines += _site_lines(entry)
    v = entry.get("verifications", {})
    lines.append(f"  verifications: {v.get('passed', 0)} passed, {v.get('failed', 0)} failed")
    if "preparation" in entry:
        lines.append("  preparation: " + preparation_line(entry["preparation"]))
    return "\n".join(lines)


def preparation_line(prep: dict) -> str:
    """``fast_path_report``'s ``preparation`` in words: the Triton cache state, kernels compiled of kernels, seconds."""
    if prep["cache"] == "unknown":
        return f"Triton cache unknown ({prep['reason']})"
    total = prep["compiled"] + prep["from_cache"]
    if prep["cache"] == "warm":
        line = f"Triton cache warm, {total} kernel(s) loaded from it in {prep['seconds']:.1f} s"
    else:
        line = (f"Triton cache cold, {prep['compiled']} of {total} kernel(s) compiled, {prep['seconds']:.1f} s "
                f"(once per machine; first {prep['calls']} call(s))")
    parallel = prep.get("parallel") or {}
    if parallel.get("ran"):
        return line + f"; side by side before the first call: {parallel['kernels']} in {parallel['seconds']:.1f} s"
    return line + (f"; one by one: {parallel['reason']}" if parallel.get("reason") else "")


class FastPathReport(dict):
    """``fast_path_report``'s dict (transformer class name -> entry), which prints as a readable report: per site
    kind, the modules it is installed on, its fused calls, and each fallback with its reason and count."""

    def __str__(self) -> str:
        return "\n".join(format_entry(name, entry) for name, entry in self.items())
