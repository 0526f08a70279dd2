"""A private PostgreSQL server for the tests: ``initdb`` into a fresh temporary folder,
``postgres`` on a free port of 127.0.0.1 (password login, as a deployment connects) with its
unix socket in that folder, and a fresh database per test. Stopped and removed at the end.

PostgreSQL refuses to run as root: as root, the binaries run as the ``postgres`` user
(``runuser``), which owns the folder. The server's time zone is not UTC, so a timestamp stored
without its zone would come back shifted and fail the tests.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

USER = "vit"
TIME_ZONE = "Asia/Kolkata"  # UTC+05:30: any zone mistake shows


class PostgresUnavailable(RuntimeError):
    """PostgreSQL (or the driver) is not installed here."""


def find_bindir() -> Path | None:
    """PostgreSQL's programs: ``pg_config --bindir``, else the newest Debian
    ``/usr/lib/postgresql/<version>/bin`` (Debian's server is not on PATH)."""
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        bindir = Path(out.stdout.strip())
        if out.returncode == 0 and (bindir / "initdb").exists() \
                and (bindir / "postgres").exists():
            return bindir
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                   key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.parent.name)])
    return found[-1].parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self, root: Path, bindir: Path, port: int, password: str,
                 as_postgres: list[str]) -> None:
        self.root, self.bindir, self.port, self.password = root, bindir, port, password
        self.as_postgres = as_postgres  # the command prefix that runs a program as its owner

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str) -> str:
        """A SQLAlchemy URL of ``database``, over TCP with a password (as the API connects)."""
        return (f"postgresql+psycopg2://{USER}:{self.password}@127.0.0.1:{self.port}/"
                f"{database}")

    def connect(self, database: str = "postgres"):  # -> psycopg2 connection, autocommit
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=USER,
                                password=self.password, dbname=database)
        conn.autocommit = True
        return conn

    def create_database(self) -> str:
        """A new empty database; its name."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        self.execute(f'CREATE DATABASE "{name}"')
        return name

    def execute(self, sql: str, database: str = "postgres") -> list[tuple]:
        """Run one statement outside any transaction (CREATE DATABASE must); its rows."""
        conn = self.connect(database)
        try:
            with conn.cursor() as cur:
                cur.execute(sql)
                return cur.fetchall() if cur.description is not None else []
        finally:
            conn.close()

    def drop_database(self, name: str) -> None:
        """Drop ``name``, ending whatever sessions a test left open on it."""
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        subprocess.run([*self.as_postgres, str(self.bindir / "pg_ctl"), "-D", str(self.data),
                        "-m", "immediate", "-w", "stop"], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres() -> PostgresServer:
    """initdb + start a private server (see the module docstring); raises
    :class:`PostgresUnavailable` when PostgreSQL or psycopg2 is missing."""
    try:
        import psycopg2  # noqa: F401
    except ImportError as e:
        raise PostgresUnavailable("psycopg2 is not installed (pip install -e '.[postgres]')") \
            from e
    bindir = find_bindir()
    if bindir is None:
        raise PostgresUnavailable("no initdb (pg_config --bindir, /usr/lib/postgresql/*/bin): "
                                  "install Debian's postgresql package (make setup does, as "
                                  "root)")
    root = Path(tempfile.mkdtemp(prefix="vit-pg-"))  # short: the socket path is limited
    as_postgres: list[str] = []
    if os.geteuid() == 0:
        import pwd

        try:
            owner = pwd.getpwnam("postgres")
        except KeyError as e:
            shutil.rmtree(root)
            raise PostgresUnavailable("running as root and there is no postgres user") from e
        os.chown(root, owner.pw_uid, owner.pw_gid)
        as_postgres = ["runuser", "-u", "postgres", "--"]
    password = secrets.token_hex(12)
    pwfile = root / "pwfile"
    pwfile.write_text(password + "\n")
    if as_postgres:
        os.chown(pwfile, owner.pw_uid, owner.pw_gid)
    port = _free_port()
    server = PostgresServer(root, bindir, port, password, as_postgres)
    try:
        subprocess.run([*as_postgres, str(bindir / "initdb"), "-D", str(server.data), "-U", USER,
                        f"--pwfile={pwfile}", "--auth-host=scram-sha-256", "--auth-local=trust",
                        "--encoding=UTF8", "--locale=C", "--no-sync"],
                       check=True, capture_output=True, text=True)
        pwfile.unlink()
        options = " ".join([
            "-c listen_addresses=127.0.0.1", f"-p {port}", f"-k {shlex.quote(str(root))}",
            f"-c timezone={TIME_ZONE}", "-c max_connections=200",
            # a throwaway server: nothing needs to survive a crash
            "-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"])
        subprocess.run([*as_postgres, str(bindir / "pg_ctl"), "-D", str(server.data), "-l",
                        str(root / "postgres.log"), "-o", options, "-w", "-t", "60", "start"],
                       check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        logs = (root / "postgres.log").read_text() if (root / "postgres.log").exists() else ""
        server.stop()
        raise RuntimeError(f"PostgreSQL did not start: {e.cmd[len(as_postgres)]} exited "
                           f"{e.returncode}: {e.stdout}{e.stderr}{logs}") from e
    log.info("PostgreSQL %s on 127.0.0.1:%d (%s)", bindir, port, root)
    return server
