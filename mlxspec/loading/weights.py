"""What every loader shares: the dtype argument, finishing a built model, one-line errors.

``loading``, ``gguf`` and ``commands.convert`` import these at module top; this module imports no
other mlxspec module, so there is no import cycle.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.utils import dequantize_model

DTYPES = ("float32", "float16", "bfloat16")
"""Float dtypes the loaders accept besides ``None`` (keep the checkpoint's own)."""

QUANTIZED_TYPES = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
"""Layer classes that hold MLX-quantized weights."""


def check_dtype(dtype: str | None) -> mx.Dtype | None:
    """Validate a ``dtype`` argument.

    Args:
        dtype (str | None): ``None`` or one of ``DTYPES``.

    Returns:
        mx.Dtype | None: The MLX dtype, or ``None``.

    Raises:
        ValueError: any other value.
    """
    if dtype is None:
        return None
    if dtype not in DTYPES:
        allowed = ", ".join(repr(d) for d in DTYPES)
        raise ValueError(f"dtype must be None, {allowed}; got {dtype!r}.")
    return getattr(mx, dtype)


def finish(model: nn.Module, dtype: str | None, *, lazy: bool = False) -> nn.Module:
    """Apply ``dtype``, evaluate the weights (unless ``lazy``) and put the model in eval mode.

    A float ``dtype`` dequantizes quantized layers in float32 first (so a float16 scale times a
    code adds no rounding), then casts every floating parameter to ``dtype``.

    Args:
        model (nn.Module): A freshly built mlx-lm model.
        dtype (str | None): ``None`` (keep), ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        lazy (bool): Leave the weights unevaluated (the dtype applies when they are), for a caller that
            keeps only part of the model (``sharded.shard``). Default: ``False``.

    Returns:
        nn.Module: The same model, updated in place.

    Raises:
        ValueError: bad ``dtype``.
    """
    target = check_dtype(dtype)
    if target is not None:
        if is_quantized(model):
            model.set_dtype(mx.float32)
            model = dequantize_model(model)
        model.set_dtype(target)
    if not lazy:
        mx.eval(model.parameters())
    model.eval()
    return model


def is_quantized(model: nn.Module) -> bool:
    """Whether any layer of ``model`` is quantized (``QuantizedLinear``, ``QuantizedEmbedding``,
    or mlx-lm's ``QuantizedSwitchLinear``)."""
    return any(isinstance(m, QUANTIZED_TYPES) for _, m in model.named_modules())


def one_line(e: BaseException) -> str:
    """First non-empty line of an exception message, for one-line user errors."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0].rstrip(".") if lines else type(e).__name__
