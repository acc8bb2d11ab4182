"""``examples/quality_vs_bf16.py``: PSNR / SSIM (Wang et al. 2004) of NVFP4 vs BF16 images, and its --tiny run."""

from __future__ import annotations

import math

import pytest
import quality_vs_bf16 as quality
import torch


def test_ssim_and_psnr_against_closed_forms():
    torch.manual_seed(0)
    x = torch.rand(3, 24, 24, dtype=torch.float64) * 255
    assert quality.ssim(x, x) == pytest.approx(1.0, abs=1e-12) and quality.psnr(x, x) == math.inf
    a, b = torch.full((3, 16, 16), 100.0), torch.full((3, 16, 16), 110.0)  # flat: only the luminance term is left
    c1 = (0.01 * 255) ** 2
    assert quality.ssim(a, b) == pytest.approx((2 * 100 * 110 + c1) / (100**2 + 110**2 + c1), rel=1e-12)
    assert quality.psnr(a, b) == pytest.approx(10 * math.log10(255**2 / 100), rel=1e-12)
    noisy = (x + torch.randn_like(x) * 20).clamp(0, 255)
    assert 0 < quality.ssim(x, noisy) < 1 and quality.ssim(x, noisy) == pytest.approx(quality.ssim(noisy, x))
    with pytest.raises(ValueError, match="at least 11x11"):
        quality.ssim(x[:, :8, :8], x[:, :8, :8])


def test_tiny_run_reports_psnr_and_ssim(capsys):
    result = quality.main(["--tiny", "--model", "flux2", "--prompts", "a dog is dancing", "--steps", "1"])
    assert len(result["images"]) == 1 and 0 < result["mean_ssim"] <= 1 and result["mean_psnr_db"] > 0
    assert "SSIM" in capsys.readouterr().out
