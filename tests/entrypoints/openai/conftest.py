"""Fixtures of the server tests: one shared live server for the package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.utils.remote_server import API_KEY, RemoteServer


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    """The shared server: API key required, 512-token context, async scheduling (the default
    with CUDA) so the server tests run the engine core as GPU users get it; JSON grammars
    compact (the default)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--max-model-len", "512", "--async-scheduling"]
    remote = RemoteServer(args, log, api_key=API_KEY)
    yield remote
    code = remote.stop()
    assert code == 0, remote.log()
