import json

import pytest
import torch

from ferrum import envs
from ferrum.executor.step_profiler import StepProfiler


@pytest.mark.parametrize("value", ["", "x:2:/tmp", "0:2:/tmp", "2:0:/tmp", "2:3:", "2"])
def test_malformed_window_disables_profiling(monkeypatch, value: str) -> None:
    monkeypatch.setenv("FERRUM_DEBUG_PROFILE_STEPS", value)
    assert envs.debug_profile_steps() is None


def test_profiles_exactly_the_window_and_writes_both_files(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FERRUM_DEBUG_PROFILE_STEPS", f"2:2:{tmp_path}")
    profiler = StepProfiler(rank=1)
    recording = []
    for _ in range(5):
        profiler.before_step()
        recording.append(profiler._profile is not None)
        torch.ones(8) @ torch.ones(8)
        profiler.after_step()
    assert recording == [False, True, True, False, False]
    summary = json.loads((tmp_path / "rank1.json").read_text())
    assert summary["rank"] == 1 and summary["steps"] == 2
    assert "aten::" in (tmp_path / "rank1.txt").read_text()
