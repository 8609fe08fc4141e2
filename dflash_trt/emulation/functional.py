"""The stand-in `tensorrt_llm.functional` (and `_common`): eager torch execution with TensorRT-LLM 1.2.x's rules.

Each op follows its definition in `tensorrt_llm/functional.py` (the newest 1.2-era copy read; the rules below are
quoted from it, not guessed): Python ints become int32 constants of shape [1] and floats float32 constants
(`constant_to_tensor_`); an int64 operand makes the other integer operands int64 (`constants_to_tensors_`,
`elementwise_binary`); ranks are matched by prepending 1s (`expand_dims_like`), then TensorRT broadcasting; the
network is strongly typed (BuildConfig default), so mixed float types, bool arithmetic or a non-bool `where`
condition fail as TensorRT would reject them. `shape()` yields int64 (TensorRT 10's IShapeLayer), `argmax`
int32 indices (ITopKLayer); `exp` takes floating-point tensors only and the reductions (`sum`, `max`) no bool, as
TensorRT's unary and reduce layers require. `cumsum` over the last dimension runs the CumsumLastDim plugin when
preferred (with its dtype limits) and otherwise builds the [n, n] lower-triangle product the source builds; the
network's ledger records that size so tests can bound the activations it implies.
A tensor produced by a plugin with side effects (our KV injection) is lazy: its layer runs when a consumer reads it,
and never if nothing does, because TensorRT orders layers only by data dependencies and drops unused ones.
"""

from __future__ import annotations

import builtins
import contextlib
import enum
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dflash_trt.emulation import trt
from dflash_trt.errors import DFlashTrtError
from dflash_trt.trtllm.build_limits import TOPK_MAX_K


class EmulationError(DFlashTrtError):
    """The network did something TensorRT (or the TensorRT-LLM 1.2.x function it called) rejects."""


class LayerNormType(enum.IntEnum):
    LayerNorm = 0
    RmsNorm = 1
    GroupNorm = 2


class AttentionMaskType(enum.IntEnum):
    padding = 0
    causal = 1
    sliding_window_causal = 2
    bidirectional = 3
    bidirectionalglm = 4
    blocksparse = 5
    custom_mask = 6


class PositionEmbeddingType(enum.IntEnum):
    learned_absolute = 0
    rope_gptj = 1
    rope_gpt_neox = 2
    long_rope = 3
    alibi = 4
    alibi_with_scale = 5
    relative = 6
    chatglm = 7
    yarn = 8
    mrope = 9
    deferred = 10

    @staticmethod
    def from_string(name: str) -> PositionEmbeddingType:
        return PositionEmbeddingType[name]


# ----------------------------------------------------------------------------------------------------------- network


@dataclass
class PluginConfig:
    """The `PluginConfig` fields model.py reads (tensorrt_llm/plugin/plugin.py), as `dflash-trt build` sets them."""

    paged_kv_cache: bool = True
    remove_input_padding: bool = True
    tokens_per_block: int = 32
    gpt_attention_plugin: str = "auto"
    gemm_plugin: str = "auto"
    multiple_profiles: bool = False
    use_paged_context_fmha: bool = True
    # As builder.build() settles it (formats.fp8_context_fmha): context requests attend in FP8.
    use_fp8_context_fmha: bool = False


@dataclass
class Network:
    """What one step's forward builds: marked outputs and the size of the largest quadratic cumsum intermediate.
    `device_sm` is emulation-only: the GPU the engine runs on, which decides what the stock attention plugin can
    dispatch (its XQA dispatcher differs between Hopper and Blackwell)."""

    plugin_config: PluginConfig
    device_sm: int = 90
    strongly_typed: bool = True
    outputs: dict[str, Tensor] = field(default_factory=dict)
    cumsum_square_elements: list[int] = field(default_factory=list)
    largest_position: int = -1  # the largest position whose RoPE table row an attention layer read
    branches_taken: list[bool] = field(default_factory=list)  # each `Conditional`'s condition, in build order

    def _mark_output(self, tensor: Tensor, name: str, dtype: trt.DataType | None) -> None:
        if name in self.outputs:
            raise EmulationError(f"output '{name}' marked twice")
        self.outputs[name] = tensor if dtype is None else cast(tensor, dtype)


# Per thread: tensor-parallel ranks run their networks side by side (`ranks.py`), each in its own thread.
_building = threading.local()


def _networks() -> list[Network]:
    if not hasattr(_building, "networks"):
        _building.networks = []
    return _building.networks


@contextlib.contextmanager
def net_guard(network: Network) -> Iterator[Network]:
    _networks().append(network)
    try:
        yield network
    finally:
        _networks().pop()


def default_net() -> Network:
    if not _networks():
        raise EmulationError("no network is being built (default_net() outside net_guard)")
    return _networks()[-1]


class _Layer:
    def __init__(self, outputs: list[Tensor]):
        self._outputs = outputs

    def get_output(self, index: int) -> Tensor:
        return self._outputs[index]


# TensorRT's ITopKLayer: one reduction axis, these input types, K up to the limit (TensorRT 10 operator docs) [read].
TOPK_DTYPES = (trt.float32, trt.float16, trt.bfloat16, trt.int32)


class _TrtNetwork:
    """`default_trtnet()`: the INetworkDefinition calls our engine code makes itself: `add_plugin_v3` (our plugin
    wrapper) and `add_topk` (DFlash2's candidates)."""

    def add_plugin_v3(self, inputs: Sequence[Tensor], shape_inputs: Sequence[Tensor], plugin: Any) -> _Layer:
        if shape_inputs:
            raise EmulationError("shape inputs to plugins are not used by this network")
        return _Layer(plugin.add_to_network(list(inputs)))

    def add_topk(self, input: Tensor, op: trt.TopKOperation, k: int, axes: int) -> _Layer:  # noqa: A002
        """Outputs: the k values (the input's type) and their int32 indices, largest first (ties here: torch's
        order; unspecified in TensorRT)."""
        if op != trt.TopKOperation.MAX:
            raise EmulationError("only TopKOperation.MAX is used by this network")
        if not 1 <= k <= TOPK_MAX_K:
            raise EmulationError(f"ITopKLayer takes 1 <= K <= {TOPK_MAX_K}, got {k}")
        if axes <= 0 or axes & (axes - 1) or axes.bit_length() > input.rank():
            raise EmulationError(f"ITopKLayer reduces exactly one axis of a rank-{input.rank()} input, got {axes:#b}")
        if input.dtype not in TOPK_DTYPES:
            raise EmulationError(f"ITopKLayer does not take {input.dtype.name}")
        dim = axes.bit_length() - 1
        if k > input.shape[dim]:
            raise EmulationError(f"top-{k} of an axis of {input.shape[dim]}")
        values, indices = torch.topk(input.data, k, dim=dim, largest=True, sorted=True)
        return _Layer([wrap_tensor(values), wrap_tensor(indices.to(torch.int32))])


def default_trtnet() -> _TrtNetwork:
    default_net()
    return _TrtNetwork()


# ------------------------------------------------------------------------------------------------------------ tensor


class Tensor:
    """A network tensor holding its torch value (or a thunk for side-effecting plugin outputs)."""

    def __init__(
        self,
        name: str | None = None,
        dtype: Any = None,
        shape: Any = None,
        dim_range: Any = None,
        is_network_input: bool = True,
        location: Any = None,
        *,
        data: torch.Tensor | None = None,
        thunk: Callable[[], torch.Tensor] | None = None,
        host: bool = False,
    ):
        self.name = name
        self._data = data
        self._thunk = thunk
        self.declared_dtype = dtype
        self.host = host

    # TensorRT's ITensor and TensorRT-LLM's Tensor are the same object here.
    @property
    def trt_tensor(self) -> Tensor:
        return self

    @property
    def data(self) -> torch.Tensor:
        if self._data is None:
            if self._thunk is None:
                raise EmulationError(f"tensor '{self.name}' has no value (an input the runtime did not bind?)")
            thunk, self._thunk = self._thunk, None
            self._data = thunk()
        return self._data

    @property
    def dtype(self) -> trt.DataType:
        return trt.FROM_TORCH[self.data.dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def size(self, dim: int | None = None) -> Any:
        """The shape (or one dimension). TensorRT's static shape says -1 for a dynamic dimension; the emulation
        knows only executed sizes, so it cannot tell: the network calls it on static dimensions only."""
        return self.shape if dim is None else self.shape[dim]

    def rank(self) -> int:
        return self.data.dim()

    ndim = rank

    def mark_output(self, name: str | None = None, dtype: Any = None) -> None:
        default_net()._mark_output(self, name or self.name or "", trt_dtype(dtype) if dtype is not None else None)

    def view(self, shape: Any, zero_is_placeholder: bool = True) -> Tensor:
        return view(self, shape, zero_is_placeholder)

    def cast(self, dtype: Any) -> Tensor:
        return cast(self, dtype)

    def __add__(self, b: Any) -> Tensor:
        return add(self, b)

    def __radd__(self, b: Any) -> Tensor:
        return add(b, self)

    def __sub__(self, b: Any) -> Tensor:
        return sub(self, b)

    def __rsub__(self, b: Any) -> Tensor:
        return sub(b, self)

    def __mul__(self, b: Any) -> Tensor:
        return mul(self, b)

    def __rmul__(self, b: Any) -> Tensor:
        return mul(b, self)

    def __truediv__(self, b: Any) -> Tensor:
        return div(self, b)

    def __floordiv__(self, b: Any) -> Tensor:
        return floordiv(self, b)

    def __lt__(self, b: Any) -> Tensor:
        return lt(self, b)

    def __gt__(self, b: Any) -> Tensor:
        return gt(self, b)

    def __eq__(self, b: Any) -> Tensor:  # type: ignore[override]
        return eq(self, b)

    def __ge__(self, b: Any) -> Tensor:
        return op_or(gt(self, b), eq(self, b))

    def __le__(self, b: Any) -> Tensor:
        return op_or(lt(self, b), eq(self, b))

    __hash__ = object.__hash__


class Conditional:
    """TensorRT's IIfConditional as functional.py's `Conditional` builds it: the condition is a one-element bool
    tensor (viewed as 0-D), values enter through `add_input` and `add_output(true, false)` is the taken branch's
    value; both branch values must agree in dtype and shape (TensorRT's rule for the two subgraphs). TensorRT runs
    only the taken branch; this eager emulation computes both and records the branch taken in the network's ledger
    (`branches_taken`), which is what tests of a fast path can observe."""

    def __init__(self, condition: Tensor):
        if condition.dtype != trt.bool or condition.data.numel() != 1:
            raise EmulationError(
                f"a conditional needs one bool condition, got {condition.dtype.name} {condition.shape}"
            )
        self.taken = bool(condition.data.reshape(()))

    def add_input(self, input: Tensor) -> Tensor:  # noqa: A002 (TensorRT-LLM's name)
        return wrap_tensor(input.data)

    def add_output(self, true_value: Tensor, false_value: Tensor) -> Tensor:
        if true_value.dtype != false_value.dtype or true_value.shape != false_value.shape:
            raise EmulationError(
                f"conditional branches give {true_value.dtype.name} {true_value.shape} and "
                f"{false_value.dtype.name} {false_value.shape}: TensorRT needs one dtype and shape"
            )
        default_net().branches_taken.append(self.taken)
        return true_value if self.taken else false_value


def wrap_tensor(data: torch.Tensor) -> Tensor:
    """A torch value as the stand-in network tensor every emulated op returns."""
    return Tensor(data=data)


def _create_tensor(trt_tensor: Tensor, producer: Any) -> Tensor:
    return trt_tensor


def trt_dtype(dtype: Any) -> trt.DataType:
    """A dtype as TensorRT-LLM code passes it (a string such as "float16" or a trt.DataType) as a trt.DataType."""
    if isinstance(dtype, str):
        if dtype not in trt.STR_DTYPES:
            raise EmulationError(f"unknown dtype string {dtype!r}")
        return trt.STR_DTYPES[dtype]
    return trt.DataType(dtype)


# --------------------------------------------------------------------------------------------------------- constants


def constant(ndarray: np.ndarray, as_dtype: Any = None, as_shape: Any = None) -> Tensor:
    data = torch.from_numpy(np.ascontiguousarray(ndarray).copy())
    if as_dtype is not None:
        data = data.to(trt.TORCH_DTYPES[trt_dtype(as_dtype)])
    if as_shape is not None:
        data = data.reshape(tuple(as_shape))
    return wrap_tensor(data)


def constant_to_tensor_(value: Any, dtype: Any = None, to_array: bool = True) -> Tensor:
    if isinstance(value, Tensor):
        return value
    if dtype is None:
        dtype = trt.bool if isinstance(value, bool) else trt.int32 if isinstance(value, int) else trt.float32
    torch_dtype = trt.TORCH_DTYPES[trt_dtype(dtype)]
    return wrap_tensor(torch.tensor([value] if to_array else value, dtype=torch_dtype))


def constants_to_tensors_(*inputs: Any) -> tuple[Tensor, ...]:
    """Ints become int64 constants when an input is int64; an int32 *tensor* stays int32 (constant_to_tensor_
    returns tensors unchanged), so concat / where of int32 and int64 tensors still fail as in TensorRT."""
    has_int64 = any(
        (isinstance(i, int) and not -(2**31) <= i < 2**31) or (isinstance(i, Tensor) and i.dtype == trt.int64)
        for i in inputs
    )
    return tuple(constant_to_tensor_(i, trt.int64 if has_int64 and isinstance(i, int) else None) for i in inputs)


def _expand_dims_like(x: Tensor, like: Tensor) -> Tensor:
    missing = like.rank() - x.rank()
    return wrap_tensor(x.data.reshape((1,) * missing + tuple(x.data.shape))) if missing > 0 else x


def _broadcast_shapes(*shapes: tuple[int, ...]) -> None:
    for dims in zip(*shapes, strict=True):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            raise EmulationError(f"shapes {shapes} do not broadcast (TensorRT elementwise/select)")


def _binary(
    left: Any,
    right: Any,
    op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    kinds: tuple[str, ...] = ("float", "int"),
) -> Tensor:
    # broadcast_helper (strongly typed): a Python scalar takes the other operand's dtype.
    left = constant_to_tensor_(left, right.dtype if isinstance(right, Tensor) else None)
    right = constant_to_tensor_(right, left.dtype)
    if left.rank() < right.rank():
        left = _expand_dims_like(left, right)
    elif right.rank() < left.rank():
        right = _expand_dims_like(right, left)
    if {left.dtype, right.dtype} == {trt.int32, trt.int64}:
        left, right = cast(left, trt.int64), cast(right, trt.int64)
    if left.dtype != right.dtype:
        raise EmulationError(f"elementwise operands of different types {left.dtype.name} and {right.dtype.name}")
    kind = "bool" if left.dtype == trt.bool else "float" if left.data.is_floating_point() else "int"
    if kind not in kinds:
        raise EmulationError(f"elementwise operation not defined for {left.dtype.name}")
    _broadcast_shapes(left.shape, right.shape)
    return wrap_tensor(op(left.data, right.data))


def add(a: Any, b: Any) -> Tensor:
    return _binary(a, b, torch.add)


def sub(a: Any, b: Any) -> Tensor:
    return _binary(a, b, torch.sub)


def mul(a: Any, b: Any) -> Tensor:
    return _binary(a, b, torch.mul)


def div(a: Any, b: Any) -> Tensor:
    return _binary(a, b, torch.div, ("float",))


def floordiv(a: Any, b: Any) -> Tensor:
    return _binary(a, b, lambda x, y: torch.div(x, y, rounding_mode="floor"), ("int",))


def lt(a: Any, b: Any) -> Tensor:
    return _binary(a, b, torch.lt)


def gt(a: Any, b: Any) -> Tensor:
    return _binary(a, b, torch.gt)


def eq(a: Any, b: Any) -> Tensor:
    return _binary(a, b, torch.eq, ("float", "int", "bool"))


def minimum(a: Any, b: Any) -> Tensor:
    return _binary(a, b, torch.minimum)


def op_or(a: Any, b: Any) -> Tensor:
    return _binary(a, b, torch.logical_or, ("bool",))


def where(condition: Any, left: Any, right: Any) -> Tensor:
    condition = constant_to_tensor_(condition)
    left, right = constants_to_tensors_(left, right)
    if condition.dtype != trt.bool:
        raise EmulationError(f"where() condition must be bool, got {condition.dtype.name} (ISelectLayer)")
    if left.dtype != right.dtype:
        raise EmulationError(f"where() branches of different types {left.dtype.name} and {right.dtype.name}")
    largest = builtins.max((condition, left, right), key=Tensor.rank)
    condition, left, right = (_expand_dims_like(t, largest) for t in (condition, left, right))
    _broadcast_shapes(condition.shape, left.shape, right.shape)
    return wrap_tensor(torch.where(condition.data, left.data, right.data))


def cast(x: Tensor, dtype: Any) -> Tensor:
    return wrap_tensor(x.data.to(trt.TORCH_DTYPES[trt_dtype(dtype)]))


def tanh(x: Tensor) -> Tensor:
    _require_float(x, "tanh")
    return wrap_tensor(torch.tanh(x.data))


def exp(x: Tensor) -> Tensor:
    """IUnaryLayer EXP (functional.py `unary`). TensorRT's Unary operator table gives EXP no int32 / int64 / bool
    input (only int8, which this network never has), so integer tensors are refused."""
    _require_float(x, "exp")
    return wrap_tensor(torch.exp(x.data))


# TensorRT's Unary operator table: EXP and LOG take floating-point inputs (and int8, which this network never has).
_UNARY = {trt.UnaryOperation.EXP: torch.exp, trt.UnaryOperation.LOG: torch.log}


def unary(x: Tensor, op: trt.UnaryOperation) -> Tensor:
    """IUnaryLayer (functional.py `unary`): the result keeps the input's type."""
    if op not in _UNARY:
        raise EmulationError(f"unary {op!r} is not used by this network")
    _require_float(x, f"unary {trt.UnaryOperation(op).name}")
    return wrap_tensor(_UNARY[trt.UnaryOperation(op)](x.data))


def _require_float(x: Tensor, what: str) -> None:
    if not x.data.is_floating_point():
        raise EmulationError(f"{what} of a {x.dtype.name} tensor")


# ------------------------------------------------------------------------------------------------------------ shapes


def _dims(value: Any, rank: int | None = None) -> list[int]:
    """A shape given as a list of ints/0-D tensors or as a 1-D int32/int64 shape tensor."""
    if isinstance(value, Tensor):
        if value.dtype not in (trt.int32, trt.int64) or value.rank() != 1:
            raise EmulationError(f"a shape tensor must be 1-D int32/int64, got {value.dtype.name} rank {value.rank()}")
        dims = [int(v) for v in value.data.tolist()]
    else:
        dims = [int(v.data.reshape(())) if isinstance(v, Tensor) else int(v) for v in value]
    if rank is not None and len(dims) != rank:
        raise EmulationError(f"shape {dims} has {len(dims)} dims, the input has {rank}")
    return dims


def shape(x: Tensor, dim: int | None = None, cast_to_dtype: Any = None, clip_before_cast: Any = None) -> Tensor:
    result = wrap_tensor(torch.tensor(x.shape, dtype=torch.int64))
    if cast_to_dtype is not None:
        result = cast(result, cast_to_dtype)
    if dim is None:
        return result
    return gather(result, 0, dim).view([])


def view(x: Tensor, new_shape: Any, zero_is_placeholder: bool = True) -> Tensor:
    dims = _dims(new_shape)
    if dims.count(-1) > 1:
        raise EmulationError("view() infers at most one dimension")
    if zero_is_placeholder:
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    try:
        return wrap_tensor(x.data.reshape(dims))
    except RuntimeError as exc:
        raise EmulationError(f"view {x.shape} -> {dims}: {exc}") from None


def unsqueeze(x: Tensor, axis: int) -> Tensor:
    if axis < 0:
        axis += x.rank() + 1
    return wrap_tensor(x.data.unsqueeze(axis))


# TensorRT 10's Concatenation operator: one type T for all inputs and the output, T one of these (no FP8, no FP4).
CONCAT_TYPES = (trt.bool, trt.int8, trt.int32, trt.int64, trt.float16, trt.float32, trt.bfloat16)


def concat(inputs: Sequence[Any], dim: int = 0) -> Tensor:
    if not inputs:
        raise EmulationError("concat of nothing")
    tensors = [t.view([1]) if t.rank() == 0 else t for t in constants_to_tensors_(*inputs)]
    if len({t.dtype for t in tensors}) != 1:
        raise EmulationError(f"concat of different types {[t.dtype.name for t in tensors]} (IConcatenationLayer)")
    if tensors[0].dtype not in CONCAT_TYPES:
        raise EmulationError(f"concat of {tensors[0].dtype.name} tensors (IConcatenationLayer takes no such type)")
    try:
        return wrap_tensor(torch.cat([t.data for t in tensors], dim=dim))
    except RuntimeError as exc:
        raise EmulationError(f"concat: {exc}") from None


def dequantize(input: Tensor, scale_factor: Tensor, axis: int = -1, output_type: Any = "float16") -> Tensor:  # noqa: A002
    """`quantization/functional.py` `dequantize`: TensorRT's IDequantizeLayer, `input * scale` in the output type.
    Its operator reference: input INT8 / FP8 / INT4, output FLOAT / HALF / BF16, the scale of the output type and
    a build-time constant, one element for per-tensor dequantization (the only kind used here)."""
    to = trt_dtype(output_type)
    if input.dtype not in (trt.int8, trt.fp8):
        raise EmulationError(f"dequantize of a {input.dtype.name} tensor (IDequantizeLayer takes INT8 / FP8 / INT4)")
    if to not in (trt.float32, trt.float16, trt.bfloat16) or scale_factor.dtype != to:
        raise EmulationError(f"dequantize to {to.name} with a {scale_factor.dtype.name} scale (IDequantizeLayer)")
    if scale_factor.data.numel() != 1:
        raise EmulationError("dequantize: the emulation implements per-tensor scales only")
    return wrap_tensor((input.data.float() * scale_factor.data.float().reshape(())).to(trt.TORCH_DTYPES[to]))


def slice(
    x: Tensor,
    starts: Any,
    sizes: Any,
    strides: Any = None,
    mode: Any = None,  # noqa: A001
    fill_value: Any = None,
) -> Tensor:
    if mode is not None or fill_value is not None:
        raise EmulationError("slice modes other than STRICT_BOUNDS are not used by this network")
    begin, size = _dims(starts, x.rank()), _dims(sizes, x.rank())
    step = [1] * x.rank() if strides is None else _dims(strides, x.rank())
    index = []
    for axis, (b, n, s) in enumerate(zip(begin, size, step, strict=True)):
        last = b + (n - 1) * s
        if n and not (0 <= b < x.shape[axis] and 0 <= last < x.shape[axis]):
            raise EmulationError(f"slice out of bounds on axis {axis}: start {b} size {n} of {x.shape[axis]}")
        index.append(torch.arange(n, dtype=torch.int64) * s + b)
    return wrap_tensor(x.data[torch.meshgrid(*index, indexing="ij")] if index else x.data)


def expand(x: Tensor, expand_shape: Tensor) -> Tensor:
    """ISliceLayer with stride min(size - 1, 1): size-1 dims repeat, others are read from their start."""
    dims = _dims(expand_shape, x.rank())
    strides = [min(s - 1, 1) for s in x.shape]
    return slice(x, [0] * x.rank(), dims, strides)


def _indices(index: Tensor, what: str) -> torch.Tensor:
    if index.dtype not in (trt.int32, trt.int64):
        raise EmulationError(f"{what} indices must be int32/int64, got {index.dtype.name}")
    return index.data.long()


def _check_range(idx: torch.Tensor, size: int, what: str) -> None:
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= size):
        raise EmulationError(f"{what} index out of range [0, {size}): {idx.tolist()}")


def gather(x: Tensor, dim: int, indices: Tensor | int) -> Tensor:
    """An int index: IGatherLayer (default mode) on a [1] index; a tensor: GatherElements (same rank)."""
    if dim < 0:
        dim += x.rank()
    if isinstance(indices, int):
        _check_range(torch.tensor([indices]), x.shape[dim], "gather")
        return wrap_tensor(x.data.index_select(dim, torch.tensor([indices])))
    idx = _indices(indices, "gather")
    if indices.rank() != x.rank():
        raise EmulationError(f"gather (GatherElements) needs indices of rank {x.rank()}, got {indices.rank()}")
    _check_range(idx, x.shape[dim], "gather")
    return wrap_tensor(torch.gather(x.data, dim, idx))


def index_select(x: Tensor, dim: int, index: Tensor) -> Tensor:
    if index.rank() != 1:
        raise EmulationError(f"index_select needs a 1-D index, got rank {index.rank()}")
    idx = _indices(index, "index_select")
    _check_range(idx, x.shape[dim], "index_select")
    return wrap_tensor(x.data.index_select(dim, idx))


def arange(start: Tensor | int, end: Tensor | int, dtype: str) -> Tensor:
    res = trt_dtype(dtype)
    if isinstance(start, int):
        if not isinstance(end, int):
            raise EmulationError("arange: start and end must both be ints or both tensors")
        lo, hi = start, end
    else:
        if not isinstance(end, Tensor):
            raise EmulationError("arange: start and end must both be ints or both tensors")
        for t in (start, end):
            if t.dtype not in (trt.int32, trt.int64):
                raise EmulationError(f"arange bounds must be int32/int64, got {t.dtype.name}")
        if start.data.numel() != 1 or end.data.numel() != 1:
            raise EmulationError("arange bounds must hold one value")
        lo, hi = int(start.data.reshape(())), int(end.data.reshape(()))
    return wrap_tensor(torch.arange(lo, hi, dtype=trt.TORCH_DTYPES[res]))


# CumsumLastDimPlugin's constructor: "Only support int, float, half, and bfloat16".
CUMSUM_PLUGIN_DTYPES = (trt.float32, trt.float16, trt.bfloat16, trt.int32)


def cumsum(x: Tensor, dim: int, prefer_plugin: bool = True) -> Tensor:
    """Inclusive prefix sum, by functional.py's three paths. Last dimension with `prefer_plugin`: the CumsumLastDim
    plugin on a rank-2 view (cumsumLastDimPlugin.cpp: one scan per row, output of the input's type and shape).
    Last dimension without it: sum(unsqueeze(x, -2) * lower_triangle) over an [n, n] triangle, recorded in the
    network's ledger. Any other dimension: an ILoopLayer running sum."""
    if x.rank() < 1 or not -x.rank() <= dim < x.rank():
        raise EmulationError(f"cumsum dim {dim} of a rank-{x.rank()} tensor")
    if x.dtype == trt.bool:
        raise EmulationError("cumsum of a bool tensor")
    dim %= x.rank()
    if dim == x.rank() - 1 and prefer_plugin:
        if x.dtype not in CUMSUM_PLUGIN_DTYPES:
            raise EmulationError(f"the CumsumLastDim plugin does not take {x.dtype.name}")
        rows = x.data.reshape(-1, x.shape[-1])
        return wrap_tensor(torch.cumsum(rows, 1).to(x.data.dtype).reshape(x.shape))
    if dim == x.rank() - 1:
        n = x.shape[-1]
        default_net().cumsum_square_elements.append(n * n)
        lower = (torch.arange(n)[None, :] <= torch.arange(n)[:, None]).to(x.data.dtype)
        return wrap_tensor((x.data.unsqueeze(-2) * lower).sum(-1).to(x.data.dtype))
    return wrap_tensor(torch.cumsum(x.data, dim).to(x.data.dtype))


def _reduce(x: Tensor, what: str) -> None:
    if x.dtype == trt.bool:
        raise EmulationError(f"{what} of a bool tensor (IReduceLayer)")


def sum(x: Tensor, dim: int, keepdim: bool = False) -> Tensor:  # noqa: A001 (TensorRT-LLM's name)
    """IReduceLayer SUM; the result keeps the input's dtype."""
    _reduce(x, "sum")
    return wrap_tensor(torch.sum(x.data, dim=dim, keepdim=keepdim).to(x.data.dtype))


def max(x: Tensor, dim: int, keepdim: bool = False) -> Tensor:  # noqa: A001 (TensorRT-LLM's name)
    """IReduceLayer MAX over one dimension (functional.py `max`), in the input's dtype."""
    _reduce(x, "max")
    return wrap_tensor(torch.amax(x.data, dim=dim, keepdim=keepdim))


def argmax(x: Tensor, dim: int, keepdim: bool = False) -> Tensor:
    """ITopKLayer MAX k=1: int32 indices; ties resolve to the first index here (unspecified in TensorRT)."""
    out = torch.argmax(x.data, dim=dim, keepdim=keepdim).to(torch.int32)
    return wrap_tensor(out)


def gather_last_token_logits(hidden_states: Tensor, last_token_ids: Tensor, remove_input_padding: bool) -> Tensor:
    """1-based row ends -> those rows (functional.py `gather_last_token_logits`, remove_input_padding branch)."""
    if not remove_input_padding:
        raise EmulationError("the emulation runs packed inputs only (remove_input_padding)")
    rows = index_select(hidden_states, 0, last_token_ids - 1)
    return rows.view(concat([shape(last_token_ids, 0), shape(rows, 1)]))


# ------------------------------------------------------------------------------------------------------------ math


def matmul_linear(x: Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Tensor:
    _require_float(x, "a linear layer")
    return wrap_tensor(torch.nn.functional.linear(x.data, weight, bias))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """TensorRT-LLM's RmsNorm layer (layers/normalization.py): x * rsqrt(mean(x^2) + eps) * weight, in fp32."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight
