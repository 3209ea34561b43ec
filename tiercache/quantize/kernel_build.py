"""Build tiercache's C++ CPU kernels ahead of use, once per torch install and CPU; find them at run time.

    Kernel(name, source, functions, cflags, ldflags)   one ``load_inline`` extension (``packed_cpu.kernel()``)
    root() -> Path            where builds live: ``$TIERCACHE_KERNEL_DIR``, else ``$XDG_CACHE_HOME/tiercache/kernels``
                              (default ``~/.cache/tiercache/kernels``)
    key(kernel) -> str        a build's directory name: the kernel's name and a hash of its source and flags,
                              the torch install (version and path), Python's extension ABI and the CPU
    locate(kernel) -> Path | None          its finished build directory, or None
    build(kernel, verbose=False) -> Built  compiles it unless it is built (``tiercache build-kernels``)
    load(kernel, lazy=None) -> module | None
                              the built module; when there is none: built here only if lazy builds are
                              allowed (``lazy=True``, or ``TIERCACHE_KERNEL_BUILD=lazy``), else None and one
                              ``KernelNotBuiltWarning`` naming ``tiercache build-kernels``
    compiler() -> str | None  the C++ compiler torch would run (``$CXX``, else ``c++``), if it is on PATH

Why ahead of use: compiling (g++ ``-march=native``, about a minute) inside a user's run costs that
minute and the compiler's memory (hundreds of MiB, counted in the run's process tree); a run, a
server request or a timed step must only load a finished build, or fall back to the torch reference.

Why this key: a build is only valid for the torch it was compiled against (headers, ABI: two venvs
hold two torches at two paths), for the CPU ``-march=native`` resolved on (its vendor, model and
flags, read from ``/proc/cpuinfo``: no compiler is run to find a key) and for its source and flags.
Each gets its own directory, so no install rebuilds over another's build.

Concurrency: builders of one key take an exclusive lock (``<key>.lock``, ``fcntl.flock``) and compile
into a fresh temporary directory, which is renamed to ``<key>`` only when finished (``kernel.json``
written last); a second builder waits for the lock and then finds the build. A reader never sees a
half-written build: ``locate`` needs ``kernel.json`` and the library it names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

MANIFEST = "kernel.json"


class KernelBuildError(RuntimeError):
    """A kernel cannot be built here (no compiler, no ninja, or the compiler failed)."""


class KernelNotBuiltWarning(UserWarning):
    """A kernel is not built for this torch and CPU: the torch reference path serves instead."""


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One C++ extension compiled by ``torch.utils.cpp_extension.load_inline``."""

    name: str  # the module's name (load_inline's ``name``)
    source: str  # C++ source (``cpp_sources``)
    functions: tuple[str, ...]  # bound to Python
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Built:
    """What ``build`` did: the build directory, whether it compiled now, and the seconds it took
    (compiling, or waiting for another builder and finding its build)."""

    path: Path
    compiled: bool
    seconds: float
    module: object = dataclasses.field(default=None, repr=False, compare=False)  # when compiled here: loaded


def root() -> Path:
    """The directory holding every build (``$TIERCACHE_KERNEL_DIR``, else the user's cache)."""
    explicit = os.environ.get("TIERCACHE_KERNEL_DIR")
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tiercache" / "kernels"


def cpu_signature(cpuinfo: str = "/proc/cpuinfo") -> str:
    """What ``-march=native`` resolves from, without running a compiler: the machine, and the first
    processor's vendor, family, model and feature flags in ``/proc/cpuinfo`` (the machine and
    ``platform.processor()`` where there is no such file)."""
    fields = ("vendor_id", "cpu family", "model", "flags", "features", "cpu implementer", "cpu architecture",
              "cpu variant", "cpu part", "isa", "uarch")
    seen: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if seen:
                        break  # the first processor's block only
                    continue
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name in fields and name not in seen:
                    seen[name] = " ".join(sorted(value.split())) if name in ("flags", "features") else value.strip()
    except OSError:
        pass
    parts = [platform.machine()] + [f"{k}={seen[k]}" for k in fields if k in seen]
    if len(parts) == 1:
        parts.append(platform.processor())
    return "\n".join(parts)


def identity(kernel: Kernel) -> dict:
    """Everything a build depends on (``key`` hashes it; the build's ``kernel.json`` keeps it readable)."""
    import torch

    return {
        "name": kernel.name,
        "source_sha256": hashlib.sha256(kernel.source.encode()).hexdigest(),
        "functions": list(kernel.functions),
        "cflags": list(kernel.cflags),
        "ldflags": list(kernel.ldflags),
        "torch_version": torch.__version__,
        "torch_path": os.path.realpath(os.path.dirname(torch.__file__)),
        "python_abi": f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}",
        "cpu": cpu_signature(),
    }


def key(kernel: Kernel) -> str:
    """The build's directory name: readable parts (name, torch version, Python tag) and a hash of all."""
    ident = identity(kernel)
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    torch_version = "".join(c if c.isalnum() or c in ".-" else "-" for c in ident["torch_version"])
    return f"{kernel.name}-torch{torch_version}-{sys.implementation.cache_tag}-{digest}"


def _manifest(path: Path) -> dict | None:
    """A finished build's ``kernel.json`` (None when missing, unreadable or its library is gone)."""
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not (path / str(data.get("library", ""))).is_file():
        return None
    return data


def locate(kernel: Kernel) -> Path | None:
    """The finished build directory of ``kernel`` for this torch and CPU, or None."""
    path = root() / key(kernel)
    return path if _manifest(path) is not None else None


def compiler() -> str | None:
    """The C++ compiler ``load_inline`` would run (``$CXX``, else ``c++``), resolved on PATH; None if absent."""
    return shutil.which(os.environ.get("CXX") or "c++")


def _import(path: Path):
    """Imports the extension module of a finished build (no compiler, no ninja: a library load)."""
    data = _manifest(path)
    if data is None:
        raise ImportError(f"{path} is not a finished kernel build (no {MANIFEST} or no library)")
    spec = importlib.util.spec_from_file_location(data["module"], path / data["library"])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path / data['library']} as module {data['module']!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` held across processes (``fcntl.flock``; none where it is missing:
    the atomic rename in ``build`` still keeps a build whole)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(kernel: Kernel, verbose: bool = False) -> Built:
    """Compiles ``kernel`` into ``root() / key(kernel)`` unless it is built there; returns where.

    Raises ``KernelBuildError`` naming what is missing (a C++ compiler, ninja) or the compiler's error."""
    start = time.perf_counter()
    final = root() / key(kernel)
    if _manifest(final) is not None:
        return Built(final, False, time.perf_counter() - start)
    cxx = compiler()
    if cxx is None:
        raise KernelBuildError(
            f"no C++ compiler: {os.environ.get('CXX') or 'c++'} is not on PATH (set CXX, or install one: "
            f"apt-get install g++ on Debian/Ubuntu, xcode-select --install on macOS); without the kernel, "
            f"packed attention on the CPU uses the torch reference path")
    from torch.utils.cpp_extension import is_ninja_available, load_inline

    if not is_ninja_available():
        raise KernelBuildError("ninja is missing (torch builds extensions with it): pip install ninja")
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final.parent / f"{final.name}.lock"):
        if _manifest(final) is not None:  # another builder finished it while this one waited
            return Built(final, False, time.perf_counter() - start)
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=final.parent))
        try:
            compile_start = time.perf_counter()
            try:
                module = load_inline(kernel.name, cpp_sources=kernel.source, functions=list(kernel.functions),
                                     extra_cflags=list(kernel.cflags), extra_ldflags=list(kernel.ldflags),
                                     build_directory=str(tmp), verbose=verbose)
            except Exception as e:  # the compiler's own message (load_inline raises RuntimeError with it)
                raise KernelBuildError(f"compiling {kernel.name} with {cxx} failed: {e}") from e
            data = {**identity(kernel), "module": module.__name__, "library": os.path.basename(module.__file__),
                    "compiler": cxx, "build_seconds": round(time.perf_counter() - compile_start, 2),
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            (tmp / MANIFEST).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache's build from other users
            if final.exists():  # a stale, unfinished directory (no manifest): only a builder holding the lock gets here
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return Built(final, True, time.perf_counter() - start, module)


def lazy_allowed() -> bool:
    """``TIERCACHE_KERNEL_BUILD=lazy``: a run that finds no build may compile one (about a minute, once)."""
    return os.environ.get("TIERCACHE_KERNEL_BUILD", "").strip().lower() == "lazy"


_WARNED: set[str] = set()


def _warn_once(tag: str, message: str) -> None:
    if tag not in _WARNED:
        _WARNED.add(tag)
        warnings.warn(message, KernelNotBuiltWarning, stacklevel=3)


def load(kernel: Kernel, lazy: bool | None = None):
    """The module of ``kernel``'s build for this torch and CPU, or None (then warns once per kernel).

    Never compiles unless ``lazy`` (default: ``lazy_allowed()``); a lazy build that fails warns once too."""
    lazy = lazy_allowed() if lazy is None else lazy
    path = locate(kernel)
    if path is None and lazy:
        try:
            built = build(kernel)
            if built.module is not None:
                return built.module
            path = built.path
        except KernelBuildError as e:
            _warn_once(kernel.name, f"tiercache: the {kernel.name} CPU kernel could not be built ({e}); "
                                    f"using the torch reference path")
            return None
    if path is None:
        _warn_once(kernel.name, f"tiercache: the {kernel.name} CPU kernel is not built for this torch and CPU "
                                f"(looked in {root()}); using the torch reference path, which is slower. Build "
                                f"it once with `tiercache build-kernels` (or set TIERCACHE_KERNEL_BUILD=lazy "
                                f"to build it at first use)")
        return None
    try:
        return _import(path)
    except ImportError as e:
        _warn_once(kernel.name, f"tiercache: the {kernel.name} CPU kernel built in {path} does not load ({e}); "
                                f"using the torch reference path (rebuild: remove that directory, then run "
                                f"`tiercache build-kernels`)")
        return None
