"""The Redis that ``kairos up`` starts: ACL users with generated passwords, optionally TLS.

Everything lives in one folder of the cluster's workdir (mode 0700, every file 0600):

- ``redis.conf``: port, bind address, ``protected-mode yes``, ``aclfile``, no persistence, and
  with TLS the ``tls-*`` settings (plain port off: TLS only);
- ``users.acl``: ``default`` off, ``kairos-admin``, ``kairos-dispatcher`` and one
  ``kairos-node-<id>`` per node (:mod:`kairos.common.redis_acl`; passwords stored hashed);
- ``secrets.json``: the generated passwords, reused when the folder is used again (the remote
  nodes' credentials survive a restart of ``kairos up`` with the same ``--workdir``);
- ``credentials/<id>.env``: what one node's agents need, as environment variables
  (``KAIROS_HEARTBEAT_REDIS_URL``, and ``KAIROS_SIDECAR_REDIS_URL`` on decode nodes);
  ``credentials/dispatcher.env`` and ``credentials/admin.env`` likewise;
- with TLS: ``ca.pem`` (what clients verify against), ``server.pem`` and ``server.key``.

Children get their URL in the environment, never on their command line (``ps`` shows argv to
every user; ``/proc/<pid>/environ`` only to the owner).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kairos.common.contracts import Role
from kairos.common.errors import ConfigError
from kairos.common.redis_acl import ADMIN_USER, DISPATCHER_USER, acl_file, check_node_id, node_user
from kairos.common.redis_client import with_credentials
from kairos.extproc.config import SOURCE as DISPATCHER
from kairos.nodeagent.heartbeat import SOURCE as HEARTBEAT
from kairos.nodeagent.sidecar.config import SOURCE as SIDECAR

LOOPBACK = "127.0.0.1"

# The environment variables each component reads its Redis URL from (its setting redis_url).
DISPATCHER_ENV = DISPATCHER.env_var("redis_url")
HEARTBEAT_ENV = HEARTBEAT.env_var("redis_url")
SIDECAR_ENV = SIDECAR.env_var("redis_url")


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (created 0600, never wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def make_tls_files(folder: Path, hosts: Iterable[str], days: int = 825) -> tuple[Path, Path, Path]:
    """A private CA and a server certificate for ``hosts`` (IPs or names) in ``folder`` with the
    ``openssl`` command; returns (ca.pem, server.pem, server.key)."""
    ca_key, ca, key, csr, cert = (folder / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem"))
    names = []
    for host in dict.fromkeys(hosts):
        try:
            socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
            names.append(f"IP:{host}")
        except OSError:
            names.append(f"DNS:{host}")
    ext = folder / "server.ext"
    _write_private(ext, f"subjectAltName={','.join(names)}\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", str(days), "-subj", "/CN=kairos-redis-ca"],
        ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=kairos-redis"],
        [
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            ca,
            "-CAkey",
            ca_key,
            "-CAcreateserial",
            "-out",
            cert,
            "-days",
            str(days),
            "-extfile",
            ext,
        ],
    ]
    old = os.umask(0o077)
    try:
        for step in steps:
            try:
                subprocess.run(["openssl", *map(str, step)], check=True, capture_output=True, timeout=60)
            except FileNotFoundError:
                raise ConfigError("Redis TLS needs the openssl command (Debian: apt-get install openssl)") from None
            except subprocess.CalledProcessError as exc:
                raise ConfigError(f"openssl {step[0]} failed: {exc.stderr.decode(errors='replace')[-300:]}") from None
    finally:
        os.umask(old)
    return ca, cert, key


@dataclass
class RedisSetup:
    """One cluster's Redis configuration and credentials, in ``folder``.

    ``host`` is the bind address; ``advertise`` the address clients on other machines use (the
    bind address, or this machine's name when it binds every interface)."""

    folder: Path
    port: int
    host: str = LOOPBACK
    tls: bool = False
    node_ids: tuple[str, ...] = ()
    passwords: dict[str, str] = field(default_factory=dict)  # Redis user -> password

    @classmethod
    def create(
        cls, folder: Path, port: int, node_ids: Sequence[str], *, host: str = LOOPBACK, tls: bool = False
    ) -> RedisSetup:
        """Write the folder (reusing the passwords of an earlier run in it) and return the set-up."""
        for node_id in node_ids:
            check_node_id(node_id)
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        (folder / "credentials").mkdir(mode=0o700, exist_ok=True)
        stored = folder / "secrets.json"
        try:
            passwords = json.loads(stored.read_text())
        except (OSError, ValueError):
            passwords = {}
        users = [ADMIN_USER, DISPATCHER_USER, *(node_user(n) for n in node_ids)]
        passwords = {u: passwords.get(u) or secrets.token_urlsafe(32) for u in users}
        setup = cls(folder, port, host, tls, tuple(node_ids), passwords)
        _write_private(stored, json.dumps(passwords, indent=2))
        setup._write()
        return setup

    @classmethod
    def load(cls, folder: Path) -> RedisSetup:
        """The set-up an earlier :meth:`create` wrote (for a test or a tool beside the cluster)."""
        try:
            meta = json.loads((folder / "setup.json").read_text())
            passwords = json.loads((folder / "secrets.json").read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"no Redis set-up in {folder}: {exc}") from exc
        return cls(folder, meta["port"], meta["host"], meta["tls"], tuple(meta["node_ids"]), passwords)

    # -- files -----------------------------------------------------------------------------
    @property
    def conf_path(self) -> Path:
        return self.folder / "redis.conf"

    @property
    def ca_path(self) -> Path:
        return self.folder / "ca.pem"

    @property
    def advertise(self) -> str:
        return socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host

    def _write(self) -> None:
        node_passwords = [(n, self.passwords[node_user(n)]) for n in self.node_ids]
        _write_private(
            self.folder / "users.acl",
            acl_file(self.passwords[ADMIN_USER], self.passwords[DISPATCHER_USER], node_passwords),
        )
        lines = [
            "# written by kairos up (kairos.launcher.redis_setup); soft state only: no persistence",
            f"bind {self.host}",
            "protected-mode yes",
            f"aclfile {self.folder / 'users.acl'}",
            f"dir {self.folder}",
            'save ""',
            "appendonly no",
        ]
        if self.tls:
            if not self.ca_path.exists():
                make_tls_files(self.folder, [LOOPBACK, "localhost", self.host, self.advertise])
            lines += [
                "port 0",
                f"tls-port {self.port}",
                f"tls-cert-file {self.folder / 'server.pem'}",
                f"tls-key-file {self.folder / 'server.key'}",
                f"tls-ca-cert-file {self.ca_path}",
                "tls-auth-clients no",  # clients prove who they are with their ACL password
            ]
        else:
            lines.append(f"port {self.port}")
        _write_private(self.conf_path, "\n".join(lines) + "\n")
        meta = {"port": self.port, "host": self.host, "tls": self.tls, "node_ids": list(self.node_ids)}
        _write_private(self.folder / "setup.json", json.dumps(meta))
        for name, env in self._env_files().items():
            body = "".join(f"{k}={v}\n" for k, v in env.items())
            _write_private(self.folder / "credentials" / f"{name}.env", body)

    def server_options(self) -> list[str]:
        """redis-server's options: the config file only (the secrets stay in files, out of ``ps``)."""
        return [str(self.conf_path)]

    def server_argv(self, binary: str) -> list[str]:
        return [binary, *self.server_options()]

    # -- URLs ------------------------------------------------------------------------------
    def url(self, user: str, host: str = LOOPBACK) -> str:
        """``user``'s URL to this Redis from ``host``'s point of view."""
        scheme, query = ("rediss", f"?ssl_ca_certs={self.ca_path}") if self.tls else ("redis", "")
        return with_credentials(f"{scheme}://{host}:{self.port}/0{query}", user, self.passwords[user])

    @property
    def admin_url(self) -> str:
        return self.url(ADMIN_USER)

    @property
    def dispatcher_url(self) -> str:
        return self.url(DISPATCHER_USER)

    def node_url(self, node_id: str, host: str = LOOPBACK) -> str:
        return self.url(node_user(node_id), host)

    def node_env(self, node_id: str, role: Role, host: str = LOOPBACK) -> dict[str, str]:
        """The environment of ``node_id``'s publisher and sidecar: its own user's URL."""
        url = self.node_url(node_id, host)
        return {HEARTBEAT_ENV: url, **({SIDECAR_ENV: url} if role is Role.DECODE else {})}

    def credentials_file(self, name: str) -> Path:
        return self.folder / "credentials" / f"{name}.env"

    def _env_files(self) -> dict[str, dict[str, str]]:
        host = self.advertise
        files = {
            "admin": {"REDIS_URL": self.url(ADMIN_USER, host)},
            "dispatcher": {DISPATCHER_ENV: self.url(DISPATCHER_USER, host)},
        }
        for node_id in self.node_ids:
            url = self.node_url(node_id, host)
            files[node_id] = {HEARTBEAT_ENV: url, SIDECAR_ENV: url}
        return files
