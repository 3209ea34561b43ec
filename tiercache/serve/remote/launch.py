"""``RedisProcess``: a real ``redis-server`` on a free loopback port (tests, ``bench/bench_remote.py``).

    r = RedisProcess(log_dir, maxmemory=None).start()     ``--save '' --appendonly no``: nothing on disk
    r.url                     redis://127.0.0.1:PORT/0
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

from tiercache.serve.launch import free_port

INSTALL = ("redis-server is not installed; the remote tier's tests and benchmark need a real one: "
           "`apt-get install -y redis-server` (Debian/Ubuntu; `make test` does it when run as root), "
           "`brew install redis`, or any redis-server / valkey-server on the PATH")


class RedisMissing(RuntimeError):
    pass


class RedisProcess:
    def __init__(self, log_dir, maxmemory: str | None = None, port: int | None = None):
        self.binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if self.binary is None:
            raise RedisMissing(INSTALL)
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = Path(log_dir) / f"redis-{self.port}.log"
        self.maxmemory = maxmemory
        self.proc = None

    def start(self, wait: float = 10.0) -> "RedisProcess":
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--protected-mode", "no", "--logfile", str(self.log_path), "--enable-debug-command", "local"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
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

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)
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
