"""An encoder-decoder model's cache: transformers' ``EncoderDecoderCache`` over two tiered halves.

    EncoderDecoderPair(self_attention_cache, cross_attention_cache)
        retier(policy) / save(path, token_ids) / load(path, model_config, ...)   both halves, all or nothing
        nbytes() (both halves)   cross_nbytes()   to_legacy()   close()   token_ids

A subclass names its halves' classes in ``halves`` (``TieredEncoderDecoderCache`` in
``tiercache.cache.tiered``: ``TieredCache`` and its cross-attention half), so that this module
needs neither: ``TieredCache.for_encoder_decoder`` builds the pair there, and ``load`` builds
the halves of a save by those classes. transformers allows ``crop`` / ``batch_select_indices`` /
``batch_repeat_interleave`` only over two DynamicCaches; the tiered halves support them too
(assisted decoding crops the self-attention half), so ``check_dynamic_cache`` lets them through.
"""

from __future__ import annotations

from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from tiercache.cache import accounting
from tiercache.errors import CacheError
from tiercache.models.spec import model_type_of, spec_of
from tiercache.planner.cross_attention import check_supported


class EncoderDecoderPair(EncoderDecoderCache):
    """transformers' ``EncoderDecoderCache`` over two tiered halves; ``nbytes()`` and ``close()``
    cover both, ``cross_nbytes()`` is the cross-attention part; ``retier`` / ``save`` / ``load``
    cover both too (``tiercache.lifecycle``)."""

    halves: tuple[type, type] = ()  # (self-attention class, cross-attention class): named by the subclass

    def retier(self, policy) -> None:
        """Self-attention per ``policy``, cross-attention per its ``cross_attention`` section, all or nothing."""
        from tiercache.cache.retier import retier_all

        retier_all([self.self_attention_cache, self.cross_attention_cache], policy)

    def save(self, path, token_ids=None) -> None:
        from tiercache.lifecycle.persist import save

        save(self.self_attention_cache, path, token_ids, self.cross_attention_cache, self.is_updated)

    @classmethod
    def load(cls, path, model_config, *, policy=None, device=None, offload_path=None, max_bytes=None):
        """An encoder-decoder save, for this model; the keywords as ``TieredCache.load``."""
        from tiercache.cache import retier
        from tiercache.lifecycle import persist

        check_supported(model_config)
        self_cls, cross_cls = cls.halves
        this, cross, flags = persist.load(self_cls, path, spec_of(model_config), model_type_of(model_config),
                                          device, cross_cls, offload_path, max_bytes)
        cache = cls(this, cross)
        cache.is_updated = flags
        return retier.retiered(cache, policy)

    @property
    def token_ids(self) -> list | None:
        return self.self_attention_cache.token_ids  # as TieredCache.token_ids: given to save, set by load

    def check_dynamic_cache(self, method: str) -> None:
        for half in (self.self_attention_cache, self.cross_attention_cache):
            if not isinstance(half, (self.halves[0], DynamicCache)):
                raise CacheError(f"{method}: needs TieredCache or DynamicCache halves, got {type(half).__name__}")

    def nbytes(self) -> dict[str, int]:
        """Bytes held now by both halves, per place (``cpu``, ``cuda:0``, ``disk`` ...)."""
        return accounting.summed([self.self_attention_cache.nbytes(), self.cross_nbytes()])

    def cross_nbytes(self) -> dict[str, int]:
        return self.cross_attention_cache.nbytes()

    def to_legacy(self) -> tuple:
        """Per layer ``(self key, self value, cross key, cross value)`` at full precision, fresh
        tensors (``()`` when empty); ``TieredCache.from_legacy`` takes it back."""
        from tiercache.cache import legacy

        return legacy.join(self.self_attention_cache.to_legacy(), self.cross_attention_cache.to_legacy(),
                           len(self.self_attention_cache.layers))

    def close(self) -> None:
        self.self_attention_cache.close()
        self.cross_attention_cache.close()
