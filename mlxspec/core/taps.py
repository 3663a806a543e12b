"""Read a target's hidden states during its ordinary forward, for any mlx-lm model.

Head drafters need the final normalised hidden state (the input of the LM head:
Medusa, EAGLE-1/2) or the residual stream entering chosen layers (EAGLE-3). Instead
of copying model code, a tap wraps a module of the loaded model — the final norm, or
entries of ``model.model.layers`` — and records what passes through, so the one
forward that verifies a draft also yields the features.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class _Recorder(nn.Module):
    """Calls the wrapped module and keeps its output and/or input for the tap to read."""

    def __init__(self, inner: nn.Module, sink: dict, output_key=None, input_key=None):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_sink", sink)  # plain attributes: not parameters
        object.__setattr__(self, "_keys", (output_key, input_key))

    def __call__(self, x, *args, **kwargs):
        out = self.inner(x, *args, **kwargs)
        output_key, input_key = self._keys
        if output_key is not None:
            self._sink[output_key] = out
        if input_key is not None:
            self._sink[input_key] = x
        return out

    def __getattr__(self, name):
        if name != "inner" and "inner" in self:  # e.g. a tied embedding's as_linear
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self["inner"], name)
        return super().__getattr__(name)


def model_body(model: nn.Module) -> nn.Module:
    """The decoder stack of an mlx-lm model (``model.model``: ``embed_tokens``, ``layers``, ``norm``).

    Raises:
        ValueError: if the model has no ``model.norm`` / ``model.layers``.
    """
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "norm") or not hasattr(body, "layers"):
        raise ValueError(
            f"{type(model).__name__} has no model.norm / model.layers to read hidden states from; "
            "head drafters support mlx-lm decoder models (llama, mistral, qwen2/3, gemma, ...)"
        )
    return body


class HiddenTap:
    """Records the final normalised hidden state of every forward of ``model``.

    Installing is idempotent and leaves the model's outputs unchanged.

    Args:
        model: An mlx-lm model with ``model.model.norm``.
        layers: Also record the inputs of these decoder layers (0-based), for EAGLE-3 and DFlash;
            index N (the layer count) is the final norm's input, i.e. the last layer's output.

    Raises:
        ValueError: if the model has no ``model.norm`` / ``model.layers``.
    """

    def __init__(self, model: nn.Module, layers: tuple[int, ...] = ()):
        body = model_body(model)
        self.layers = tuple(layers)
        N = len(body.layers)
        bad = [i for i in self.layers if not 0 <= i <= N]
        if bad:
            raise ValueError(f"cannot tap the input of layer(s) {bad}: the target has {N} decoder layers")
        self.sink: dict = {}
        if isinstance(body.norm, _Recorder):
            self.sink = body.norm._sink
        else:
            body.norm = _Recorder(body.norm, self.sink, output_key="final", input_key=N)
        for i in self.layers:
            if i < N and not isinstance(body.layers[i], _Recorder):
                body.layers[i] = _Recorder(body.layers[i], self.sink, input_key=i)

    @property
    def final(self) -> mx.array:
        """Final normalised hidden state of the last forward, shape [B, T, H]."""
        return self.sink["final"]

    def features(self) -> mx.array:
        """What a head drafter reads from the last forward: the final normalised hidden state
        [B, T, H], or with ``layers`` the inputs of those layers concatenated in the given order,
        [B, T, len(layers) * H] (EAGLE-3's low/mid/high feature)."""
        if not self.layers:
            return self.final
        return mx.concatenate([self.sink[i] for i in self.layers], axis=-1)

    def layer_input(self, i: int) -> mx.array:
        """Residual stream entering layer ``i`` in the last forward (``i`` = N: leaving the last
        layer, before the final norm), shape [B, T, H]."""
        return self.sink[i]


def output_head(model: nn.Module):
    """The target's LM head as a function hidden [..., H] -> logits [..., V] (tied or not)."""
    if getattr(model, "lm_head", None) is not None:
        return model.lm_head
    return model_body(model).embed_tokens.as_linear


def logits_width(model: nn.Module) -> int:
    """V, the width of a model's logits (its config's vocab size, or one probe forward)."""
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    return size if size else model(mx.array([[0]]))[0].shape[-1]


def head_slice(model: nn.Module, ids: mx.array):
    """The LM head restricted to rows ``ids``, as a function hidden [..., H] -> logits [..., N].

    A quantized head stays quantized (the rows of its packed weight, scales and biases, multiplied by
    ``mx.quantized_matmul``), so a 4-bit draft model's reduced head costs N/V of its whole head, not a
    dequantized copy (FR-Spec, arXiv 2502.14856: the head is most of a
    small draft model's step when the vocabulary is large). Tied heads slice the embedding.

    Args:
        model: An mlx-lm model.
        ids: Token ids, [N] int32.

    Returns:
        The function, or ``None`` for a head it cannot slice (one with a bias, or another class).
    """
    head = getattr(model, "lm_head", None)
    if head is None:
        head = model_body(model).embed_tokens
    elif "bias" in head:
        return None
    if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        weight, scales = head["weight"][ids], head["scales"][ids]
        biases = head["biases"][ids] if "biases" in head else None
        mx.eval(weight, scales, *([] if biases is None else [biases]))
        settings = {"group_size": head.group_size, "bits": head.bits, "mode": getattr(head, "mode", "affine")}
        return lambda h: mx.quantized_matmul(
            h, weight, scales=scales, biases=biases, transpose=True, **settings
        )
    if isinstance(head, (nn.Linear, nn.Embedding)):
        weight = head.weight[ids]
        mx.eval(weight)
        return lambda h: h @ weight.T
    return None
