"""The Triton GEMM's configs shipped as data (``kernels/gemm_configs.json``, ``kernels/gemm_config_table.py``).

CPU: every shape class of FLUX.2-dev, FLUX.2-klein-4B and Qwen-Image (derived from their transformer configs on the
meta device) has an sm_90 entry; the sm_90 part is what ``benchmarks/tune_gemm_configs.py --seed-from`` derives from
the committed H200 result; every entry is a candidate and a bad one is refused by name; the launch looks up the key the
table is written under and times nothing (Triton's ``do_bench`` and autotuner raise), a missing entry taking the
default rule; the opt-in switch runs the autotuner. GPU (``gpu``): a real first call launches the shipped config and
times nothing. That no config changes a byte is tests/test_gemm.py's ``test_gpu_every_config_gives_the_same_bytes``.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed, so the GEMM config tests did not run; they "
                                               "run wherever Triton is installed, as in CI (pip install -e '.[test]')")
import tune_gemm_configs as tool  # noqa: E402
from triton.runtime import autotuner  # noqa: E402

from diffusers_nvfp4_fast import caches  # noqa: E402
from diffusers_nvfp4_fast.kernels import gemm_config_table as table  # noqa: E402
from diffusers_nvfp4_fast.kernels import quantize_nvfp4_triton  # noqa: E402
from support.gpus import skip_unless_sm80_to_sm90  # noqa: E402

gemm_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm")
CHOSEN = "kernels.nvfp4_gemm.chosen_configs"  # the launch's per-key cache (kernels/caches.py)
RESULTS = Path(tool.__file__).parent / "results" / "gemm-h200.json"


@pytest.fixture(scope="module")
def classes() -> dict:
    return tool.shape_classes()


def test_the_shape_classes_come_from_every_models_nvfp4_linears(classes):
    pairs = {(n, k) for _, _, n, k, _ in classes.values()}
    for model in tool.MODELS:
        nk = tool.model_nk(model)
        assert nk and nk <= pairs, model
    assert len(classes) == len(pairs) * len({table.m_bucket(m) for m in tool.SMALL_M + tool.LARGE_M}) == 110
    for key, (packed, bucket, n, k, m) in classes.items():
        assert key == table.table_key(packed, bucket, n, k) and table.m_bucket(m) == bucket
        assert packed == (m <= gemm_mod.PREDECODE_MAX_M)


def test_every_shape_class_of_the_three_models_has_an_sm90_entry(classes):
    sm90 = table.shipped_table()["sm_90"]
    assert set(classes) <= set(sm90), sorted(set(classes) - set(sm90))
    for key, (packed, bucket, n, k, _) in classes.items():
        config, source = sm90[key]
        assert table.shipped_config("sm_90", packed, bucket, n, k) == (config, source)
        if source == "default rule":
            assert config is table.default_config(packed, bucket), key


def test_the_sm90_part_is_derived_from_the_committed_h200_result(classes):
    """Reproducible: the tool's --seed-from on the committed result gives the shipped part, header included."""
    shipped = json.loads(table.CONFIGS_FILE.read_text())["architectures"]["sm_90"]
    assert tool.seed_part(RESULTS, classes) == shipped
    recorded = json.loads(RESULTS.read_text())
    assert shipped["measured_on"]["file"] == "benchmarks/results/gemm-h200.json"
    assert (shipped["measured_on"]["device"], shipped["measured_on"]["date"]) == (recorded["device"], recorded["date"])
    measured = [e for e in shipped["configs"].values() if e["source"] != "default rule"]
    assert len(measured) >= 2 * 9  # 9 (N, K) pairs of the result are model classes: M = 17, 1024 and 4608 each


def test_the_seed_parser_reads_bench_gemms_labels():
    assert tool._parse_config("BM256 BN128 BK64 w8 s5 Wregs") == {
        "BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 5, "W_IN_REGS": True}
    assert tool._parse_config("BM16 BN64 BK256 w4 s4")["W_IN_REGS"] is False


def test_the_table_parses_and_every_config_is_a_candidate():
    raw = json.loads(table.CONFIGS_FILE.read_text())
    assert tool.dumps(raw) == table.CONFIGS_FILE.read_text()  # the tool's own layout: one entry per line
    parsed = table.parse_table(raw, "shipped")
    assert set(parsed) == set(raw["architectures"]) and "sm_90" in parsed
    for arch, entries in parsed.items():
        assert set(entries) == set(raw["architectures"][arch]["configs"])
        for key, (config, source) in entries.items():
            assert any(config is c for c in table.gemm_configs(key.startswith("packed/"))), (arch, key)
            assert source


@pytest.mark.parametrize("change,message", [
    (lambda e: e.update(BLOCK_K=96), "'BLOCK_K': 96.*not a candidate config of the packed variant"),
    (lambda e: e.pop("num_stages"), "'num_stages': None.*not a candidate config of the packed variant"),
    (lambda e: e.update(W_IN_REGS=True), "'W_IN_REGS': True} is not a candidate config of the packed variant"),
])
def test_a_bad_entry_is_refused_naming_file_and_key(change, message):
    raw = json.loads(table.CONFIGS_FILE.read_text())
    change(raw["architectures"]["sm_90"]["configs"]["packed/32/6144/6144"])
    with pytest.raises(ValueError, match="my_table.json: architecture sm_90, key 'packed/32/6144/6144': .*" + message):
        table.parse_table(raw, "my_table.json")


def test_a_bad_key_is_refused_naming_it():
    raw = {"architectures": {"sm_89": {"configs": {"packed/32/6144": {}}}}}
    with pytest.raises(ValueError, match="t.json: architecture sm_89: bad key 'packed/32/6144'"):
        table.parse_table(raw, "t.json")


def test_the_default_rule_takes_the_first_of_the_tallest_tiles_the_bucket_keeps():
    for packed in (True, False):
        candidates = table.gemm_configs(packed)
        for bucket in (1 << i for i in range(14)):
            config = table.default_config(packed, bucket)
            fits = [c for c in candidates if c.kwargs["BLOCK_M"] <= max(16, bucket)]
            if fits:
                tallest = max(c.kwargs["BLOCK_M"] for c in fits)
                assert config is next(c for c in candidates if c.kwargs["BLOCK_M"] == tallest), (packed, bucket)
            else:
                assert config is min(candidates, key=lambda c: c.kwargs["BLOCK_M"]), (packed, bucket)
    assert table.default_config(True, 32).kwargs["BLOCK_M"] == 32
    assert table.default_config(False, 8192).kwargs == {**table.gemm_configs(False)[0].kwargs}


@pytest.fixture
def no_timing(monkeypatch):
    """Triton's timing and autotuner raise; a fresh launch cache; launches recorded instead of run."""
    def refuse(*args, **kwargs):
        raise AssertionError("timed on the user's machine")

    monkeypatch.setattr(triton.testing, "do_bench", refuse)
    monkeypatch.setattr(autotuner.Autotuner, "run", refuse)
    monkeypatch.setattr(autotuner.Autotuner, "_bench", refuse)
    caches.reset(CHOSEN)
    monkeypatch.delenv(gemm_mod.AUTOTUNE_VAR, raising=False)
    launched = []
    monkeypatch.setattr(gemm_mod, "launch_by_site", lambda kernel, grid, *args, **kw: launched.append((grid, kw)))
    return launched


def chosen() -> dict:
    return caches.registered()[CHOSEN].table


def _call(m: int, n: int, k: int, packed: bool):
    """The Triton kernel's arguments for an (M, N, K) call, built by the launch's own code on meta tensors."""
    meta = dict(device="meta", dtype=torch.uint8)
    xp, wp = torch.empty(m, k // 2, **meta), torch.empty(n, k // 2, **meta)
    xs = torch.empty(-(-m // 128) * 128, -(-k // 64) * 4, **meta)
    ws = torch.empty(-(-n // 128) * 128, -(-k // 64) * 4, **meta)
    x16 = None if packed else torch.empty(m, k, device="meta", dtype=torch.float16)
    alpha = torch.empty(1, device="meta", dtype=torch.float32)
    out = torch.empty(m, n, device="meta", dtype=torch.bfloat16)
    args, flags, grid, _, _ = gemm_mod._kernel_call(xp, xs, wp, ws, alpha, None, out, x16, not packed, None)
    return args, flags, grid


def _launched(kw: dict) -> dict:
    return {**{f: kw[f] for f in table.FIELDS}, "W_IN_REGS": bool(kw["W_IN_REGS"])}


def test_the_launch_looks_up_the_tables_key_and_times_nothing(classes, no_timing, monkeypatch):
    """Each class's config is launched for its M and for another M of its bucket: the key the launch builds from
    its arguments is the key the table is written under."""
    monkeypatch.setattr(gemm_mod, "gpu_arch", lambda device: "sm_90")
    sm90 = table.shipped_table()["sm_90"]
    for key, (packed, bucket, n, k, m) in classes.items():
        for rows in {m, bucket // 2 + 1 if bucket > 2 else bucket}:
            args, flags, grid = _call(rows, n, k, packed)
            gemm_mod._configured_launch(not packed, grid, args, flags)
            launched_grid, kw = no_timing[-1]
            assert _launched(kw) == table.config_fields(sm90[key][0]), (key, rows)
            assert launched_grid == grid(kw)
    assert len(chosen()) == len(classes)


def test_a_missing_entry_takes_the_default_rule_without_timing(no_timing, monkeypatch):
    monkeypatch.setattr(gemm_mod, "gpu_arch", lambda device: "sm_89")  # no sm_89 part is shipped
    assert "sm_89" not in table.shipped_table()
    rows = ((3, True), (17, True), (40, True), (300, False), (4608, False))
    for m, packed in rows:
        args, flags, grid = _call(m, 640, 1024, packed)
        gemm_mod._configured_launch(not packed, grid, args, flags)
        assert _launched(no_timing[-1][1]) == table.config_fields(table.default_config(packed, table.m_bucket(m)))
    assert len(no_timing) == len(chosen()) == len(rows)


def test_a_key_looks_its_config_up_once(no_timing, monkeypatch):
    monkeypatch.setattr(gemm_mod, "gpu_arch", lambda device: "sm_90")
    args, flags, grid = _call(17, 6144, 6144, True)
    gemm_mod._configured_launch(False, grid, args, flags)

    def refuse(*a, **kw):
        raise AssertionError("looked up again")

    monkeypatch.setattr(gemm_mod, "shipped_config", refuse)
    monkeypatch.setattr(gemm_mod, "gpu_arch", refuse)
    gemm_mod._configured_launch(False, grid, args, flags)
    assert no_timing[0] == no_timing[1]


def test_the_autotune_switch_times_the_candidates_at_the_first_call(no_timing, monkeypatch):
    calls = []
    best = table.gemm_configs(True)[2]

    class FakeTuned:
        best_config = best

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, kwargs))

    monkeypatch.setattr(gemm_mod, "_tuned_packed", FakeTuned())
    monkeypatch.setenv(gemm_mod.AUTOTUNE_VAR, "1")
    args, flags, grid = _call(17, 6144, 6144, True)
    gemm_mod._configured_launch(False, grid, args, flags)
    assert len(calls) == 1 and not no_timing and list(chosen().values()) == [best]
    gemm_mod._configured_launch(False, grid, args, flags)  # later calls: the chosen config, by site key
    assert len(calls) == 1 and no_timing[0][1]["BLOCK_K"] == best.kwargs["BLOCK_K"] == 256


# ---------------------------------------------------------------------------------------------------------------
# GPU.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(17, 3072, 3072), (48, 27648, 3072), (4608, 3072, 12288)])
def test_gpu_first_call_launches_the_shipped_config_and_times_nothing(m, n, k, monkeypatch):
    """A real first call of a model's shape class (Triton kernel forced; on SM90 M > 64 runs the Gluon kernel
    otherwise): nothing timed, the class's config launched, the bytes of that config run directly."""
    skip_unless_sm80_to_sm90("the shipped-config launch")
    def refuse(*args, **kwargs):
        raise AssertionError("timed on the user's machine")

    monkeypatch.setattr(triton.testing, "do_bench", refuse)
    caches.reset(CHOSEN)
    monkeypatch.delenv(gemm_mod.AUTOTUNE_VAR, raising=False)
    gen = torch.Generator(device="cuda").manual_seed(m)
    xp, xs = quantize_nvfp4_triton(torch.randn(m, k, device="cuda", generator=gen).bfloat16(),
                                   torch.tensor([400.0], device="cuda"))
    wp, ws = quantize_nvfp4_triton(torch.randn(n, k, device="cuda", generator=gen).bfloat16() * 0.02,
                                   torch.tensor([9e4], device="cuda"))
    alpha = torch.tensor(1e-7, device="cuda")
    packed = m <= gemm_mod.PREDECODE_MAX_M
    out = gemm_mod.nvfp4_gemm(xp, xs, wp, ws, alpha, kernel="triton")
    config = gemm_mod.launch_config(packed, m, n, k, xp.device)
    assert list(chosen().values()) == [config]
    assert torch.equal(out, gemm_mod.nvfp4_gemm(xp, xs, wp, ws, alpha, kernel="triton", config=config))
    assert torch.equal(out, gemm_mod.nvfp4_gemm(xp, xs, wp, ws, alpha, kernel="triton"))  # the keyed repeat
