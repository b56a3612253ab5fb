"""The API server's process never loads torch: importing the server module does not, and neither
does serving a request, whose engine core (a process of its own) does. Structured outputs are
the one exception: xgrammar, which checks grammars in the API process, imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils.remote_server import DEFAULT_MODEL_NAME, RemoteServer

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc")


def _loads_torch(pid: int) -> bool:
    """Whether the process has torch's C++ library mapped (it is, once torch is imported)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_importing_the_server_imports_no_torch() -> None:
    code = "import sys, ferrum.entrypoints.openai.server; print(sorted(sys.modules))"
    modules = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "'torch'" not in modules and "'ferrum.entrypoints.openai.server'" in modules


def test_serving_requests_loads_torch_only_in_the_core(tmp_path: Path) -> None:
    # A server of its own: the shared one has served structured outputs.
    server = RemoteServer(["--max-model-len", "256"], tmp_path / "server.log")
    try:
        client = server.client()
        reply = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=4)
        chat = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            stream=True,
        )
        assert reply.choices[0].text is not None and list(chat)
        assert not _loads_torch(server.process.pid)
        # The check can fail: the engine core process, the server's child, has torch loaded.
        assert any(_loads_torch(child) for child in _children(server.process.pid))
    finally:
        assert server.stop() == 0, server.log()
