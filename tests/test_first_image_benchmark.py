"""``benchmarks/bench_first_image.py``'s result file: a run replaces its own models' cases and keeps the rest."""

import bench_first_image as bench


def test_a_run_keeps_other_models_cases_and_the_files_notes():
    """The notes written beside a run (the same cases measured on another host of the same kind) were lost when a
    later run of the benchmark rewrote the file."""
    before = {"date": "2026-12-01", "notes": {"klein-4B, another H100": "cold 6.16 s"},
              "cases": [{"model": "qwen-image", "cache": "cold", "first_image_s": 17.2},
                        {"model": "flux2-klein-4b", "cache": "cold", "first_image_s": 7.7}]}
    header = {"benchmark": "first_image", "date": "2026-12-06"}
    run = [{"model": "flux2-klein-4b", "cache": "cold", "first_image_s": 7.6}]
    merged = bench.merge(before, header, run, wall_s=12.34)
    assert merged["notes"] == {"klein-4B, another H100": "cold 6.16 s"}
    assert merged["cases"] == [{"date": "2026-12-01", "model": "qwen-image", "cache": "cold", "first_image_s": 17.2},
                               {"model": "flux2-klein-4b", "cache": "cold", "first_image_s": 7.6,
                                "date": "2026-12-06"}]
    assert merged["wall_s"] == 12.3 and merged["date"] == "2026-12-06"
    assert "notes" not in bench.merge({}, header, run, wall_s=1.0)
