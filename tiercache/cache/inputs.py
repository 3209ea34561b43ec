"""What a decoder-only cache is built from: a policy for a model, an ``auto`` policy planned.

    resolve(policy, model_config, batch_size=1, context_length=None) -> (Policy, ModelSpec, model_type)

``policy``: a Policy, a YAML path or a dict (``load_policy``); ``model_config``: a transformers
config or a ``ModelSpec``. An encoder-decoder config is refused (``PolicyError``): it needs
``TieredCache.for_encoder_decoder``. ``batch_size`` and ``context_length`` are only used by
``auto: true`` policies, which let the planner choose the least lossy rung that fits the budget;
without a context length the policy's ``max_length`` is planned for, else ``AUTO_CONTEXT``
tokens, and a ``UserWarning`` says so (the rung that fits them may not fit the run's context).
"""

from __future__ import annotations

import warnings

from tiercache.errors import PolicyError
from tiercache.models.spec import ModelSpec, model_type_of, spec_of
from tiercache.policy.schema import Policy, load_policy

AUTO_CONTEXT = 4096  # tokens an auto policy is planned for when neither context_length nor max_length is given


def resolve(policy, model_config, batch_size: int = 1,
            context_length: int | None = None) -> tuple[Policy, ModelSpec, str | None]:
    policy = load_policy(policy)
    model = spec_of(model_config)
    if model.cross_attention and not isinstance(model_config, ModelSpec):
        raise PolicyError(
            f"{type(model_config).__name__} is an encoder-decoder model: its layers attend to themselves and to "
            "the encoder, so it needs TieredCache.for_encoder_decoder(policy, config) (an EncoderDecoderCache "
            "of two TieredCaches)"
        )
    if policy.auto:
        from tiercache.planner.api import check_sizes, choose

        context = context_length if context_length is not None else (policy.max_length or AUTO_CONTEXT)
        if context_length is None and policy.max_length is None:
            warnings.warn(f"policy {policy.name!r} is auto: true and no context_length was given: its rung is "
                          f"chosen for {AUTO_CONTEXT} tokens; pass context_length= (the tokens the cache will "
                          "hold) or set policy.max_length", UserWarning, stacklevel=3)
        check_sizes(batch_size, context)
        policy = choose(policy, model, batch_size, context)
    return policy, model, model_type_of(model_config)
