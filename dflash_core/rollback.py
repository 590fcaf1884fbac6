"""Rolling a transformers cache back after a rejected draft, for every kind of layer it holds.

``HFTarget`` verifies a block of ``T`` tokens in one forward, then keeps only the first ``keep``
of them. What that asks of each cache layer (transformers 5.x ``DynamicCache`` layer classes):

* Full attention (``DynamicLayer``): drop the last ``T - keep`` keys/values. transformers'
  ``crop`` does exactly that.
* Sliding-window attention (``DynamicSlidingWindowLayer``: gpt-oss, Mistral with a window): once
  the window is full the layer keeps only ``window - 1`` positions, so the positions a crop would
  have to bring back are gone and ``crop`` raises. transformers' own answer does the job:
  ``activate_past_recording`` makes the layer keep every position until the next ``crop``, and
  ``crop(-n)`` drops ``n`` and trims back to the window (``crop(0)`` only trims). We use it.
* Linear attention (``LinearAttentionLayer``: the Gated DeltaNet layers of Qwen3.5/3.6 and
  Qwen3-Next): a convolution state (the last few inputs) and a recurrent state (a running sum
  over *every* position). transformers' past recording only covers the convolution state: its
  ``crop`` leaves the recurrent state as the whole block made it (``is_croppable`` is False once
  one exists), and a sum cannot be cropped. So this module does it: before each forward it copies
  the layer's states (their size does not depend on the context) and, during the forward, keeps
  the inputs the layer's mixer sees; rolling back restores the copy and runs the mixer once more
  on the first ``keep`` of those inputs. The mixer input at a position depends only on the
  positions before it, so these are the inputs a forward over the kept tokens alone would feed
  it, and the states come out as that forward would leave them. Cost: one mixer pass over at
  most a block per linear layer, whatever the context (the MLPs and attention layers are not
  rerun). Replaying the mixer also rebuilds the convolution state, so recording its past as
  well would add nothing.

Rolling back reaches only into the latest forward (all the speculative loop needs), and only into
one of at most ``REPLAY_LIMIT`` tokens: longer ones are prompts, whose mixer inputs are not kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .errors import ModelLoadError

# Longest forward whose linear-attention inputs are kept for a replay. Verified blocks are a
# drafter's block (16 in the published drafters); a prompt is not kept (that would hold
# prompt_length x hidden values per linear layer).
REPLAY_LIMIT = 256
# Attribute names under which decoder layers hold their linear-attention mixer (Qwen3.5/3.6,
# Qwen3.5-MoE and Qwen3-Next call it ``linear_attn``).
MIXER_NAMES = ("linear_attn",)


def _cache_classes() -> tuple[type, type, type]:
    from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

    return CacheLayerMixin, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin


@dataclass
class _LinearState:
    """A copy of one linear-attention cache layer's states (per state index)."""

    conv: dict[int, torch.Tensor | None]
    recurrent: dict[int, torch.Tensor | None]
    has_previous: dict[int, bool]


def _clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()


def _put(states: dict[int, Any], initialized: dict[int, bool], index: int, saved: torch.Tensor | None) -> None:
    """Put ``saved`` back as state ``index``: in place when the shapes agree (the cache marks its
    tensors as static addresses for CUDA graphs), else as a new tensor; None = not started."""
    current = states.get(index)
    if saved is None:
        states[index] = None
        initialized[index] = False
    elif current is not None and current.shape == saved.shape:
        current.copy_(saved)
        initialized[index] = True
    else:
        states[index] = saved.clone()
        initialized[index] = True


class CacheRollback:
    """Checkpoints a ``DynamicCache`` before each forward and rolls it back into that forward.

    Use: ``attach(cache)`` for every new cache, ``begin(tokens)`` / ``end()`` around each forward,
    ``rollback(keep, drop)`` to keep ``keep`` tokens of the latest forward (``drop`` removed).
    """

    def __init__(self, model: torch.nn.Module, layers: list[torch.nn.Module] | None) -> None:
        from transformers import DynamicCache

        self._model = model
        self._layers = layers
        self._cache: Any = None
        self._sliding: list[Any] = []
        self._linear: dict[int, Any] = {}  # layer index -> cache layer
        self._mixers: dict[int, torch.nn.Module] = {}
        self._saved: dict[int, _LinearState] = {}
        self._inputs: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        self._capturing = False
        self._tokens = 0  # length of the latest forward
        self._open = False  # whether the latest forward can still be rolled back into
        # Find the linear layers (and their mixers) now, so an unsupported target fails at load.
        for index, layer in enumerate(self._classify(DynamicCache(config=model.config))):
            if layer is not None:
                mixer = self._find_mixer(index)
                mixer.register_forward_pre_hook(self._make_capture(index), with_kwargs=True)
                self._mixers[index] = mixer

    def _classify(self, cache: Any) -> list[Any]:
        """Per cache layer: the layer when it is linear attention, else None; refuses a layer
        that holds both kinds (its attention part could be cropped, but its linear part would
        need a replay of a mixer that also writes attention keys)."""
        attention_cls, _, linear_cls = _cache_classes()
        linear = []
        for index, layer in enumerate(cache.layers):
            is_linear = isinstance(layer, linear_cls)
            if is_linear and isinstance(layer, attention_cls):
                raise ModelLoadError(
                    f"cache layer {index} ({type(layer).__name__}) mixes linear attention and attention in one layer; "
                    "DFlash cannot roll it back after a rejected draft yet: run this target without a drafter"
                )
            linear.append(layer if is_linear else None)
        return linear

    def _find_mixer(self, index: int) -> torch.nn.Module:
        layer = self._layers[index] if self._layers is not None else None
        for name in MIXER_NAMES:
            mixer = getattr(layer, name, None)
            if isinstance(mixer, torch.nn.Module):
                return mixer
        raise ModelLoadError(
            f"decoder layer {index} of this {type(self._model).__name__} keeps a linear-attention state, but its mixer is not "
            f"one of the attributes {MIXER_NAMES}; DFlash cannot roll it back after a rejected draft"
        )

    def _make_capture(self, index: int):
        def capture(_module, args, kwargs):
            if self._capturing:
                hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                self._inputs[index] = (hidden, rest)
        return capture

    def attach(self, cache: Any) -> None:
        """Track a new cache: its sliding-window layers record their past (see the module doc)."""
        _, sliding_cls, linear_cls = _cache_classes()
        self._cache = cache
        self._sliding = [layer for layer in cache.layers if isinstance(layer, sliding_cls)]
        for layer in self._sliding:
            layer.activate_past_recording()
        self._linear = {i: layer for i, layer in enumerate(cache.layers) if isinstance(layer, linear_cls)}
        self._saved, self._inputs, self._tokens, self._open = {}, {}, 0, False

    def begin(self, tokens: int) -> None:
        """Before a forward of ``tokens`` tokens: earlier forwards can no longer be rolled back
        into, so sliding layers drop what they recorded, and linear layers' states are copied."""
        self._trim_sliding()
        self._saved = {
            i: _LinearState(
                conv={s: _clone(t) for s, t in layer.conv_states.items()},
                recurrent={s: _clone(t) for s, t in layer.recurrent_states.items()},
                has_previous=dict(layer.has_previous_state),
            )
            for i, layer in self._linear.items()
        }
        self._inputs = {}
        self._tokens = tokens
        self._open = True
        self._capturing = tokens <= REPLAY_LIMIT and bool(self._linear)

    def _trim_sliding(self) -> None:
        for layer in self._sliding:
            if layer.is_initialized:  # (transformers' crop fails on a layer never written)
                layer.crop(0)

    def end(self) -> None:
        self._capturing = False

    @torch.inference_mode()
    def rollback(self, keep: int, drop: int) -> None:
        """Keep the first ``keep`` tokens of the latest forward; ``drop`` tokens are removed from
        the attention layers (``keep + drop`` = tokens cached since that forward began)."""
        if drop <= 0:
            self._trim_sliding()
            return
        if not self._open or keep + drop > self._tokens:
            raise ValueError("a rollback reaches only into the latest forward, once")
        if self._linear and self._tokens > REPLAY_LIMIT:
            raise ValueError(f"cannot roll back into a forward of {self._tokens} tokens: linear-attention layers keep "
                             f"their inputs for a replay only up to {REPLAY_LIMIT} tokens")
        _, _, linear_cls = _cache_classes()
        for layer in self._cache.layers:
            if not isinstance(layer, linear_cls) and getattr(layer, "is_initialized", True):
                layer.crop(-drop)  # transformers 5: a negative count is tokens to remove
        for index, layer in self._linear.items():
            self._restore(layer, self._saved[index])
            if keep:
                hidden, kwargs = self._inputs[index]
                kwargs = dict(kwargs)
                mask = kwargs.get("attention_mask")
                if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                    kwargs["attention_mask"] = mask[:, :keep]
                self._mixers[index](hidden_states=hidden[:, :keep], **kwargs)
        # A second rollback into the same forward would need positions the sliding layers have
        # just trimmed away.
        self._open = False

    @staticmethod
    def _restore(layer: Any, saved: _LinearState) -> None:
        for index in saved.has_previous:
            _put(layer.conv_states, layer.is_conv_states_initialized, index, saved.conv.get(index))
            _put(layer.recurrent_states, layer.is_recurrent_states_initialized, index, saved.recurrent.get(index))
            layer.has_previous_state[index] = saved.has_previous[index]
