"""``transformers serve --continuous-batching`` in a subprocess on 127.0.0.1 (``bench/bench_peer.py``'s peer).

    exe = transformers_cli()                      # the ``transformers`` CLI, or PeerUnavailable
    path = peer_model_dir(source_dir, tmp)        # a directory transformers serve can load
    s = PeerServer(exe, path, log_dir=tmp, threads=1).wait_ready()
    s.model; s.url; s.proc; s.client() (an ``openai.OpenAI``); s.stop() -> the log's tail

The same interface as ``tiercache.serve.launch.LiveServer`` (``client()``, ``proc``, ``stop()``),
so ``bench/serve_load.py``'s and ``bench/bench_serve.py``'s client helpers drive either server.
``PeerUnavailable`` (a ``RuntimeError``) says why the peer could not start: no CLI, the process
exited (its log's tail), or no ``/health`` within the timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tiercache.serve.launch import free_port


class PeerUnavailable(RuntimeError):
    """``transformers serve`` cannot run here; the message says why."""


def transformers_cli(path: str | None = None) -> str:
    """The ``transformers`` executable: ``path``, else the one beside this interpreter, else on PATH."""
    if path is not None:
        if not (Path(path).is_file() and os.access(path, os.X_OK)):
            raise PeerUnavailable(f"{path} is not an executable file")
        return path
    beside = Path(sys.executable).parent / "transformers"
    found = str(beside) if beside.is_file() else shutil.which("transformers")
    if found is None:
        raise PeerUnavailable("no `transformers` command (pip install 'transformers[serving]')")
    return found


def peer_model_dir(source: Path, tmp: Path) -> Path:
    """A directory with ``source``'s weights and tokenizer (symbolic links) and its config naming the
    architecture: transformers serve picks the model class from ``config.architectures``, which a
    model saved through ``from_pretrained(gguf_file=...)`` leaves empty."""
    config = json.loads((source / "config.json").read_text())
    if not config.get("architectures"):
        if config.get("model_type") != "llama":
            raise PeerUnavailable(f"{source}/config.json names no architecture and is not a llama model")
        config["architectures"] = ["LlamaForCausalLM"]
    out = tmp / "peer-model"
    out.mkdir(exist_ok=True)
    for f in source.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


class PeerServer:
    def __init__(self, exe: str, model_dir: Path, *, log_dir: Path, threads: int | None = 1, extra=(),
                 request_timeout: float = 600.0):
        self.model = str(model_dir)  # transformers serve pinned to a model takes only its own name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"peer-{self.port}.log"
        self.request_timeout = request_timeout
        env = {**os.environ, "NO_PROXY": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        self._log = open(self.log_path, "w")
        try:
            self.proc = subprocess.Popen(
                [exe, "serve", self.model, "--continuous-batching", "--device", "cpu", "--dtype", "float32",
                 "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *extra],
                stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=log_dir)
        except OSError as e:
            self._log.close()
            raise PeerUnavailable(f"{exe} could not be run: {e}") from None
        self.http = httpx.Client(base_url=self.url, timeout=30, trust_env=False)
        self._client = None

    def wait_ready(self, timeout: float = 300.0) -> "PeerServer":
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise PeerUnavailable(f"transformers serve exited with code {self.proc.returncode}; its log ends:\n"
                                      f"{self.log()[-1500:]}")
            try:
                if self.http.get("/health").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise PeerUnavailable(f"transformers serve did not answer /health within {timeout:g}s; its log ends:\n"
                              f"{self.log()[-1500:]}")

    def client(self):
        if self._client is None:
            import openai

            self._client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                                         timeout=self.request_timeout, http_client=httpx.Client(trust_env=False))
        return self._client

    def log(self) -> str:
        return self.log_path.read_text()[-5000:] if self.log_path.exists() else ""

    def stop(self) -> str:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.log()
