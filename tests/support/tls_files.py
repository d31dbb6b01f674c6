"""Certificates and exporter-toolkit web configuration files for tests on loopback.

One CA (trustme, which issues with `cryptography`) signs a server certificate for 127.0.0.1 and
localhost and a client certificate; the files are PEM, as Prometheus, Alertmanager, curl and the
agent read them. `write_web_config` writes the YAML that prometheus/exporter-toolkit reads
(https://github.com/prometheus/exporter-toolkit/blob/master/docs/web-configuration.md): the same
file node_exporter, Alertmanager's --web.config.file and the agent's --web-config-file accept.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import bcrypt
import trustme
import yaml

# bcrypt's cost: exporter-toolkit checks every request's password against its hash, so tests use
# the lowest cost bcrypt accepts (4) to keep a scrape fast; real files use 10 or more.
TEST_BCRYPT_ROUNDS = 4


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    authority = trustme.CA()
    server = authority.issue_cert("127.0.0.1", "localhost", "::1")
    client = authority.issue_cert("client@hybridmon.test", common_name="hybridmon-test-client")
    files = TlsFiles(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem", server_key=directory / "server-key.pem",
        client_cert=directory / "client.pem", client_key=directory / "client-key.pem",
    )
    authority.cert_pem.write_to_path(str(files.ca))
    server.cert_chain_pems[0].write_to_path(str(files.server_cert))
    server.private_key_pem.write_to_path(str(files.server_key))
    client.cert_chain_pems[0].write_to_path(str(files.client_cert))
    client.private_key_pem.write_to_path(str(files.client_key))
    return files


def bcrypt_hash(password: str, rounds: int = TEST_BCRYPT_ROUNDS) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds)).decode()


def write_web_config(path: Path, *, tls: TlsFiles | None = None, users: dict[str, str] | None = None,
                     client_auth_type: str | None = None, min_version: str | None = None) -> Path:
    """An exporter-toolkit web config: TLS from `tls`, basic auth for `users` (name -> password)."""
    config: dict = {}
    if tls is not None:
        server = {"cert_file": str(tls.server_cert), "key_file": str(tls.server_key)}
        if client_auth_type is not None:
            server["client_auth_type"] = client_auth_type
            server["client_ca_file"] = str(tls.ca)
        if min_version is not None:
            server["min_version"] = min_version
        config["tls_server_config"] = server
    if users:
        config["basic_auth_users"] = {name: bcrypt_hash(password) for name, password in users.items()}
    path.write_text(yaml.safe_dump(config))
    return path
