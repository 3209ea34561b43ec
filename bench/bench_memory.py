"""Planned vs measured peak memory of ``tiercache generate``, per policy.

    python bench/bench_memory.py                       # CPU: 8-layer random Llama, 32k tokens
    python bench/bench_memory.py --context 512 --hidden 64 --vocab 512   # a quick smoke run

What it does:
1. writes a random-weight Llama-shaped model (``--layers`` 8, ``--hidden`` ...) with a byte-level
   tokenizer (one token per character) into a temporary directory, and a prompt file of
   ``context - new`` characters (= tokens);
2. measures the runtime baseline: the peak RSS of a Python process that imports what
   ``tiercache generate`` imports (torch, transformers, the Llama model code, tokenizers,
   tiercache) and nothing else;
3. per policy, runs ``python -m tiercache.cli generate --model DIR --prompt-file F --policy P``
   in a child process and reads the child's peak RSS (``ru_maxrss`` from ``os.wait4``); on
   ``--device cuda`` the child reports ``torch.cuda.max_memory_allocated`` instead;
4. plans the same run with ``tiercache.plan(policy, DIR, context=..., device=..., runtime=baseline)``
   (weights from the config's shapes) and prints planned vs measured, the ratio, and whether it is
   within 10%; writes ``memory.json`` and ``memory.png`` under ``--out`` (default ``out/``).

``--device cuda``: the same model in bf16 on the GPU, each policy run in this process
(``tiercache.generate`` with the plan's chunk), measured by ``torch.cuda.max_memory_allocated``
against the plan's allocated total (every line but ``runtime``: the CUDA context is not a
PyTorch allocation).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLICIES = ["default", "int4-kivi", "offload-cpu", "tiered-int4-offload"]
BASELINE = """
import resource, sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
import tiercache.cli, tiercache.cache.tiered, tiercache.cache.prefill, tiercache.planner.api, tiercache.models.tiny
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def write_model(d: Path, args) -> None:
    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(d)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.context * 2,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(d)


def child_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               TOKENIZERS_PARALLELISM="false")
    return env


LAUNCH = """
import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(p.pid, 0)
print(f"MAXRSS {usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}", file=sys.stderr)
"""


def run_child(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd``; (its peak RSS in bytes, its stdout).

    A child's ``ru_maxrss`` starts from its parent's resident set at fork time (Linux keeps the
    high-water mark across ``exec``), so the command is started by a small launcher process
    (about 10 MiB), not by this one (torch and transformers loaded), and the launcher reports
    ``os.wait4``'s figure for it."""
    proc = subprocess.run([sys.executable, "-c", LAUNCH, *cmd], capture_output=True, text=True, env=child_env())
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    if not last.startswith("MAXRSS") or last.split()[2] != "0":
        raise SystemExit(f"child failed: {' '.join(cmd[:8])} ...\n{proc.stderr[-3000:]}")
    return int(last.split()[1]) * 1024, proc.stdout


def measure(args, model_dir: Path, prompt_file: Path, policy: str) -> int:
    cmd = [sys.executable, "-m", "tiercache.cli", "generate", "--model", str(model_dir), "--policy",
           str(ROOT / "configs" / f"{policy}.yaml"), "--prompt-file", str(prompt_file),
           "--max-new-tokens", str(args.new)]
    if args.chunk:
        cmd += ["--prefill-chunk", str(args.chunk)]
    rss, out = run_child(cmd)
    if "memory:" not in out:
        raise SystemExit(f"tiercache generate printed no memory line:\n{out[-2000:]}")
    return rss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32768, help="prompt + new tokens")
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: the plan's)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", default="out")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args(argv)
    if args.device == "cuda":
        return main_cuda(args)

    import tiercache

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompt_file = Path(tmp) / "model", Path(tmp) / "prompt.txt"
        write_model(model_dir, args)
        rnd = random.Random(0)
        prompt_file.write_text("".join(rnd.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(args.context - args.new)))
        baseline, _ = run_child([sys.executable, "-c", BASELINE])
        print(f"device cpu, torch threads {child_env()['OMP_NUM_THREADS']}; model: {args.layers} layers, hidden "
              f"{args.hidden}, {args.heads} heads / {args.kv_heads} KV heads of {args.hidden // args.heads}, MLP "
              f"{args.intermediate}, vocab {args.vocab}, fp32; context {args.context} tokens "
              f"({args.context - args.new} prompt + {args.new} new)")
        print(f"runtime baseline (peak RSS of a process importing what tiercache generate imports): "
              f"{baseline / 2**20:.1f} MiB\n")
        for name in args.policies.split(","):
            p = tiercache.plan(str(ROOT / "configs" / f"{name}.yaml"), str(model_dir), 1, args.context,
                               device="cpu", prefill_chunk=args.chunk, runtime=baseline)
            measured = measure(args, model_dir, prompt_file, name)
            planned = sum(p.whole.total.values())
            lines = {f"{x.name} ({x.tier})": x.bytes for x in p.whole.lines}
            rows.append({"policy": name, "planned": planned, "measured": measured, "ratio": measured / planned,
                         "chunk": p.prefill_chunk, "lines": lines})
            print(f"  {name}: planned {planned / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB", flush=True)
    print()
    print("| policy | prefill chunk | planned | measured peak RSS | measured / planned | within 10% |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ok = abs(r["ratio"] - 1) <= 0.10
        print(f"| {r['policy']} | {r['chunk']} | {r['planned'] / 2**20:.1f} MiB | {r['measured'] / 2**20:.1f} MiB | "
              f"{r['ratio']:.3f} | {'yes' if ok else 'NO'} |")
    print("\nplanned lines (MiB):")
    for r in rows:
        print(f"  {r['policy']}: " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r["lines"].items()))
    report = {"device": "cpu", "context": args.context, "baseline": baseline, "args": vars(args), "rows": rows}
    (out_dir / "memory.json").write_text(json.dumps(report, indent=2))
    plot(rows, out_dir / "memory.png", args.context)
    print(f"\nwrote {out_dir / 'memory.json'} and {out_dir / 'memory.png'}")
    return 0


def main_cuda(args) -> int:
    """Planned (allocated) vs ``torch.cuda.max_memory_allocated`` per policy, in this process."""
    import torch
    from transformers import AutoModelForCausalLM

    import tiercache

    if not torch.cuda.is_available():
        print("bench_memory: error: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 1
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), args)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).to("cuda").eval()
    ids = torch.randint(3, 90, (1, args.context - args.new), device="cuda")  # [1, T]
    print(f"device {torch.cuda.get_device_name()}; model as on the CPU run, bf16; context {args.context}")
    for name in args.policies.split(","):
        policy = ROOT / "configs" / f"{name}.yaml"
        p = tiercache.plan(policy, model, 1, args.context, device="cuda", prefill_chunk=args.chunk)
        cache = tiercache.TieredCache.from_policy(policy, model.config)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        tiercache.generate(model, ids, cache, prefill_chunk=p.prefill_chunk, max_new_tokens=args.new,
                           min_new_tokens=args.new, do_sample=False)
        torch.cuda.synchronize()
        measured, planned = torch.cuda.max_memory_allocated(), p.whole.allocated("device")
        rows.append({"policy": name, "planned": planned, "measured": measured, "ratio": measured / planned,
                     "chunk": p.prefill_chunk, "lines": {f"{x.name} ({x.tier})": x.bytes for x in p.whole.lines}})
        del cache
    print("| policy | prefill chunk | planned (allocated) | max_memory_allocated | measured / planned | within 10% |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['chunk']} | {r['planned'] / 2**20:.1f} MiB | {r['measured'] / 2**20:.1f} MiB | "
              f"{r['ratio']:.3f} | {'yes' if abs(r['ratio'] - 1) <= 0.10 else 'NO'} |")
    (out_dir / "memory-cuda.json").write_text(json.dumps({"device": "cuda", "rows": rows}, indent=2))
    plot(rows, out_dir / "memory-cuda.png", args.context)
    return 0


def plot(rows, path: Path, context: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["policy"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], [r["planned"] / 2**20 for r in rows], 0.4, label="planned total")
    ax.bar([i + 0.2 for i in x], [r["measured"] / 2**20 for r in rows], 0.4, label="measured peak RSS")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("MiB")
    ax.set_title(f"tiercache generate, {context} tokens: planned vs measured")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
