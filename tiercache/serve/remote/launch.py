"""``RedisProcess``: a real ``redis-server`` on a free loopback port (tests, ``bench/bench_remote.py``).

    r = RedisProcess(log_dir, maxmemory=None, password=None, tls=None).start()
                              ``--save '' --appendonly no``: nothing on disk; ``password``: the default
                              user's (``--requirepass``); ``tls``: ``(cert, key)`` files, then it
                              listens with TLS only (``self_signed(directory)`` makes a pair)
    r.url                     redis://127.0.0.1:PORT/0 (rediss://...?ssl_ca_certs=CERT with TLS;
                              the password in it when there is one)
    r.url_for(user, password) the same server as another ACL user (``ACL SETUSER`` through ``command``)
    r.command(*args)          one command from a fresh client (``DEBUG SLEEP``, ``CONFIG SET`` ...)
    r.kill()                  SIGKILL, as a crash; ``r.start()`` again brings it back on the same port
    r.stop()

``start`` waits at most ``wait`` seconds for PING; ``RedisMissing`` (a ``RuntimeError``) when
``redis-server`` is not installed, saying how to install it.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

from tiercache.serve.launch import free_port

INSTALL = ("redis-server is not installed; the remote tier's tests and benchmark need a real one: "
           "`apt-get install -y redis-server` (Debian/Ubuntu; `make test` does it when run as root), "
           "`brew install redis`, or any redis-server / valkey-server on the PATH")


class RedisMissing(RuntimeError):
    pass


class RedisProcess:
    def __init__(self, log_dir, maxmemory: str | None = None, port: int | None = None, password: str | None = None,
                 tls: tuple | None = None):
        self.binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if self.binary is None:
            raise RedisMissing(INSTALL)
        self.port = port or free_port()
        self.password, self.tls = password, tls
        self.url = self.url_for(None, password)
        self.log_path = Path(log_dir) / f"redis-{self.port}.log"
        self.maxmemory = maxmemory
        self.proc = None

    def url_for(self, user: str | None, password: str | None) -> str:
        auth = f"{quote(user or '', safe='')}:{quote(password, safe='')}@" if password is not None else ""
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={quote(str(self.tls[0]))}"

    def start(self, wait: float = 10.0) -> "RedisProcess":
        port = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls[0]), "--tls-key-file",
                str(self.tls[1]), "--tls-ca-cert-file", str(self.tls[0]), "--tls-auth-clients", "no"] \
            if self.tls is not None else ["--port", str(self.port)]
        args = [self.binary, *port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--protected-mode", "no", "--logfile", str(self.log_path), "--enable-debug-command", "local"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log()}")
            try:
                if self.command("PING"):
                    return self
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING within {wait}s: {self.log()}")

    def command(self, *args, timeout: float = 5.0):
        import redis

        tls = {"ssl": True, "ssl_ca_certs": str(self.tls[0])} if self.tls is not None else {}
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout,
                             password=self.password, **tls)
        try:
            return client.execute_command(*args)
        finally:
            client.close()

    def log(self) -> str:
        return self.log_path.read_text()[-3000:] if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def self_signed(directory) -> tuple[Path, Path]:
    """A certificate and key for 127.0.0.1 (``openssl`` on the PATH): ``(cert.pem, key.pem)`` in ``directory``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl is not installed; the TLS test needs it: `apt-get install -y openssl`")
    cert, key = Path(directory) / "cert.pem", Path(directory) / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key
