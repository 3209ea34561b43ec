"""Train the tiny byte-level Llama shipped in ``tiercache/models/data/`` (deterministic; a few minutes on one core).

    python bench/train_tiny.py [--out tiercache/models/data] [--steps N]

Prints the held-out perplexity and bits/byte (stdlib files held out by name; see
``tiercache/bench/corpus.py``). The recipe lives in ``tiercache/bench/train.py`` so that the
loader can train on first use when the weights are missing.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiercache.models.train import train  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tiercache" / "models" / "data"))
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    args = p.parse_args(argv)
    meta = train(args.out, steps=args.steps)
    h = meta["heldout"]
    print(f"held-out perplexity {h['perplexity']:.3f}  bits/byte {h['bits_per_byte']:.3f}  "
          f"({h['tokens']} tokens; {meta['params']} params; trained in {meta['train_seconds']} s)")
    print(f"weights: {Path(args.out) / 'tiny-llama.safetensors'}  sha256 {meta['sha256']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
