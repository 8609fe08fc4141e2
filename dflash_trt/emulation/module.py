"""The stand-in `tensorrt_llm.module` and `Parameter`: attribute registration, dotted names, strict values.

As in 1.2.x `module.py` / `parameter.py`: assigning a Module or Parameter attribute registers it under that name,
`named_parameters()` yields dotted paths (the checkpoint's tensor names), `register_parameter(name, None)` leaves an
optional parameter absent, and setting a Parameter's value refuses a different shape (a 0-D value fills a shape of ones;
FP4 is stored packed, two values per byte) and only warns about a different dtype.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from dflash_trt.emulation import trt
from dflash_trt.emulation.functional import EmulationError, Tensor, trt_dtype

# A packed FP4 weight `(out, in)` is stored two values per byte.
_STORED = {trt.fp4: 2}


class Parameter:
    def __init__(
        self,
        value: torch.Tensor | None = None,
        shape: tuple[int, ...] | None = None,
        dtype: Any = None,
        is_buffer: bool = False,
    ):
        self.dtype = trt_dtype(dtype if dtype is not None else "float32")
        self.shape = tuple(value.shape) if value is not None else tuple(shape or ())
        self._value = value
        self.is_buffer = is_buffer

    def is_inited(self) -> bool:
        return self._value is not None

    @property
    def stored_shape(self) -> tuple[int, ...]:
        per_byte = _STORED.get(self.dtype, 1)
        return (*self.shape[:-1], self.shape[-1] // per_byte) if per_byte > 1 else self.shape

    @property
    def value(self) -> Tensor:
        if self._value is None:
            raise EmulationError("parameter read before it was loaded")
        return Tensor(data=self._value)

    @value.setter
    def value(self, v: torch.Tensor) -> None:
        # parameter.py: a 0-D value fills a shape of ones; FP4 is stored two per byte; another dtype only warns.
        if tuple(v.shape) != self.shape and v.dim() == 0 and max(self.shape, default=1) == 1:
            v = v.reshape(self.shape)
        if tuple(v.shape) != self.stored_shape:
            raise EmulationError(
                f"The value updated is not the same shape as the original. "
                f"Updated: {tuple(v.shape)}, original: {self.stored_shape}"
            )
        quantized_bytes = self.dtype in (trt.fp4, trt.fp8) and v.dtype in (torch.int8, torch.uint8)
        if not quantized_bytes and trt.FROM_TORCH.get(v.dtype) != self.dtype:
            warnings.warn(f"Parameter was initialized as {self.dtype.name} but set to {v.dtype}", stacklevel=2)
        self._value = v

    @property
    def raw(self) -> torch.Tensor:
        return self.value.data


class Module:
    _modules: OrderedDict[str, Module]
    _parameters: OrderedDict[str, Parameter | None]

    def __init__(self) -> None:
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_parameters", OrderedDict())

    def __setattr__(self, name: str, value: Any) -> None:
        if "_modules" not in self.__dict__:
            raise EmulationError(f"{type(self).__name__}.__init__ must call super().__init__() first")
        self._modules.pop(name, None)
        self._parameters.pop(name, None)
        if isinstance(value, Module):
            self._modules[name] = value
        elif isinstance(value, Parameter):
            self._parameters[name] = value
        object.__setattr__(self, name, value)

    def register_parameter(self, name: str, value: Parameter | None) -> None:
        self._parameters[name] = value
        object.__setattr__(self, name, value)

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        yield prefix, self
        for name, module in self._modules.items():
            yield from module.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        for module_name, module in self.named_modules(prefix):
            for name, param in module._parameters.items():
                if param is not None:
                    yield (f"{module_name}.{name}" if module_name else name), param

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


class ModuleList(Module):
    def __init__(self, modules: Any) -> None:
        super().__init__()
        for index, module in enumerate(modules):
            setattr(self, str(index), module)

    def __getitem__(self, index: int) -> Module:
        return self._modules[str(index % len(self))]

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)
