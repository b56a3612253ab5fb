"""Executors: how the engine core reaches its model runner(s) (`abstract.py` has the contract)."""

from __future__ import annotations

from ferrum.config import EngineConfig
from ferrum.executor.abstract import Executor, WorkerDiedError, WorkerStepError


def create_executor(config: EngineConfig) -> Executor:
    """The executor `config.parallel_config.distributed_executor_backend` names."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "uni":
        from ferrum.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    if backend == "mp":
        from ferrum.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from ferrum.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    raise ValueError(f"distributed_executor_backend: {backend!r} is not supported yet")


__all__ = ["Executor", "WorkerDiedError", "WorkerStepError", "create_executor"]
