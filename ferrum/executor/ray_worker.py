"""One tensor-parallel rank as a Ray actor, serving the same messages with the same `RankServer` as
a worker process (`rank.py`), through the executor's compiled Ray graph. `wait_for_failure` runs
in its own concurrency group, so a rank's exception reaches the executor even while another rank
blocks in a collective (and the graph's outputs never arrive)."""

from __future__ import annotations

import socket
import threading
import traceback

import torch

from ferrum import envs
from ferrum.config import EngineConfig
from ferrum.executor.messages import FromWorker, ToWorker, WorkerReady
from ferrum.executor.rank import RankServer, start_rank

# The actors' concurrency group in which `wait_for_failure` waits (the graph runs in the default).
MONITOR_GROUP = "monitor"


class RayWorker:
    def __init__(self, config: EngineConfig, rank: int) -> None:
        # Nothing here touches CUDA: `start` may narrow CUDA_VISIBLE_DEVICES first.
        self.config = config
        self.rank = rank
        self._server: RankServer | None = None
        self._failed = threading.Event()
        self._error = ""

    def placement(self) -> tuple[str, list[str]]:
        """This actor's Ray node id and the GPU ids Ray gave it (none on the CPU)."""
        import ray

        context = ray.get_runtime_context()
        return context.get_node_id(), [str(i) for i in context.get_accelerator_ids()["GPU"]]

    def rendezvous_address(self) -> str:
        """`tcp://IP:PORT` with this node's IP and a port free on it now: rank 0's answer is
        every rank's torch.distributed `init_method`."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        host = f"[{ip}]" if ":" in ip else ip
        return f"tcp://{host}:{port}"

    def start(
        self,
        visible_devices: str | None,
        device_index: int,
        world_size: int,
        init_method: str,
        backend: str,
    ) -> WorkerReady:
        """Joins the process group and builds the rank's runner. On CUDA every rank of a node
        sees the node's GPUs of the group (`visible_devices`) and runs on `device_index`."""
        try:
            if visible_devices is not None:
                envs.set_variable("CUDA_VISIBLE_DEVICES", visible_devices)
                device = torch.device("cuda", device_index)
            else:
                device = torch.device(self.config.device_config.device)
            runner = start_rank(self.config, device, self.rank, world_size, init_method, backend)
        except BaseException as e:
            self._record_failure(e)
            raise
        self._server = RankServer(runner, self.rank)
        return WorkerReady(self.rank, runner.kernel_backend)

    def execute(self, messages: list[ToWorker]) -> FromWorker | None:
        """Handles `messages` in order; returns the last one's reply."""
        assert self._server is not None, "execute before start"
        reply = None
        try:
            for message in messages:
                reply = self._server.handle(message)
        except BaseException as e:
            self._record_failure(e)
            raise
        return reply

    def wait_for_failure(self) -> str:
        """Blocks until a call of this actor raised; returns the exception with its traceback."""
        self._failed.wait()
        return self._error

    def _record_failure(self, error: BaseException) -> None:
        if not self._failed.is_set():
            self._error = "".join(traceback.format_exception(error)).rstrip()
            self._failed.set()
