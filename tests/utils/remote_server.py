"""A live `ferrum serve` subprocess on the shipped model, on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from ferrum.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME

API_KEY = "test-key"
REPO_ROOT = Path(__file__).resolve().parents[2]
# Small and fast on CPU: fp32 (bf16 matmuls are slow there), a 128-block pool.
# One torch thread: the tiny model gains nothing from more, and with other processes on the
# same cores, spinning OpenMP workers slow every small step down by orders of magnitude.
_SERVER_ENV = {"FERRUM_LOGGING_LEVEL": "INFO", "OMP_NUM_THREADS": "1"}
BASE_ARGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "128"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`ferrum serve` in a subprocess; its output goes to a log file (never a full pipe)."""

    def __init__(
        self,
        extra_args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        startup_timeout: float = 300.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        args = [
            sys.executable,
            "-m",
            "ferrum",
            "serve",
            DEFAULT_MODEL_DIR,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            DEFAULT_MODEL_NAME,
            *BASE_ARGS,
            *extra_args,
        ]
        if api_key:
            args += ["--api-key", api_key]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env={**os.environ, **_SERVER_ENV, **(env or {})},
        )
        try:
            self.wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy in {timeout} s:\n{self.log()}")

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            timeout=60,
            **kwargs,
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=60
        )

    def metrics(self) -> dict[str, float]:
        """Sample name (labels dropped) -> value, of the unlabelled-or-single-label samples."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name_part, value = line.rsplit(" ", 1)
            values[name_part.split("{")[0]] = float(value)
        return values

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        return self.process.returncode
