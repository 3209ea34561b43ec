"""``PackedKV``: what a quantized layer's decode step returns instead of dequantized K/V.

    keys, values = packed_pair(packed, materialize, key_shape, value_shape, dtype, device)
    keys, values = decode_pair(layer, blocks, new, visible)   # a Quantize layer's decode step as such a pair

How a decode step reads packed codes without the model knowing (the design, and why). The model
calls ``cache.update(k, v, i)`` and then runs its own attention on what comes back; transformers'
default ``sdpa`` attention passes the K/V it got to ``torch.nn.functional.scaled_dot_product_attention``
(with ``enable_gqa``, or with the query folded onto the K/V heads when a mask is given). So on a
decode step (few new tokens) a ``Quantize`` layer with ``packed_attention`` returns two
``PackedKV``: tensor subclasses with the shape, dtype and device of the K/V it would have
returned, holding no data, only the ``packed_attention.Packed`` parts (sinks, packed rows, exact
tail). Their ``__torch_function__``:

- ``scaled_dot_product_attention(q, keys, values, ...)`` with both of one pair, no dropout and
  no causal flag over several queries: computed from the codes (``packed_attention.attend``);
- shape, dtype, device and other metadata: answered, nothing computed;
- anything else (``repeat_kv`` of eager attention, a model that reads its K/V, another
  attention kernel): both are materialized once, by the layer's own dequantize-into-workspace
  path (the reference), and the op runs on those tensors: the same results, at that path's cost.

So no model code, no attention registration and no user action is needed, and a model that does
something else with its K/V still gets the right numbers. The values are valid as the workspace
is: until the next update on the cache. Prefill (many new tokens) keeps returning plain tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiercache.quantize.packed_attention import Packed, attend

__all__ = ["PackedKV", "decode_pair", "packed_pair"]

_META = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
         torch.Tensor.ndim.__get__, torch.Tensor.dim, torch.Tensor.size, torch.Tensor.requires_grad.__get__,
         torch.Tensor.is_cuda.__get__, torch.Tensor.layout.__get__, torch.Tensor.__len__,
         torch.Tensor.is_floating_point, torch.Tensor.element_size, torch.Tensor.is_sparse.__get__,
         torch.Tensor.is_quantized.__get__, torch.Tensor.is_meta.__get__, torch.Tensor.grad_fn.__get__,
         torch.Tensor.is_nested.__get__, torch.Tensor.numel}


class _Pair:
    """The shared half of a keys / values pair: the parts, and the materialized tensors once made."""

    def __init__(self, packed: Packed, materialize):
        self.packed, self._materialize, self.plain = packed, materialize, None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.plain is None:
            self.plain = self._materialize()
        return self.plain


class PackedKV(torch.Tensor):
    @staticmethod
    def __new__(cls, pair: _Pair, which: int, shape, dtype, device):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        t.pair, t.which = pair, which
        return t

    def __init__(self, *args, **kwargs):
        pass

    def plain(self) -> torch.Tensor:
        """The dequantized tensor this one stands for (made once per pair)."""
        return self.pair.tensors()[self.which]

    def __repr__(self) -> str:
        return f"PackedKV({'keys' if self.which == 0 else 'values'}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            out = _sdpa(*args, **kwargs)
            if out is not None:
                return out
        args, kwargs = torch.utils._pytree.tree_map(_plain, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """Below autograd (an op that reached dispatch without passing ``__torch_function__``): the plain tensors."""
        args, kwargs = torch.utils._pytree.tree_map(_plain, (args, kwargs or {}))
        return func(*args, **kwargs)


def _plain(x):
    return x.plain() if isinstance(x, PackedKV) else x


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Packed attention where it computes exactly what SDPA would; None: fall back."""
    if not (isinstance(key, PackedKV) and isinstance(value, PackedKV) and key.pair is value.pair
            and key.which == 0 and value.which == 1) or isinstance(query, PackedKV):
        return None
    if dropout_p or (is_causal and query.shape[2] > 1) or query.dim() != 4 or query.shape[0] != key.shape[0]:
        return None
    if query.shape[1] != key.shape[1] and not enable_gqa:
        return None
    if attn_mask is not None and (attn_mask.dim() != 4 or attn_mask.shape[-1] != key.shape[2]):
        return None
    return attend(query, key.pair.packed, attn_mask, scale)


def packed_pair(packed: Packed, materialize, key_shape, value_shape, dtype, device) -> tuple[PackedKV, PackedKV]:
    """Keys and values standing for ``materialize()``'s pair, attended from ``packed`` where SDPA reads them."""
    pair = _Pair(packed, materialize)
    return PackedKV(pair, 0, key_shape, dtype, device), PackedKV(pair, 1, value_shape, dtype, device)


def decode_pair(layer, blocks, new, visible: int | None):
    """A ``Quantize`` layer's decode step (``tiercache.quantize.processor``) as a ``PackedKV`` pair:
    its visible packed ``blocks`` (``layer._visible``), its sinks, then the exact tail (residual,
    ``new`` tokens); materializing gives ``layer._assemble``'s tensors, made on first use in the
    shared workspace: only a step that falls back reserves it. A window that left no block gets
    those plain tensors at once, fresh (small: the window)."""
    s, res = layer.spec, (layer.residual.view() if len(layer.residual) else None)
    shown, n, skip = layer._visible(blocks, len(layer.residual), new[0].shape[2], visible)
    if not n:  # the window left no block (then ``skip`` may reach the exact tail): plain tensors
        return layer._assemble(blocks, new, visible, workspace=False)
    tail = [part for part in (res, new) if part is not None and part[0].shape[2]]  # skip < G: in the blocks
    sinks = layer.sinks.view() if len(layer.sinks) else None
    rows = tuple(r if r.device == s.device else r.to(s.device, non_blocking=True) for r in shown)
    packed = Packed(sinks, rows, skip, tail, layer.codecs)
    size = packed.length  # [B, H, size, D]: what _assemble would return
    return packed_pair(packed, lambda: layer._assemble(blocks, new, visible, residual=res),
                       (s.batch, s.heads, size, s.key_dim), (s.batch, s.heads, size, s.value_dim), s.dtype, s.device)
