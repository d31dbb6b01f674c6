"""The credentials and TLS settings of the pushes to Alertmanager ([alerting.http_config]), read
from files, and read again when a file changes.

Prometheus's alertmanager_config reads password_file and credentials_file on every request, their
content trimmed of surrounding whitespace, and rebuilds its TLS transport when the CA, certificate
or key file's content changes (prometheus/common config/http_config.go: FileSecret.Fetch,
tlsRoundTripper.RoundTrip). Here each push costs one os.stat per file: it follows symlinks, so the
atomic swap of a Kubernetes Secret volume's `..data` symlink shows as another inode, and only a
file whose (device, inode, size, mtime) changed is read again.

At start (PushCredentials()) a file that cannot be read or used is a ConfigError naming its key;
later it fails that push only (CredentialsUnreadable, counted under reason "credentials"), the
alerts stay queued and the next push reads the files again.

No secret leaves this module but in the Authorization header: messages name the key and the path,
never the content, and repr() shows neither password nor token.
"""
from __future__ import annotations

import base64
import os
import ssl

from hybridmon.agent.config import HTTP_CONFIG_KEY, ConfigError, HttpConfig

# A secret file is a password or a token; a larger one is the wrong file (or a device that never
# ends), and reading on would only fill memory.
MAX_SECRET_FILE_BYTES = 64 * 1024
# tls_config.min_version as Prometheus names the versions, and as Python's ssl does.
SSL_MIN_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                    "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}


class CredentialsUnreadable(Exception):
    """A credentials or TLS file cannot be read or used; the message names its key and path."""


class PushCredentials:
    """The Authorization header and TLS context for [alerting.http_config], current as of the last
    refresh(). One per AlertmanagerPusher, used from its event loop's thread only."""

    def __init__(self, http_config: HttpConfig) -> None:
        self.config = http_config
        tls = http_config.tls_config
        # config key -> path, of every file this configuration reads
        self._files = {f"{HTTP_CONFIG_KEY}.{key}": path for key, path in (
            ("basic_auth.password_file", http_config.basic_auth and http_config.basic_auth.password_file),
            ("authorization.credentials_file", http_config.authorization and http_config.authorization.credentials_file),
            ("tls_config.ca_file", tls.ca_file),
            ("tls_config.cert_file", tls.cert_file),
            ("tls_config.key_file", tls.key_file),
        ) if path}
        self._stamps: dict[str, tuple[int, int, int, int]] = {}
        self._authorization: str | None = None
        self._tls: ssl.SSLContext | None = None
        # grows each time the TLS context is rebuilt: a client holding the old one must be replaced
        self.tls_generation = 0
        try:
            self.refresh()
        except CredentialsUnreadable as error:
            raise ConfigError(str(error)) from None

    def __repr__(self) -> str:
        return f"PushCredentials(files={sorted(self._files)}, authorization={'set' if self._authorization else 'none'})"

    @property
    def server_name(self) -> str | None:
        return self.config.tls_config.server_name

    def authorization(self) -> str | None:
        """The Authorization header's value, or None without basic_auth or authorization."""
        return self._authorization

    def ssl_context(self) -> ssl.SSLContext:
        assert self._tls is not None  # built by the first refresh(), in __init__
        return self._tls

    def refresh(self) -> None:
        """Read again whatever changed since the last call; raises CredentialsUnreadable. Nothing
        is kept from a refresh that failed, so the next one tries every changed file again."""
        stamps = {key: self._stamp(key, path) for key, path in self._files.items()}
        changed = {key for key, stamp in stamps.items() if self._stamps.get(key) != stamp}
        first = self._tls is None
        if not first and not changed:
            return
        tls_keys = {key for key in self._files if ".tls_config." in key}
        authorization = self._read_authorization() if first or changed - tls_keys else self._authorization
        rebuild_tls = first or bool(changed & tls_keys)
        tls = self._build_tls() if rebuild_tls else self._tls
        self._authorization, self._tls, self._stamps = authorization, tls, stamps
        if rebuild_tls:
            self.tls_generation += 1

    # -- reading ---------------------------------------------------------------------------------

    @staticmethod
    def _stamp(key: str, path: str) -> tuple[int, int, int, int]:
        try:
            status = os.stat(path)
        except OSError as error:
            raise CredentialsUnreadable(f"{key}: {path} cannot be read: {error.strerror}") from None
        return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns

    def _read_secret(self, key: str) -> str:
        path = self._files[key]
        try:
            with open(path, "rb") as handle:
                data = handle.read(MAX_SECRET_FILE_BYTES + 1)  # bounded: the path may be a device
        except OSError as error:
            raise CredentialsUnreadable(f"{key}: {path} cannot be read: {error.strerror}") from None
        if len(data) > MAX_SECRET_FILE_BYTES:
            raise CredentialsUnreadable(f"{key}: {path} is longer than {MAX_SECRET_FILE_BYTES} bytes, "
                                        "not a password or token")
        try:
            secret = data.decode("utf-8").strip()  # trimmed as Prometheus does: a file ends in a newline
        except UnicodeDecodeError:
            raise CredentialsUnreadable(f"{key}: {path} is not UTF-8 text") from None
        if not secret:
            raise CredentialsUnreadable(f"{key}: {path} is empty")
        return secret

    def _read_authorization(self) -> str | None:
        basic, token = self.config.basic_auth, self.config.authorization
        if basic is not None:
            password = self._read_secret(f"{HTTP_CONFIG_KEY}.basic_auth.password_file")
            # RFC 7617: base64 of user-id ":" password, UTF-8 (what Go's SetBasicAuth sends)
            return "Basic " + base64.b64encode(f"{basic.username}:{password}".encode()).decode("ascii")
        if token is not None:
            key = f"{HTTP_CONFIG_KEY}.authorization.credentials_file"
            credentials = self._read_secret(key)
            # An HTTP header carries visible ASCII and spaces only; httpx would refuse anything
            # else with the header's value, the secret, in its error.
            if not all(" " <= character <= "~" for character in credentials):
                raise CredentialsUnreadable(f"{key}: {self._files[key]} holds characters an HTTP header "
                                            "cannot carry (only printable ASCII)")
            return f"{token.type} {credentials}"
        return None

    def _build_tls(self) -> ssl.SSLContext:
        """Like Prometheus's NewTLSConfig: ca_file replaces the system's trust store."""
        tls = self.config.tls_config
        key = f"{HTTP_CONFIG_KEY}.tls_config"
        try:
            context = ssl.create_default_context(cafile=tls.ca_file) if tls.ca_file else ssl.create_default_context()
        except (OSError, ssl.SSLError) as error:
            raise CredentialsUnreadable(f"{key}.ca_file: {tls.ca_file} cannot be used as PEM CA certificates: "
                                        f"{_ssl_reason(error)}") from None
        if tls.cert_file and tls.key_file:
            try:
                context.load_cert_chain(tls.cert_file, tls.key_file)
            except (OSError, ssl.SSLError) as error:
                raise CredentialsUnreadable(f"{key}.cert_file/key_file: {tls.cert_file} and {tls.key_file} cannot "
                                            f"be used as a PEM certificate and its unencrypted private key: "
                                            f"{_ssl_reason(error)}") from None
        if tls.min_version:
            context.minimum_version = SSL_MIN_VERSIONS[tls.min_version]
        if tls.insecure_skip_verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


def _ssl_reason(error: Exception) -> str:
    """OpenSSL's reason (KEY_VALUES_MISMATCH, NO_CERTIFICATE_OR_CRL_FOUND), or the OS error's text:
    neither repeats the file's content."""
    return getattr(error, "reason", None) or getattr(error, "strerror", None) or type(error).__name__
