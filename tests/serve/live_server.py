"""Start ``tiercache serve`` in a subprocess on 127.0.0.1 with a free port (a test helper)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *flags, log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "NO_PROXY": "127.0.0.1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tiercache.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *flags],
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=env, cwd=log_dir)
        self.http = httpx.Client(base_url=self.url, timeout=60, trust_env=False)

    def wait_ready(self, timeout: float = 120.0) -> "Server":
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
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60,
                             http_client=httpx.Client(trust_env=False))

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

    def stop(self) -> str:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        return self.log()
