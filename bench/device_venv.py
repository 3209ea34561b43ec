"""Make a venv look like the GPU machine's image: torch and triton from the project's venv, by link.

    python bench/device_venv.py SOURCE_VENV TARGET_VENV

The device image has python3 with torch, transformers 5.17, triton and pytest, and none of the
serving, quanto, hqq or redis packages. ``make device-venv`` builds TARGET_VENV with
transformers 5.17 and tiercache's plain dependencies installed by pip, then runs this script,
which links torch and triton (and what they need, e.g. sympy, networkx) from SOURCE_VENV into
``TARGET_VENV/linked`` and adds that folder to the target's path with a ``.pth`` file: a second
install of torch (hundreds of MB, minutes) is not needed, and nothing else of the source venv
(fastapi, quanto, redis, ...) is visible. Distributions the target already has are not linked, so
its own versions win. ``bench/gpu_quick.sh --dry-run`` runs there in the suite
(``tests/bench/test_gpu_quick.py``), so a missing import fails on the CPU, not on the GPU.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOTS = ("torch", "triton")


def site_packages(venv: Path) -> Path:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def distributions(site: Path) -> dict[str, Path]:
    """Normalized distribution name -> its ``.dist-info`` folder in ``site``."""
    found = {}
    for info in site.glob("*.dist-info"):
        meta = info / "METADATA"
        if meta.exists():
            for line in meta.read_text(errors="replace").splitlines():
                if line.startswith("Name:"):
                    found[_norm(line.split(":", 1)[1].strip())] = info
                    break
    return found


def requirements(info: Path) -> list[str]:
    """The names a distribution requires unconditionally (no extras, no markers that exclude Linux)."""
    names = []
    for line in (info / "METADATA").read_text(errors="replace").splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec = line.split(":", 1)[1]
        req, _, marker = spec.partition(";")
        if "extra" in marker or "win32" in marker or "darwin" in marker:
            continue
        names.append(_norm(re.split(r"[\s<>=!~\[(]", req.strip(), maxsplit=1)[0]))
    return names


def top_level(info: Path) -> set[str]:
    """The names a distribution puts in site-packages (from its RECORD), its dist-info included."""
    names = {info.name}
    record = info / "RECORD"
    for line in record.read_text(errors="replace").splitlines() if record.exists() else []:
        first = line.split(",", 1)[0].split("/", 1)[0]
        if first and first not in ("..", "__pycache__") and not first.endswith(".pth"):
            names.add(first)
    return names


def link(source: Path, target: Path) -> list[str]:
    src_site, dst_site = site_packages(source), site_packages(target)
    have, offered = distributions(dst_site), distributions(src_site)
    todo, chosen = list(ROOTS), []
    while todo:
        name = _norm(todo.pop())
        if name in have or name in chosen or name not in offered:
            continue
        chosen.append(name)
        todo.extend(requirements(offered[name]))
    linked = target / "linked"
    linked.mkdir(exist_ok=True)
    for name in chosen:
        for entry in top_level(offered[name]):
            src, dst = src_site / entry, linked / entry
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
    (dst_site / "zz_linked_from_project_venv.pth").write_text(str(linked.resolve()) + "\n")
    return chosen


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python bench/device_venv.py SOURCE_VENV TARGET_VENV", file=sys.stderr)
        return 2
    source, target = (Path(a).resolve() for a in argv)
    for venv in (source, target):
        if not (venv / "bin" / "python").exists():
            print(f"device_venv: {venv} is not a venv (no bin/python)", file=sys.stderr)
            return 2
    print("linked: " + ", ".join(link(source, target)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
