"""``LiveServer``: ``tiercache serve`` in a subprocess on 127.0.0.1 with a free port (tests, benchmarks).

    s = LiveServer("--model", "tiny", "--no-store", log_dir=path).wait_ready()   # request_timeout=60 s (client())
    s.url; s.http (an httpx client); s.client() (an ``openai.OpenAI``); s.metrics() -> {name: value}
    s.stop() -> the log's tail            (SIGTERM: the server drains, saves, exits)
    s.signal(signal.SIGTERM); s.wait(timeout) -> exit code

Only loopback: the clients ignore proxy settings from the environment.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]  # the checkout holding this tiercache


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, *flags, log_dir: Path, threads: int | None = 1, env: dict | None = None,
                 request_timeout: float = 60.0):
        self.port = free_port()
        self.request_timeout = request_timeout  # seconds the openai client waits for one request
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_PROXY": "127.0.0.1", **(env or {})}
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tiercache.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=log_dir)
        self.http = httpx.Client(base_url=self.url, timeout=60, trust_env=False)
        self._client = None

    def wait_ready(self, timeout: float = 300.0) -> "LiveServer":
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.http.get("/health").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def client(self):
        """One ``openai.OpenAI`` client per server (made on first use)."""
        if self._client is None:
            import openai

            self._client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                                         timeout=self.request_timeout,
                                         http_client=httpx.Client(trust_env=False))
        return self._client

    def metrics(self) -> dict:
        """``{"name{labels}": value}`` from /metrics."""
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def log(self) -> str:
        return self.log_path.read_text()[-5000:] if self.log_path.exists() else ""

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The exit code once the process has ended (``subprocess.TimeoutExpired`` after ``timeout`` s)."""
        return self.proc.wait(timeout)

    def stop(self) -> str:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
        return self.log()
