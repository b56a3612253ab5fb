"""Injected failures for the engine's recovery paths."""

from __future__ import annotations

import pytest
from torch import nn


def fail_forward(monkeypatch: pytest.MonkeyPatch, model: nn.Module, at_call: int) -> None:
    """Makes the model's `at_call`-th forward raise RuntimeError("injected fault")."""
    calls = {"n": 0}
    real_forward = model.forward

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise RuntimeError("injected fault")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", failing_forward)
