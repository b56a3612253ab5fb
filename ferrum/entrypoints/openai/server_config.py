"""How `ferrum serve` listens and logs, with vLLM's flag names: TLS, the root path behind a proxy,
the request log switches. uvicorn's logs (its access log included) go to standard error, as
ferrum's do."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

from ferrum.config_fields import field_error as _fail
from ferrum.config_fields import field_help as _help


@dataclass(frozen=True)
class ServerConfig:
    root_path: str = field(
        default="",
        metadata=_help(
            "path prefix the server is reached under behind a proxy (FastAPI's root_path); "
            "routes answer with and without it"
        ),
    )
    ssl_keyfile: str | None = field(default=None, metadata=_help("TLS private key file (PEM)"))
    ssl_certfile: str | None = field(
        default=None, metadata=_help("TLS certificate file (PEM); with --ssl-keyfile: HTTPS")
    )
    ssl_ca_certs: str | None = field(
        default=None, metadata=_help("CA certificates (PEM) that check client certificates")
    )
    ssl_cert_reqs: int = field(
        default=0,
        metadata=_help(
            "client certificates (Python's ssl.CERT_*): 0 none asked for, 1 optional, 2 required "
            "(needs --ssl-ca-certs)"
        ),
    )
    enable_log_requests: bool = field(
        default=False,
        metadata=_help("log each request as it arrives (endpoint, model, sampling fields)"),
    )
    disable_log_requests: bool = field(
        default=False,
        metadata=_help("vLLM's (deprecated): requests are not logged unless --enable-log-requests"),
    )
    max_log_len: int | None = field(
        default=None,
        metadata=_help("most characters of a request's body in its log line (default: all)"),
    )
    disable_uvicorn_access_log: bool = field(
        default=False, metadata=_help("no uvicorn access log line per HTTP request")
    )

    def __post_init__(self) -> None:
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise _fail(
                "root_path", f"must start with '/' and not end with one, got {self.root_path!r}"
            )
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise _fail("ssl_keyfile", "--ssl-keyfile and --ssl-certfile go together")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise _fail("ssl_cert_reqs", f"must be 0, 1 or 2, got {self.ssl_cert_reqs!r}")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise _fail("ssl_cert_reqs", "checking client certificates needs --ssl-ca-certs")
        if self.ssl_ca_certs is not None and not self.ssl_cert_reqs:
            raise _fail(
                "ssl_ca_certs",
                "has no effect unless --ssl-cert-reqs asks for client certificates (1 or 2)",
            )
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise _fail(name, f"{path!r} is not a file")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise _fail("max_log_len", f"must be >= 0, got {self.max_log_len}")
        if self.enable_log_requests and self.disable_log_requests:
            raise _fail("disable_log_requests", "contradicts --enable-log-requests")

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """uvicorn.Config's TLS and logging arguments."""
        return {
            "ssl_keyfile": self.ssl_keyfile,
            "ssl_certfile": self.ssl_certfile,
            "ssl_ca_certs": self.ssl_ca_certs,
            "ssl_cert_reqs": self.ssl_cert_reqs,
            "access_log": not self.disable_uvicorn_access_log,
            "log_config": uvicorn_log_config(),
        }

    def startup_notes(self) -> list[str]:
        """One line per accepted flag that changes nothing."""
        if self.disable_log_requests:
            return [
                "disable_log_requests: has no effect: requests are not logged unless "
                "--enable-log-requests"
            ]
        return []


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's own logging config with its access log on standard error (not standard output):
    every server log line in one stream, as ferrum's."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config
