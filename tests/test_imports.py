"""The import graph of the installed package: imports flow one way, from the face (CLI, serve) down
to the layers, with no circle between modules nor between packages (``cache`` -> ``planner`` ->
``quantize`` -> ``layers`` -> ``policy``, never back); research tooling (``bench/research``) is never imported; the
torch-only packages load without transformers, fastapi or redis.

The graph is read from the source (every ``import``, lazy ones inside functions included), so a
circle that only closes at run time is still found.
"""

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tiercache"

# packages that need torch alone (DESIGN: only cache/, the CLI, serve/, models/ and bench import transformers)
TORCH_ONLY = ["tiercache.layers", "tiercache.quantize", "tiercache.offload", "tiercache.policy", "tiercache.planner",
              "tiercache.lifecycle", "tiercache.simdevice"]
HEAVY = ("transformers", "fastapi", "uvicorn", "redis", "prometheus_client")


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


@functools.lru_cache(maxsize=None)  # each module's source is parsed once per run, not once per test
def imports_of(name: str, path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import statement of one module."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [(f"{base}.{a.name}", id(node) in top) for a in node.names]
    return out


@functools.lru_cache(maxsize=None)
def graph() -> dict[str, set[str]]:
    mods = modules()
    g = {m: set() for m in mods}
    for m, path in mods.items():
        for target, _ in imports_of(m, path):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != m and not m.startswith(target + ".") and target != "tiercache":
                g[m].add(target)
    return g


def package_of(module: str) -> str:
    """``tiercache.cache.tiered`` -> ``tiercache.cache``; a top-level module (``tiercache.cli``) is its own."""
    return ".".join(module.split(".")[:2])


def package_graph(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto the package level (imports inside one package dropped)."""
    out: dict[str, set[str]] = {}
    for m, targets in g.items():
        out.setdefault(package_of(m), set())
        for t in targets:
            out.setdefault(package_of(t), set())
            if package_of(t) != package_of(m):
                out[package_of(m)].add(package_of(t))
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_planted_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_in_the_package():
    found = cycles(graph())
    assert found == [], "import circles (imports must flow one way): " + "; ".join(" <-> ".join(c) for c in found)


def test_the_package_graph_folds_modules_onto_packages():
    g = {"tiercache.a.x": {"tiercache.b.y"}, "tiercache.b.y": {"tiercache.a.z"}, "tiercache.a.z": set(),
         "tiercache.cli": {"tiercache.a.x"}}
    assert package_graph(g) == {"tiercache.a": {"tiercache.b"}, "tiercache.b": {"tiercache.a"},
                                "tiercache.cli": {"tiercache.a"}}
    assert cycles(package_graph(g)) == [["tiercache.a", "tiercache.b"]]  # no module circle, a package one


def test_no_import_circles_between_packages():
    g = graph()
    found = cycles(package_graph(g))
    edges = [f"{m} -> {t}" for m, ts in sorted(g.items()) for t in sorted(ts)
             if any(package_of(m) in c and package_of(t) in c and package_of(m) != package_of(t) for c in found)]
    assert found == [], ("package import circles (move the shared piece to the lower package): "
                         + "; ".join(" <-> ".join(c) for c in found) + "\n" + "\n".join(edges))


def test_only_the_deprecated_aliases_import_the_simulated_device():
    """Offload and the rest reach the device through ``tiercache.runtime`` alone; the simulated device is the tests'."""
    aliases = {"tiercache.offload.simdevice", "tiercache.offload.simmemory"}
    bad = sorted(m for m, ts in graph().items() if not m.startswith("tiercache.simdevice") and m not in aliases
                 and any(t == "tiercache.simdevice" or t.startswith("tiercache.simdevice.") for t in ts))
    assert bad == [], f"these modules import the simulated device (use the runtime seam, tiercache.runtime): {bad}"
    assert all(any(t.startswith("tiercache.simdevice.") for t in graph()[a]) for a in aliases)


def test_the_package_never_imports_research_tooling():
    bad = [(m, t) for m, p in modules().items() for t, _ in imports_of(m, p)
           if t.split(".")[0] in ("research", "bench")]
    assert bad == [], f"the installed package imports research tooling: {bad}"
    assert not (PACKAGE / "bench" / "needle.py").exists() and (ROOT / "bench" / "research" / "needle.py").exists()


@pytest.mark.parametrize("package", TORCH_ONLY)
def test_torch_only_packages_import_no_heavy_library_at_module_level(package):
    bad = [(m, t) for m, p in modules().items() if m == package or m.startswith(package + ".")
           for t, top in imports_of(m, p) if top and t.split(".")[0] in HEAVY]
    assert bad == [], f"{package} imports {bad} at module level (torch alone is allowed; import lazily)"


def test_only_serve_imports_the_web_and_store_clients():
    bad = [(m, t) for m, p in modules().items() if not m.startswith("tiercache.serve")
           for t, _ in imports_of(m, p) if t.split(".")[0] in ("fastapi", "uvicorn", "redis", "prometheus_client")]
    assert bad == [], f"only tiercache.serve may import fastapi / uvicorn / redis / prometheus_client: {bad}"


def test_planning_and_policies_load_without_transformers():
    code = ("import sys, tiercache, tiercache.planner.api, tiercache.policy, tiercache.quantize.processor, "
            "tiercache.offload.processor, tiercache.layers.full; "
            "p = tiercache.plan('configs/int4-kivi.yaml', 'llama-3-8b', context_length=4096); "
            "print(sorted(m for m in %r if m in sys.modules), p.bytes['device'] > 0)" % (HEAVY,))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "True"], out.stdout


def test_the_public_api_is_where_it_was():
    code = ("import tiercache; from tiercache.cache.tiered import TieredCache; "
            "from tiercache.planner.api import plan; from tiercache.cache.prefill import generate; "
            "assert tiercache.TieredCache is TieredCache and tiercache.plan is plan and tiercache.generate is generate; "
            "assert tiercache.load_policy and tiercache.Policy and tiercache.PolicyError and tiercache.CacheError; "
            "from tiercache.cli import main; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
