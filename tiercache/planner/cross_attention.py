"""Cross-attention layers of encoder-decoder models: what the policy gives them.

    check_supported(model_config)
        ``PolicyError`` for the model types in ``UNSUPPORTED`` (T5Gemma, T5Gemma 2), saying why.
    cross_layer_policies(policy, model) -> list[LayerPolicy]
        one per decoder layer of ``model`` (a ``ModelSpec`` with ``cross_attention``), from the
        policy's optional ``cross_attention:`` section (``CrossAttentionPolicy``): ``quantize``
        and ``offload`` as for any layer, default full precision on the compute device.

The cross-attention K/V of a layer are written once, from the whole encoder output, then only
read (``tiercache.layers.cross``), so they always use ``full`` storage (their length is the
encoder's, known only at the first step): the policy's ``storage`` / ``max_length`` /
``overrides`` are for the decoder's self-attention layers. Their ``layer_type`` is
``"cross_attention"``, which the chain builder wraps in ``CrossAttention`` and the planner shows.
"""

from __future__ import annotations

from tiercache.errors import PolicyError
from tiercache.models.spec import ModelSpec
from tiercache.policy.schema import CrossAttentionPolicy, LayerPolicy, Policy

CROSS_ATTENTION = "cross_attention"
# model_type -> why a tiered cross-attention half cannot be served (TieredCache.for_encoder_decoder refuses)
UNSUPPORTED = {
    name: "its generate() replaces the cross-attention cache by one it builds itself (type(cache)(config=...)), "
          "which would drop the policy's cross_attention section"
    for name in ("t5gemma", "t5gemma2")
}


def check_supported(model_config) -> None:
    model_type = getattr(model_config, "model_type", None)
    if model_type in UNSUPPORTED:
        raise PolicyError(f"{model_type} is not supported by TieredCache.for_encoder_decoder: {UNSUPPORTED[model_type]}")


def cross_layer_policies(policy: Policy, model: ModelSpec) -> list[LayerPolicy]:
    if not model.cross_attention:
        raise PolicyError(
            f"model {model.name} is decoder-only (its config has no is_encoder_decoder): it has no cross-attention "
            "to cache; use TieredCache.from_policy for it"
        )
    section = policy.cross_attention or CrossAttentionPolicy()
    return [LayerPolicy(i, CROSS_ATTENTION, "full", None, None, section.quantize, section.offload)
            for i in range(model.num_layers)]
