"""SIGTERM and SIGINT: in-flight streams end (finish_reason "abort"), the server exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from ferrum.default_model import DEFAULT_MODEL_NAME
from tests.utils.remote_server import RemoteServer


def _stream_until_end(server: RemoteServer, first_chunk: threading.Event, out: list[str]) -> None:
    body = {
        "model": DEFAULT_MODEL_NAME,
        "prompt": "Keep going",
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            first_chunk.set()
            if line == "data: [DONE]":
                out.append("[DONE]")
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["finish_reason"]:
                out.append(choices[0]["finish_reason"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_aborts_in_flight_and_exits_zero(tmp_path: Path, sig: int) -> None:
    server = RemoteServer(["--max-model-len", "1024"], tmp_path / "server.log")
    try:
        first_chunk = threading.Event()
        ends: list[str] = []
        thread = threading.Thread(target=_stream_until_end, args=(server, first_chunk, ends))
        thread.start()
        assert first_chunk.wait(30)
        started = time.monotonic()
        code = server.stop(sig, timeout=30)
        thread.join(30)
        assert code == 0, server.log()
        assert time.monotonic() - started < 20
        assert ends == ["abort", "[DONE]"]
        assert "aborting 1 in-flight request(s)" in server.log()
    finally:
        server.stop(signal.SIGKILL)
