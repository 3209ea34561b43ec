import os
import sys
import zlib

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/builders.py: model builders

# no test reaches the Hugging Face Hub: a name that is not on disk fails at once instead of after the
# hub client's five retries (about 23 s without a network); set before huggingface_hub is imported
# (it reads the variable once), and inherited by the processes tests start (HF_HUB_OFFLINE=0 overrides)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# one intra-op thread per worker when pytest-xdist runs two (the machine has two cores)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seeded(request):
    """Every test draws the same random numbers on every run and in any order or worker: the
    global generator is seeded from the test's own id, so a tolerance met once is met in CI."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def device():
    """The compute device: CPU here, CUDA when present and TIERCACHE_TEST_CUDA=1."""
    if torch.cuda.is_available() and os.environ.get("TIERCACHE_TEST_CUDA") == "1":
        return torch.device("cuda")
    return torch.device("cpu")


@pytest.fixture(scope="session")
def packed_kernel():
    """The C++ packed-attention CPU kernel, built once for this torch and CPU (``tiercache
    build-kernels``; a lookup when ``make`` has built it) and loaded, so the tests that take this
    fixture run the kernel, not the torch fallback. Skips where no C++ compiler can build it."""
    from tiercache.quantize import kernel_build, packed_cpu

    if os.environ.get("TIERCACHE_PACKED_KERNEL") == "torch":
        pytest.skip("TIERCACHE_PACKED_KERNEL=torch turns the C++ kernel off")
    if kernel_build.locate(packed_cpu.kernel()) is None and kernel_build.compiler() is None:
        pytest.skip("no C++ compiler: the packed-attention kernel cannot be built here (the torch reference serves)")
    kernel_build.build(packed_cpu.kernel())
    packed_cpu._STATE.clear()  # a lookup made before the build found none
    assert packed_cpu.available()
    return packed_cpu


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
    items[:] = longest_files_first(items)


SLOW_WEIGHT, TEST_WEIGHT = 30.0, 0.05  # rough seconds of a ``slow`` test and of another (most take milliseconds)


def longest_files_first(items: list) -> list:
    """The test files in order of their expected time, longest first; the tests of a file stay together
    and in their order. ``make test`` runs ``-n 2 --dist loadfile --no-loadscope-reorder``: a worker
    takes the next file from this order when it is almost done with its own, so the long files (those
    with ``slow`` tests) start first and short ones fill in at the end, instead of a long file starting
    last and running alone while the other worker idles. A ``slow`` marker's ``seconds=`` gives a
    file's long test its expected time on two busy cores (default ``SLOW_WEIGHT``); a module's
    ``pytestmark = pytest.mark.setup_seconds(N)`` the time its fixtures take to start servers or
    processes (no single test of it is long, yet the file is: started last, it would run alone)."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def weight(tests: list) -> float:
        setup = tests[0].get_closest_marker("setup_seconds")
        total = float(setup.args[0]) if setup is not None else 0.0
        for item in tests:
            slow = item.get_closest_marker("slow")
            total += TEST_WEIGHT if slow is None else float(slow.kwargs.get("seconds", SLOW_WEIGHT))
        return total

    ordered = sorted(files.values(), key=weight, reverse=True)  # stable: equal weights keep collection order
    return [item for tests in ordered for item in tests]


SLOW_SECONDS = float(os.environ.get("TIERCACHE_SLOW_SECONDS", 20))  # a test longer than this is marked @pytest.mark.slow (make test still runs it)
_unmarked_slow: list[tuple[str, float]] = []


def pytest_runtest_logreport(report):
    """Collect tests that ran past SLOW_SECONDS without the ``slow`` marker (reported, not failed:
    a shared CPU makes timings noisy)."""
    if report.when == "call" and report.duration > SLOW_SECONDS and "slow" not in report.keywords:
        _unmarked_slow.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter):
    if _unmarked_slow:
        terminalreporter.write_sep("-", f"tests over {SLOW_SECONDS:g} s without @pytest.mark.slow")
        for nodeid, seconds in sorted(_unmarked_slow, key=lambda t: -t[1]):
            terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")
