"""What a torch.save tensor pickle (`data.pkl`) says about its tensor (dtype, storage key
and size, offset, size, stride), read from its opcodes alone: `pickletools.genops` decodes
them and never imports or calls anything. Only the exact shape torch.save writes for one
plain tensor (`torch._utils._rebuild_tensor_v2/v3` of a storage and an empty OrderedDict of
hooks) gives an answer; anything else gives None, and the caller uses torch.load.
"""

from __future__ import annotations

import pickletools
from typing import Any

import torch

# The storage classes of `_rebuild_tensor_v2` pickles. Quantized ones are left out on purpose:
# their tensors rebuild through other functions.
_LEGACY_STORAGE = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}

# The dtypes of `_rebuild_tensor_v3` pickles (an untyped storage and a dtype) whose elements
# are whole bytes; sub-byte and quantized ones go through torch.load.
_V3_DTYPES = {
    name
    for name in (
        *(str(d).removeprefix("torch.") for d in _LEGACY_STORAGE.values()),
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "uint16", "uint32", "uint64", "complex32",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}  # fmt: skip


class _Global:
    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def is_(self, module: str, name: str) -> bool:
        return (self.module, self.name) == (module, name)


class _Call:
    __slots__ = ("func", "args")

    def __init__(self, func: Any, args: tuple) -> None:
        self.func, self.args = func, args


class _PersistentId:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


_MARK = object()
_PICKLE_MAX = 65536  # bytes; a tensor's pickle is a few hundred
_PUSH_ARG = {
    "BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4",
    "BINUNICODE", "SHORT_BINUNICODE", "UNICODE", "BINUNICODE8",
}  # fmt: skip
_CONST = {"NEWTRUE": True, "NEWFALSE": False, "NONE": None}


def parse(head: memoryview, start: int) -> tuple[tuple, int] | None:
    """((dtype, storage key, storage bytes, storage offset, size, stride), pickle length) of a
    torch.save tensor pickle, from its opcodes alone."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    try:
        for op, arg, pos in pickletools.genops(bytes(head[start : start + _PICKLE_MAX])):
            name = op.name
            if name in ("PROTO", "FRAME"):
                continue
            if name in _PUSH_ARG:
                stack.append(arg)
            elif name in _CONST:
                stack.append(_CONST[name])
            elif name == "GLOBAL":
                stack.append(_Global(*arg.split(" ", 1)))
            elif name == "STACK_GLOBAL":
                attr, module = stack.pop(), stack.pop()
                if not (isinstance(module, str) and isinstance(attr, str)):
                    return None
                stack.append(_Global(module, attr))
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                stack.append(memo[arg])
            elif name == "MARK":
                stack.append(_MARK)
            elif name == "TUPLE":
                at = max(i for i, x in enumerate(stack) if x is _MARK)
                items = tuple(stack[at + 1 :])
                del stack[at:]
                stack.append(items)
            elif name in ("EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
                n = ("EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3").index(name)
                items = tuple(stack[len(stack) - n :]) if n else ()
                del stack[len(stack) - n :]
                stack.append(items)
            elif name == "EMPTY_DICT":
                stack.append({})  # only an empty one is accepted below: no SETITEM(S) here
            elif name == "BINPERSID":
                stack.append(_PersistentId(stack.pop()))
            elif name == "REDUCE":
                args, func = stack.pop(), stack.pop()
                if not isinstance(args, tuple):
                    return None
                stack.append(_Call(func, args))
            elif name == "STOP":
                spec = _tensor_spec(stack.pop()) if len(stack) == 1 else None
                return (spec, pos + 1) if spec is not None else None
            else:
                return None
    except (ValueError, IndexError, KeyError, TypeError):  # truncated or malformed: not ours
        return None
    return None


def _tensor_spec(top: Any) -> tuple | None:
    """What a `_rebuild_tensor_v2/v3(storage, offset, size, stride, requires_grad, hooks,
    [dtype], [metadata])` call describes, if it is exactly that."""
    if not isinstance(top, _Call) or not isinstance(top.func, _Global) or top.func.module != "torch._utils":
        return None
    args = top.args
    if top.func.name == "_rebuild_tensor_v2" and len(args) in (6, 7):
        dtype, extra = None, args[6:]
    elif top.func.name == "_rebuild_tensor_v3" and len(args) in (7, 8):
        dtype, extra = _dtype(args[6]), args[7:]
        if dtype is None:
            return None
    else:
        return None
    pid, offset, size, stride, requires_grad, hooks = args[:6]
    if extra and extra[0] not in ({}, None):
        return None  # tensor metadata (conj, neg bits...): let torch.load apply it
    if not (isinstance(hooks, _Call) and isinstance(hooks.func, _Global) and hooks.func.is_("collections", "OrderedDict") and hooks.args == ()):
        return None
    if not (isinstance(pid, _PersistentId) and isinstance(pid.value, tuple) and len(pid.value) == 5):
        return None
    kind, storage_type, key, location, numel = pid.value
    if kind != "storage" or not isinstance(key, str) or not isinstance(location, str) or not isinstance(storage_type, _Global):
        return None
    if storage_type.module in ("torch", "torch.storage") and storage_type.name == "UntypedStorage":
        storage_bytes = numel if dtype is not None else None  # v3: numel counts bytes
    elif storage_type.module == "torch" and dtype is None and storage_type.name in _LEGACY_STORAGE:
        dtype = _LEGACY_STORAGE[storage_type.name]
        storage_bytes = numel * dtype.itemsize if _is_count(numel) else None
    else:
        return None
    ints = (numel, offset, *size, *stride) if isinstance(size, tuple) and isinstance(stride, tuple) else ()
    if storage_bytes is None or not ints or not all(_is_count(x) for x in ints) or len(size) != len(stride):
        return None
    if not isinstance(requires_grad, bool):
        return None
    return dtype, key, storage_bytes, offset, size, stride


def _dtype(g: Any) -> torch.dtype | None:
    if isinstance(g, _Global) and g.module == "torch" and g.name in _V3_DTYPES:
        return getattr(torch, g.name)
    return None


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0
