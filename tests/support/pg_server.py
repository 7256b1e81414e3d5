"""A throwaway PostgreSQL server for the tests: initdb in a fresh temp dir, postgres on a free
127.0.0.1 port with its unix socket in that dir, stopped (and the dir removed) at the end.

Binaries: $PG_BIN, then /usr/lib/postgresql/*/bin (Debian), then PATH. postgres refuses to
run as root, so when the tests run as root initdb/pg_ctl run as the `postgres` user (the dir
is chowned to it). TCP connections need a password (scram): the superuser `relay` has
PASSWORD below, given to relays through `[store].password_env`; the unix socket trusts
(the fixture's own admin connection).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

USER = "relay"
PASSWORD = "pw-" + uuid.uuid4().hex[:12]
PASSWORD_ENV = "RELAY_TEST_PG_PASSWORD"


def find_bin() -> str | None:
    cands = [os.environ.get("PG_BIN", "")]
    cands += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for d in cands:
        if d and os.path.isfile(os.path.join(d, "pg_ctl")):
            return d
    pg_ctl = shutil.which("pg_ctl")
    return os.path.dirname(pg_ctl) if pg_ctl else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    def __init__(self, bindir: str, fsync: bool = False) -> None:
        self.bindir = bindir
        self.fsync = fsync  # off for the tests (speed); on for a benchmark
        self.root = tempfile.mkdtemp(prefix="relay-pg-", dir="/tmp")
        self.data = os.path.join(self.root, "data")
        self.port = _free_port()
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]
        os.chmod(self.root, 0o700)

    def _run(self, *args: str, timeout: float = 60.0) -> None:
        subprocess.run(
            [*self.as_user, os.path.join(self.bindir, args[0]), *args[1:]],
            check=True,
            timeout=timeout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=self.root,
        )

    def init(self) -> None:
        pwfile = os.path.join(self.root, "pw")
        with open(pwfile, "w") as fh:
            fh.write(PASSWORD + "\n")
        if self.as_user:
            pw = pwd.getpwnam("postgres")
            os.chown(pwfile, pw.pw_uid, pw.pw_gid)
        self._run(
            "initdb",
            "-D",
            self.data,
            "-U",
            USER,
            "--pwfile",
            pwfile,
            "-E",
            "UTF8",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--no-sync",
        )
        os.unlink(pwfile)
        with open(os.path.join(self.data, "postgresql.conf"), "a") as fh:
            fh.write(
                f"listen_addresses = '127.0.0.1'\nport = {self.port}\n"
                f"unix_socket_directories = '{self.root}'\n"
                f"fsync = {'on' if self.fsync else 'off'}\n"
                "max_connections = 200\nlog_min_messages = warning\n"
            )
        self.start()

    def start(self) -> None:
        self._run(
            "pg_ctl",
            "-D",
            self.data,
            "-l",
            os.path.join(self.root, "log"),
            "-w",
            "-t",
            "30",
            "start",
        )
        self.wait_ready()

    def stop(self) -> None:
        self._run("pg_ctl", "-D", self.data, "-m", "fast", "-w", "-t", "30", "stop")

    def wait_ready(self, timeout: float = 30.0) -> None:
        import psycopg

        end = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(self.admin_url()).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)

    def admin_url(self, db: str = "postgres") -> str:
        return f"postgresql://{USER}@/{db}?host={self.root}&port={self.port}"

    def url(self, db: str) -> str:
        """What a relay is given: TCP, password from PASSWORD_ENV."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{db}"

    def create_db(self) -> str:
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.admin_url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return name

    def query(self, db: str, sql: str, params=()) -> list[tuple]:
        import psycopg

        with psycopg.connect(self.admin_url(db), autocommit=True) as conn:
            return conn.execute(sql, params).fetchall()

    def destroy(self) -> None:
        try:
            self.stop()
        except Exception:
            pass
        shutil.rmtree(self.root, ignore_errors=True)
