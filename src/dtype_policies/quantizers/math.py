"""Quantization math, with Keras 3's conventions (pure functions on tensors).

* int8 and per-channel int4 are symmetric abs-max: `scale = qmax / (max|x| + eps)`,
  `q = clip(round(x * scale), qmin, qmax)`, and `x ≈ q / scale` (Keras's
  "scale" is the inverse step).
* Grouped int4 is asymmetric with a zero point, per group of `block_size`
  input rows: `scale = (max - min) / 15`, `q = clip(round(x / scale + zero), -8, 7)`
  and `x ≈ (q - zero) * scale`, with an integer zero point `round(-min / scale) - 8`
  (0 exact) or a real-valued one `-min / scale - 8` (see
  `grouped_quantize_with_zero_point`).
* float8 is quantize-dequantize: `x ≈ fp8(x / scale) * scale` with
  `scale = amax / fp8_max`, amax taken from a history of past maxima (delayed
  scaling) or from the tensor itself (dynamic scaling).
"""

from __future__ import annotations

import torch

from dtype_policies._compat import compiling
from dtype_policies._dtypes import standardize_dtype, to_torch_dtype

EPSILON = 1e-7
INT8_RANGE = (-127, 127)
INT4_RANGE = (-8, 7)
FLOAT8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
FLOAT8_E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)  # 57344


def abs_max_quantize(
    inputs: torch.Tensor,
    axis: int | tuple[int, ...],
    value_range: tuple[int, int] = INT8_RANGE,
    dtype: torch.dtype | str = torch.int8,
    epsilon: float = EPSILON,
    to_numpy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric abs-max quantization reducing over `axis`.

    Returns `(q, scale)`: `q` (`dtype`, int8 by default) in `value_range`, `scale`
    (`axis` kept with size 1) such that `x ≈ q / scale`. The scale is in the
    input's floating dtype (float32 for other inputs), as Keras's; it is
    computed in float32 and `q` uses it as returned. `to_numpy` (Keras's
    memory hint) changes nothing here. Arguments as Keras's (names and order;
    `dtype` also as a name: `"int8"`).

    >>> import torch
    >>> q, scale = abs_max_quantize(torch.tensor([[0.5, -1.0], [2.0, 0.25]]), axis=-1)
    >>> q
    tensor([[  63, -127],
            [ 127,   16]], dtype=torch.int8)
    >>> torch.allclose(q / scale, torch.tensor([[0.5, -1.0], [2.0, 0.25]]), atol=0.01)
    True
    """
    dtype = _torch_dtype(dtype)
    x32 = inputs.float()
    qmax = float(value_range[1])
    # a true division, as Keras's: `qmax / tensor` is torch's reciprocal
    # times qmax, one rounding more (1 ulp off in a quarter of the scales)
    scale = torch.div(x32.new_tensor(qmax), x32.abs().amax(dim=axis, keepdim=True) + epsilon)
    if inputs.is_floating_point() and inputs.dtype != torch.float32:
        scale = scale.to(inputs.dtype)
    q = torch.round(x32 * scale.float()).clamp_(value_range[0], value_range[1]).to(dtype)
    return q, scale


def abs_max_quantize_blocks(
    w_nk: torch.Tensor,
    block_size: int,
    value_range: tuple[int, int] = INT8_RANGE,
    epsilon: float = EPSILON,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`abs_max_quantize` of an (N, K) matrix per block of `block_size`
    consecutive inputs of each row (a last, shorter block uses its own
    values): `(q, scale)` with `q` (N, K) int8 and `scale` (N, ceil(K /
    block_size)) float32, `w_nk ≈ q / expand_blocks(scale, block_size, K)`.

    >>> import torch
    >>> q, scale = abs_max_quantize_blocks(torch.tensor([[1.0, -0.5, 4.0]]), 2)
    >>> q.tolist(), scale.shape
    ([[127, -63, 127]], torch.Size([1, 2]))
    """
    n, k = w_nk.shape
    blocks = -(-k // block_size)
    w = w_nk.float()
    padded = torch.nn.functional.pad(w, (0, blocks * block_size - k))
    _, scale = abs_max_quantize(
        padded.view(n, blocks, block_size), -1, value_range, epsilon=epsilon
    )
    scale = scale.view(n, blocks)
    # `q` from each input's scale by an index, not the padded blocks sliced
    # back to k (which torch 2.13's Inductor miscompiles: `expand_blocks`)
    per_input = expand_blocks(scale, block_size, k)
    q = torch.round(w * per_input).clamp_(value_range[0], value_range[1]).to(torch.int8)
    return q, scale


def expand_blocks(per_block: torch.Tensor, block_size: int, k: int, dim: int = -1) -> torch.Tensor:
    """(..., blocks) values repeated over their blocks' inputs: (..., k)
    (along `dim`).

    By an index, not `repeat_interleave(...)[..., :k]`: torch 2.13's Inductor
    (CPU) miscompiles a slice cutting into repeated or expanded blocks (reads
    out of bounds: int8 products of 1e37 where K is not a multiple of 32).

    >>> expand_blocks(torch.tensor([[1.0, 2.0]]), 2, 3).tolist()
    [[1.0, 1.0, 2.0]]
    """
    index = torch.arange(k, device=per_block.device) // block_size
    return per_block.index_select(dim, index)


def block_abs_max(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """(M, K) → (M, K): each input's block's largest magnitude, blocks of
    `block_size` consecutive inputs (the last may be shorter).

    The whole blocks by a view, the short last block on its own, joined:
    torch 2.13's Inductor (CPU) miscompiles the padded view at one row
    (`pad → view(M, blocks, block) → amax`, then each input's block by an
    index: uninitialised reads, outputs of 1e21 to 1e36 at K = 33, 40, 100).

    >>> block_abs_max(torch.tensor([[1.0, -3.0, 2.0]]), 2).tolist()
    [[3.0, 3.0, 2.0]]
    """
    m, k = values.shape
    whole = k // block_size * block_size
    magnitudes = values.abs()
    parts = []
    if whole:
        per_block = magnitudes[:, :whole].reshape(m, whole // block_size, block_size)
        parts.append(per_block.amax(-1, keepdim=True).expand(-1, -1, block_size).reshape(m, whole))
    if whole < k:
        parts.append(magnitudes[:, whole:].amax(-1, keepdim=True).expand(-1, k - whole))
    return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


def grouped_quantize_with_zero_point(
    kernel: torch.Tensor,
    block_size: int,
    epsilon: float = EPSILON,
    value_range: tuple[int, int] = INT4_RANGE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 quantization of a `(rows, columns)` matrix in groups of
    `block_size` rows (the contracting axis): Keras's grouped convention
    `kernel ≈ (q - zero[g]) * scale[g]`, with a real-valued zero point.

    Each group's grid spans exactly its own values, `scale = (max - min) / 15`
    (a last, shorter group uses its own rows; nothing is padded in), and its
    zero point is chosen by one rule:

    * a group with values on both sides of 0 gets the integer zero point
      `round(-min / scale) - 8`, so that 0 is exactly a grid value: trained
      weights crowd around 0, and the largest activations of a transformer
      meet weights near 0 (measured on SmolLM2-135M at block 128, perplexity
      31.5 against 37.6-38.4 for a real-valued zero);
    * a group whose values all share one sign, or that already lies on its
      min/max grid (a checkpoint that was quantized before, such as a GGUF's
      Q4_1 blocks), gets the real-valued zero point `-min / scale - 8`, so
      that its range is used whole and such a grid is reproduced exactly.

    Returns `(q, scale, zero)`: `q` int8 in [-8, 7] of shape `(rows, columns)`,
    `scale` and `zero` float32 of shape `(groups, columns)`. Another
    `value_range` (`(-2, 1)` for 2 bits, ...) applies the same rule to its
    levels.

    >>> import torch
    >>> w = torch.linspace(-1, 1, 8).reshape(4, 2)
    >>> q, scale, zero = grouped_quantize_with_zero_point(w, block_size=2)
    >>> q.shape, scale.shape, zero.dtype
    (torch.Size([4, 2]), torch.Size([2, 2]), torch.float32)
    >>> error = (dequantize_grouped(q, scale, zero, 2) - w).abs()
    >>> bool((error <= scale.repeat_interleave(2, dim=0) / 2 + 1e-6).all())
    True
    >>> block = -0.053 + 0.01 * torch.tensor([[0.0], [3.0], [15.0], [7.0]])  # Q4_1-style
    >>> restored = dequantize_grouped(*grouped_quantize_with_zero_point(block, 4), 4)
    >>> torch.allclose(restored, block, rtol=0, atol=1e-8)
    True
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive integer. Received: {block_size}")
    rows, columns = kernel.shape
    kernel = kernel.float()
    whole = rows - rows % block_size
    parts = []
    if whole:
        blocks = kernel[:whole].reshape(-1, block_size, columns)
        parts.append(_grid_groups(blocks, epsilon, value_range))
    if whole < rows:
        blocks = kernel[whole:].reshape(1, rows - whole, columns)
        parts.append(_grid_groups(blocks, epsilon, value_range))
    q = torch.cat([p[0].reshape(-1, columns) for p in parts])
    scale = torch.cat([p[1] for p in parts])
    zero = torch.cat([p[2] for p in parts])
    return q, scale, zero


_ON_GRID_TOLERANCE = 0.01  # in steps: float32 noise of a dequantized 16-level grid


def _grid_groups(
    blocks: torch.Tensor, epsilon: float, value_range: tuple[int, int] = INT4_RANGE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`grouped_quantize_with_zero_point` of `(groups, size, columns)` blocks."""
    qmin, qmax = value_range
    minimum = blocks.amin(dim=1)
    maximum = blocks.amax(dim=1)
    magnitude = torch.maximum(minimum.abs(), maximum.abs())
    spread = maximum - minimum
    # A (nearly) constant group: a grid of one value's magnitude reproduces it.
    flat = spread <= 1e-6 * magnitude
    spread = torch.where(flat, magnitude, spread).clamp(min=epsilon)
    scale = spread / (qmax - qmin)
    # finite weights whose range exceeds float32 (`max - min` is inf): the
    # step is computed without forming the range
    scale = torch.where(
        torch.isinf(spread), maximum / (qmax - qmin) - minimum / (qmax - qmin), scale
    )
    exact_zero = -minimum / scale + qmin
    codes = torch.round(blocks / scale[:, None] + exact_zero[:, None]).clamp_(qmin, qmax)
    on_grid = (
        ((codes - exact_zero[:, None]) * scale[:, None] - blocks).abs()
        <= _ON_GRID_TOLERANCE * scale[:, None]
    ).all(dim=1)
    one_sided = (minimum >= 0) | (maximum <= 0)
    zero = torch.where(on_grid | one_sided | flat, exact_zero, torch.round(exact_zero))
    q = torch.round(blocks / scale[:, None] + zero[:, None]).clamp_(qmin, qmax)
    return q.to(torch.int8), scale, zero


def codes_within_float32(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Grouped codes `q` (rows, columns), each group of `block_size` rows
    with its `scale` and `zero` (groups, columns), stepped inwards where their
    value `(q - zero) * scale` leaves float32: a group whose range exceeds
    float32 (finite weights near its largest value), whose rounded or refined
    zero point moved the grid past it. Any other `q` is returned as it is.

    >>> import torch
    >>> big = torch.finfo(torch.float32).max
    >>> q = torch.tensor([[-8], [7]], dtype=torch.int8)
    >>> scale, zero = torch.tensor([[big / 7.9]]), torch.tensor([[0.0]])  # -8 x scale < -big
    >>> codes_within_float32(q, scale, zero, 2).flatten().tolist()
    [-7, 7]
    """
    largest = torch.finfo(torch.float32).max
    if not bool((scale.abs() > largest / 32).any()):
        return q
    rows = torch.arange(q.shape[0], device=q.device) // block_size
    value = (q.double() - zero.double()[rows]) * scale.double()[rows]
    stepped = torch.where(value > largest, q - 1, torch.where(value < -largest, q + 1, q))
    return stepped.to(q.dtype)


def dequantize_grouped(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    block_size: int,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """`(q - zero) * scale` (float32), each row with its group's scale and
    zero: row `i` is in group `g_idx[i]` when given (Keras's `g_idx`, which
    GPTQ's activation order permutes), else `i // block_size`.

    >>> import torch
    >>> q = torch.tensor([[0], [15], [8], [8]], dtype=torch.uint8)  # 4 rows, groups of 2
    >>> scale, zero = torch.tensor([[0.1], [1.0]]), torch.tensor([[8.0], [8.0]])
    >>> dequantize_grouped(q, scale, zero, block_size=2).flatten()
    tensor([-0.8000,  0.7000,  0.0000,  0.0000])
    """
    if g_idx is None:
        group_of_row = torch.arange(q.shape[0], device=q.device) // block_size
    else:
        group_of_row = g_idx.long()
    return (q.float() - zero.float()[group_of_row]) * scale.float()[group_of_row]


def packed_int4(
    arr: torch.Tensor, axis: int = 0, dtype: str | torch.dtype = "int8"
) -> torch.Tensor:
    """Packs int8 values in [-8, 7] (or uint8 values in [0, 15]) two per byte
    along `axis` (Keras layout).

    Element `2i` goes to the low nibble and `2i+1` to the high nibble of byte
    `i`; an odd length is zero-padded. Returns the input's dtype with
    `ceil(n/2)` along `axis` (`pack_int4`'s packed tensor alone).

    >>> import torch
    >>> packed = packed_int4(torch.tensor([1, -2, 7], dtype=torch.int8))
    >>> packed, unpack_int4(packed, 3)
    (tensor([-31,   7], dtype=torch.int8), tensor([ 1, -2,  7], dtype=torch.int8))
    >>> unpack_int4(packed_int4(torch.tensor([15, 0, 9], dtype=torch.uint8)), 3, dtype="uint8")
    tensor([15,  0,  9], dtype=torch.uint8)
    """
    if arr.dtype not in (torch.int8, torch.uint8):
        raise TypeError(
            f"Expected int8 tensor for packing (or uint8 of values 0-15), got {arr.dtype}"
        )
    if dtype not in ("int8", "uint8", torch.int8, torch.uint8):  # Keras's: the input's dtype
        raise ValueError(f"Expected dtype to be 'int8' or 'uint8', but got '{dtype}'.")
    moved = arr.movedim(axis, 0)
    if moved.shape[0] % 2:
        moved = torch.cat([moved, moved.new_zeros((1, *moved.shape[1:]))])
    low = moved[0::2].to(torch.int16) & 0xF
    high = moved[1::2].to(torch.int16) & 0xF
    packed = (low | (high << 4)).to(torch.uint8)
    if arr.dtype == torch.int8:
        packed = packed.view(torch.int8)
    return packed.movedim(0, axis)


def pack_int4(
    arr: torch.Tensor, axis: int = 0, dtype: str | torch.dtype = "int8"
) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """Keras's `pack_int4`: `(packed, packed_shape, orig_rows)`, the packed
    tensor (`packed_int4`), its shape and the length along `axis` before
    padding (what `unpack_int4` takes back).

    >>> import torch
    >>> packed, packed_shape, orig_rows = pack_int4(torch.tensor([[-3, 7], [2, -8], [1, 0]],
    ...                                                          dtype=torch.int8))
    >>> packed, packed_shape, orig_rows
    (tensor([[  45, -121],
            [   1,    0]], dtype=torch.int8), (2, 2), 3)
    >>> unpack_int4(packed, orig_rows).tolist()
    [[-3, 7], [2, -8], [1, 0]]
    """
    packed = packed_int4(arr, axis=axis, dtype=dtype)
    return packed, tuple(packed.shape), int(arr.shape[axis])


def unpack_int4(
    packed: torch.Tensor, orig_len: int, axis: int = 0, dtype: str | torch.dtype = "int8"
) -> torch.Tensor:
    """Inverse of `pack_int4`: `orig_len` values along `axis`, sign-extended
    int8 (`dtype="int8"`) or unsigned uint8 in [0, 15] (`dtype="uint8"`).

    >>> import torch
    >>> unpack_int4(torch.tensor([-31, 7], dtype=torch.int8), 3)
    tensor([ 1, -2,  7], dtype=torch.int8)
    """
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"Expected an int8 or uint8 packed tensor, got {packed.dtype}")
    if dtype not in ("int8", "uint8", torch.int8, torch.uint8):
        raise ValueError(f"Expected dtype to be 'int8' or 'uint8', but got '{dtype}'.")
    # the bytes, unsigned, in int32: ONNX Runtime's CPU provider has no int16
    # `Where`, which an exported int16 shift becomes
    moved = packed.movedim(axis, 0).to(torch.int32) & 0xFF
    low = moved & 0xF
    high = (moved >> 4) & 0xF
    nibbles = torch.stack([low, high], dim=1).reshape(2 * moved.shape[0], *moved.shape[1:])
    nibbles = nibbles[:orig_len]
    if dtype in ("uint8", torch.uint8):
        return nibbles.to(torch.uint8).movedim(0, axis)
    signed = torch.where(nibbles > 7, nibbles - 16, nibbles).to(torch.int8)
    return signed.movedim(0, axis)


_NIBBLE_VALUES: dict[torch.device, torch.Tensor] = {}


def _nibble_values(device: torch.device) -> torch.Tensor:
    """(256, 2) float32: the two sign-extended nibbles of each byte, low first."""
    table = _NIBBLE_VALUES.get(device)
    if table is None:
        with torch.inference_mode(False):  # a plain tensor, whichever mode builds it
            nibbles = torch.stack([torch.arange(256) & 0xF, torch.arange(256) >> 4], dim=1)
            table = torch.where(nibbles > 7, nibbles - 16, nibbles).float().to(device)
        _NIBBLE_VALUES[device] = table
    return table


def unpack_int4_rows(packed: torch.Tensor, orig_len: int) -> torch.Tensor:
    """`unpack_int4(packed, orig_len, axis=-1).float()`, by one table lookup
    per byte: rows gathered from a packed table (an int4 embedding's lookup)
    decode in one pass over the bytes instead of a dozen over the values.

    >>> import torch
    >>> packed = packed_int4(torch.tensor([[1, -2, 7], [-8, 0, 3]], dtype=torch.int8), axis=1)
    >>> unpack_int4_rows(packed, 3).tolist()
    [[1.0, -2.0, 7.0], [-8.0, 0.0, 3.0]]
    """
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"Expected an int8 or uint8 packed tensor, got {packed.dtype}")
    table = _nibble_values(packed.device)
    values = table[packed.view(torch.uint8).long()]  # (..., bytes, 2)
    return values.flatten(-2)[..., :orig_len]


_SMALLEST_SCALE = float(torch.finfo(torch.float32).tiny)
"""The smallest float8 scale: the smallest normal float32. A smaller one (a
maximum near 0, divided by the format's maximum, underflows) would turn the
division by the scale into inf and NaN."""


def compute_float8_scale(
    amax: torch.Tensor, scale: torch.Tensor, dtype_max: float, margin: int = 0
) -> torch.Tensor:
    """The delayed-scaling update (Transformer Engine's rule, as Keras uses it):
    `amax * 2**margin / dtype_max`, keeping the old scale when `amax` is zero or
    not finite. Numbers are taken as float32 tensors.

    >>> import torch
    >>> compute_float8_scale(torch.tensor(896.0), torch.tensor(1.0), dtype_max=448.0)
    tensor(2.)
    >>> compute_float8_scale(torch.tensor(0.0), torch.tensor(3.0), dtype_max=448.0)
    tensor(3.)
    """
    amax, scale = torch.as_tensor(amax, dtype=torch.float32), torch.as_tensor(scale)
    factor = (dtype_max / amax) / (2.0**margin)
    keep = (amax <= 0) | ~torch.isfinite(amax)
    factor = torch.where(keep, 1.0 / scale, factor)
    return (1.0 / factor).clamp_min(_SMALLEST_SCALE)


def compute_float8_dynamic_scale(x: torch.Tensor, dtype_max: float) -> torch.Tensor:
    """Dynamic scaling: the float32 scalar `max|x| / dtype_max` of `x` itself
    over its finite values, 1 when `x` is empty or they are all zero (no graph,
    no history). A NaN or inf leaves the other values' scale as it is (it
    rounds to NaN or saturates by itself).

    >>> import torch
    >>> compute_float8_dynamic_scale(torch.tensor([1.0, -896.0]), FLOAT8_E4M3_MAX)
    tensor(2.)
    >>> compute_float8_dynamic_scale(torch.tensor([float("nan"), -896.0]), FLOAT8_E4M3_MAX)
    tensor(2.)
    >>> compute_float8_dynamic_scale(torch.zeros(3), FLOAT8_E4M3_MAX)
    tensor(1.)
    """
    if x.numel() == 0:
        return torch.ones((), dtype=torch.float32, device=x.device)
    # over every dimension by name: ONNX's exporter needs them (`aten_amax`)
    everything = tuple(range(x.dim()))
    magnitudes = x.detach().abs()
    if compiling():  # without constructors: foldable where weights freeze (`_where_else`)
        amax = _where_else(torch.isfinite(magnitudes), magnitudes, 0.0).amax(everything).float()
        return _where_else(amax > 0, amax / dtype_max, 1.0).clamp_min(_SMALLEST_SCALE)
    # in place: one pass fewer over large eager inputs (small ones round natively)
    amax = magnitudes.nan_to_num_(nan=0.0, posinf=0.0).amax(everything).float()
    return torch.where(amax > 0, amax / dtype_max, torch.ones_like(amax)).clamp_min(_SMALLEST_SCALE)


def compute_float8_amax_history(x: torch.Tensor, amax_history: torch.Tensor) -> torch.Tensor:
    """The history rolled by one with `max|x|` as the newest entry, at index 0.

    >>> import torch
    >>> compute_float8_amax_history(torch.tensor([-5.0, 1.0]), torch.tensor([1.0, 2.0, 3.0]))
    tensor([5., 3., 1.])
    """
    amax = x.detach().abs().max().to(amax_history.dtype)
    rolled = torch.roll(amax_history, shifts=-1, dims=0)
    rolled[0] = amax
    return rolled


def compute_float8_channel_scale(w_nk: torch.Tensor, dtype_max: float) -> torch.Tensor:
    """Per-output-channel scales `max|row| / dtype_max` of an (N, K) weight,
    as float32 (N, 1); 1 for a row that is all zero or not finite.

    >>> import torch
    >>> compute_float8_channel_scale(torch.tensor([[1.0, -896.0], [0.0, 0.0]]), 448.0)
    tensor([[2.],
            [1.]])
    """
    amax = w_nk.detach().abs().amax(dim=-1, keepdim=True).float()
    usable = (amax > 0) & torch.isfinite(amax)
    return _where_else(usable, amax / dtype_max, 1.0).clamp_min(_SMALLEST_SCALE)


def _where_else(condition: torch.Tensor, values: torch.Tensor, other: float) -> torch.Tensor:
    """`torch.where(condition, values, other)` for `other` 0 or 1, the
    fallback made from `condition` itself rather than a new tensor: Inductor's
    freezing does not fold a constructor (`ones_like`, a scalar's `full`), so a
    scale computed from frozen weights with one was computed again in every
    call, and each weight's rounding with it (a compiled float8 weight-only
    decode step of SmolLM2-135M: 174 ms; folded, 12.6)."""
    if other not in (0.0, 1.0):
        raise ValueError(f"`other` must be 0.0 or 1.0; got {other!r}")
    fallback = condition.logical_not() if other == 1.0 else condition
    return torch.where(condition, values, fallback.to(values.dtype))


def quantize_and_dequantize(
    inputs: torch.Tensor,
    scale: torch.Tensor | float,
    quantized_dtype: torch.dtype | str,
    compute_dtype: torch.dtype | str,
) -> torch.Tensor:
    """`inputs / scale`, clipped to the format's range, rounded to float8 and
    back, times `scale`, in `compute_dtype` (dtypes as torch dtypes or names).

    >>> import torch
    >>> x = torch.tensor([0.3, 1000.0])
    >>> quantize_and_dequantize(x, 1.0, "float8_e4m3fn", "float32").tolist()  # clipped at 448
    [0.3125, 448.0]
    """
    qdtype, compute = _torch_dtype(quantized_dtype), _torch_dtype(compute_dtype)
    limit = float(torch.finfo(qdtype).max)
    scaled = (inputs.float() / scale).clamp(-limit, limit)
    return (scaled.to(qdtype).float() * scale).to(compute)


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype given as itself or by its name (Keras's arguments)."""
    return dtype if isinstance(dtype, torch.dtype) else to_torch_dtype(standardize_dtype(dtype))
