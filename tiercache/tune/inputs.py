"""What ``tune`` and ``check`` both start from.

Interface
    UNIFORM_NAMES                  ``--budget`` words for a uniform format's bytes: int8, int4, int2
    setup(args) -> (model, tokenizer, [calibration ids, verification ids], text source)
        ``args.model`` loaded, ``args.text`` (or the built-in text) cut into two disjoint windows of
        ``args.context`` tokens; a ``ValueError`` whose message names the flag when it cannot be
"""

from __future__ import annotations

UNIFORM_NAMES = {"int8": 8, "int4": 4, "int2": 2}


def setup(args):
    """(model, tokenizer, [calibration ids, verification ids], text source) or an error message."""
    import torch

    from tiercache.models.load import ModelLoadError, load_model
    from tiercache.tune.text import TextError, windows

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.stretch >= args.context:
        raise ValueError(f"--stretch {args.stretch} must be below --context {args.context} (a prefix comes first)")
    try:
        model, tok = load_model(args.model)
    except ModelLoadError as e:
        raise ValueError(str(e)) from None
    try:
        wins, source = windows(tok, args.text, args.context, 2)
    except TextError as e:
        raise ValueError(str(e)) from None
    return model, tok, wins, source
