"""`ferrum serve`'s TLS, root path and log flags, as a validated ServerConfig."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ferrum.engine.arg_utils import add_config_args, config_from_args
from ferrum.entrypoints.openai.api_key import check_api_key, route_path
from ferrum.entrypoints.openai.server_config import ServerConfig, uvicorn_log_config
from ferrum.errors import FieldError


def _parse(argv: list[str]) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_config_args(parser, ServerConfig)
    return config_from_args(ServerConfig, parser.parse_args(argv))


def test_flags_build_the_config(tmp_path: Path) -> None:
    assert _parse([]) == ServerConfig()
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("k")
    cert.write_text("c")
    config = _parse(
        ["--root-path", "/api", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
        + ["--enable-log-requests", "--disable-uvicorn-access-log"]
    )
    assert (config.root_path, config.scheme, config.enable_log_requests) == ("/api", "https", True)
    kwargs = config.uvicorn_kwargs()
    assert (kwargs["ssl_keyfile"], kwargs["ssl_certfile"]) == (str(key), str(cert))
    assert kwargs["access_log"] is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--root-path", "api"], "root_path: must start with '/'"),
        (["--ssl-keyfile", __file__], "ssl_keyfile: --ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-keyfile", "/no/key", "--ssl-certfile", __file__], "ssl_keyfile: '/no/key' is not"),
        (["--enable-log-requests", "--disable-log-requests"], "disable_log_requests: contradicts"),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(FieldError, match=message):
        _parse(argv)


def test_disable_log_requests_is_a_no_op_that_says_so() -> None:
    assert _parse([]).startup_notes() == []
    (note,) = _parse(["--disable-log-requests"]).startup_notes()
    assert note.startswith("disable_log_requests: has no effect")


def test_uvicorn_access_log_goes_to_standard_error() -> None:
    config = uvicorn_log_config()
    assert {h["stream"] for h in config["handlers"].values()} == {"ext://sys.stderr"}


def test_api_key_check_and_route_path() -> None:
    assert check_api_key(None) is None and check_api_key("k") == "k"
    with pytest.raises(ValueError, match="api_key: --api-key is empty"):
        check_api_key(" ")
    assert route_path({"path": "/api/health", "root_path": "/api"}) == "/health"
    assert route_path({"path": "/health", "root_path": "/api"}) == "/health"
    assert route_path({"path": "/v1/models"}) == "/v1/models"


def test_client_certificates_need_both_flags(tmp_path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    with pytest.raises(ValueError, match="ssl_ca_certs: has no effect unless --ssl-cert-reqs"):
        ServerConfig(ssl_ca_certs=str(ca))
    with pytest.raises(ValueError, match="ssl_cert_reqs: checking client certificates needs"):
        ServerConfig(ssl_cert_reqs=2)
    config = ServerConfig(ssl_ca_certs=str(ca), ssl_cert_reqs=2)
    assert config.uvicorn_kwargs()["ssl_cert_reqs"] == 2
