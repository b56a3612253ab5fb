"""Schema fuzzing of the live server's /openapi.json with every schemathesis check: no 5xx, every
response matches the schema, schema-valid requests are accepted and invalid ones rejected."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.utils.remote_server import RemoteServer


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    # A 32-token context keeps every generated request short.
    log: Path = tmp_path_factory.mktemp("fuzz") / "server.log"
    remote = RemoteServer(["--max-model-len", "32", "--uvicorn-log-level", "warning"], log)
    yield remote
    assert remote.stop() == 0, remote.log()


# Cases per operation and generation mode: a few hundred requests in all (a GET without
# parameters has a single case).
MAX_EXAMPLES = 40
MAX_FUZZ_N = 4

# 400s for limits a JSON schema cannot state: they depend on the model (context length), compare
# fields (min_tokens <= max_tokens, a named tool among the tools) or need a compiler (a regex, a
# grammar). A schema-valid request may get these; any other 400 on one means the schema and the
# validation disagree (token ids are bounded by the vocabulary in the published schema).
MODEL_LIMITS = re.compile(
    "|".join(
        (
            r"max_model_len",
            r": invalid (JSON schema|JSON object grammar|regex|choice|EBNF grammar|structural tag)",
            r"leaves no room for output",
            r"must be <= max_tokens",
            r"SamplingParams\.seed",
            r"completions exceeds the limit",
            r"must equal n",
            r"not in tools",
            r"chat template",
            r"chat_template",
            r"prompt is empty|empty prompt",
            r"needs a server started with",
            r"is not supported yet",
        )
    )
)


def positive_data_acceptance_beyond_model_limits(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> bool | None:
    """The built-in check, except for a 400 whose message names a model limit."""
    if response.status_code == 400:
        message = response.json().get("error", {}).get("message", "")
        if MODEL_LIMITS.search(message):
            return None
    return positive_data_acceptance(ctx, response, case)


def fuzz_operation(
    operation: schemathesis.APIOperation, mode: GenerationMode, statuses: list[int]
) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def check(case: schemathesis.Case) -> None:
        if isinstance(case.body, dict) and type(case.body.get("n")) is int:
            # Bounded time: n up to 128 is valid but slow on CPU; the shape is the same.
            case.body["n"] = min(case.body["n"], MAX_FUZZ_N)
        seed = case.body.get("seed") if isinstance(case.body, dict) else None
        if type(seed) is int and -(2**63) <= seed < 2**63:
            # Integers beyond 2**53 reach the wire as rounded doubles (out of the int64 range);
            # seeds outside int64 stay as they are (invalid data must stay invalid).
            case.body["seed"] = max(-(2**53), min(seed, 2**53))
        response = case.call_and_validate(
            timeout=60,
            excluded_checks=[positive_data_acceptance],
            additional_checks=[positive_data_acceptance_beyond_model_limits],
        )
        statuses.append(response.status_code)

    check()


def test_openapi_schema(fuzz_server: RemoteServer) -> None:
    # Each operation's cases are driven here (schemathesis' lazy pytest loader does not run on
    # this pytest). Every check runs; valid data must be accepted, invalid data rejected.
    api_schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8
    statuses: dict[GenerationMode, list[int]] = {mode: [] for mode in GenerationMode}
    for operation in operations:
        # Operations without parameters (GET /health, ...) have no invalid request to send.
        has_input = operation.method.upper() == "POST"
        for mode in GenerationMode if has_input else [GenerationMode.POSITIVE]:
            fuzz_operation(operation, mode, statuses[mode])
    positive, negative = statuses[GenerationMode.POSITIVE], statuses[GenerationMode.NEGATIVE]
    assert len(positive) >= 150 and len(negative) >= 100
    # Generation ran, not only the error paths.
    assert positive.count(200) >= 20
    assert all(400 <= status < 500 for status in negative if status != 200)
    # Still healthy after the fuzzing.
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
