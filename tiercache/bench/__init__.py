"""tiercache.bench: the trade-off benchmark (``tiercache bench``) and its tiny trained model.

Modules: ``corpus`` (stdlib text, the held-out split), ``train`` (the tiny model's recipe),
``tiny`` (models, byte tokenizer, held-out ids), ``setups`` (policies and transformers baselines
as rows), ``quality`` (teacher-forced perplexity, agreement), ``runner`` (one row's measurements),
``report`` (markdown, JSON, PNG), ``command`` (argument parsing and the run);
``builtin`` (the built-in model names), ``real`` (SmolLM2-135M-Instruct, converted once).
The real-model benchmark (``bench/bench_real.py``): ``texts`` (code and prose ids), ``seeded``
(prefill once, seed every cache), ``forced`` (teacher-forced decoding), ``retrieval`` (pass key),
``sensitivity`` (per-layer cost, mixed precision), ``realbench`` (the run), ``real_report``.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (0; 1 when no setup completed or the arguments cannot run here, a BenchError; 2 for malformed flags).

    Flags (all optional; with none, the demo runs: full precision, int4 KIVI, int2 KIVI and a
    CPU-offloaded policy against transformers' DynamicCache and QuantizedCache (quanto, hqq) on
    the tiny trained model):

    --model NAME          ``tiny`` (default; the trained byte-level Llama), ``tiny-random``,
                          ``smollm2-135m`` (the ``real`` extra), or a local path / hub id.
    --policies P [P ...]  policy YAML paths (default: the demo set, from ``configs/`` when present).
    --baselines LIST      comma-separated transformers caches: dynamic, dynamic-offload (CUDA
                          only), quanto-int4, quanto-int2, hqq-int4, hqq-int2; ``none`` for none
                          (default: dynamic,dynamic-offload,quanto-int4,quanto-int2,hqq-int4).
    --context N           prompt tokens (default 8192: long enough that the cache, not the model, dominates).
    --new-tokens N        timed greedy decode steps (default 64).
    --quality-tokens N    held-out tokens scored by teacher-forced decoding (default 256).
    --repeats N           timed runs per setup, the fastest kept (default 3).
    --device D            cpu | cuda | cuda:N (default: cuda when available).
    --dtype T             float32 | float16 | bfloat16 (default: float32 on CPU, bfloat16 on CUDA).
    --threads N           torch CPU threads (default 1, stable timings; 0: torch's default).
    --out DIR             where bench.md, bench.json and bench.png go (default out/bench).
    --no-progress         no progress bar.
    """
    from tiercache.bench.command import main as run

    return run(argv)


__all__ = ["main"]
