"""Schema fuzzing of the live server's /openapi.json: no 5xx, every response matches the schema."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.utils.remote_server import RemoteServer


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    # A 32-token context keeps every generated request short.
    log: Path = tmp_path_factory.mktemp("fuzz") / "server.log"
    remote = RemoteServer(["--max-model-len", "32", "--uvicorn-log-level", "warning"], log)
    yield remote
    assert remote.stop() == 0, remote.log()


# Cases per operation: the four POST operations make a few hundred requests (a GET without
# parameters has a single case).
MAX_EXAMPLES = 60
MAX_FUZZ_N = 4
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def test_openapi_schema(fuzz_server: RemoteServer) -> None:
    # Each operation's cases are driven here (schemathesis' lazy pytest loader does not run on
    # this pytest).
    api_schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8
    statuses: list[int] = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(case: schemathesis.Case) -> None:
            if isinstance(case.body, dict) and isinstance(case.body.get("n"), int):
                # Bounded time: n up to 128 is valid but slow on CPU; the shape is the same.
                case.body["n"] = min(case.body["n"], MAX_FUZZ_N)
            statuses.append(case.call_and_validate(timeout=60, checks=CHECKS).status_code)

        check()
    assert len(statuses) >= 200
    # Generation ran, not only the error paths.
    assert statuses.count(200) >= 20
    # Still healthy after the fuzzing.
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
