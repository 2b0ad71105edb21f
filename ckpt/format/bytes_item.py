"""The values DCP stores as bytes items (every value that is not a tensor: an optimizer's
hyperparameters, ckpt's counters, the RNG states), each a torch.save blob of its own, loaded
as `torch.load(weights_only=True)` loads them. torch.load costs 58-69 us for each here: with
many param groups, thousands of them per restore. So plain values (numbers, strings, None,
booleans, and tuples, lists and dicts of them) are unpickled by an unpickler that refuses
every global, and anything else goes to torch.load, whose allowlist decides.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from typing import Any

import torch

_PLAIN_RECORDS = frozenset(("data.pkl", ".format_version", ".storage_alignment", "byteorder", "version", "serialization_id"))
_NOT_PLAIN: Any = object()


class _PlainUnpickler(pickle._Unpickler):
    """Builds plain values only: a global (any class or function), an extension code (which
    stands for one) or a persistent id (a tensor's storage) is refused, so nothing is
    imported, called or rebuilt. What is left are the pickle opcodes of numbers, strings,
    None, booleans, and tuples, lists and dicts of them. The pure-Python unpickler, not the
    C one: its memo is a dict, so a forged memo index cannot make it allocate gigabytes, and
    its extension lookup can be refused (the C one answers from copyreg's cache)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"not a plain value: {module}.{name}")

    def get_extension(self, code: int) -> Any:
        raise pickle.UnpicklingError(f"not a plain value: extension code {code}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("not a plain value: a persistent id")


def load_value(blob: bytes | io.BytesIO) -> Any:
    """A value torch.save wrote (a DCP bytes item), as `torch.load(weights_only=True)` loads
    it. Plain values are unpickled without any global, about twice as fast (26 us against 58
    here); anything else (a tensor, an OrderedDict, a set, a class) goes to torch.load, whose
    allowlist decides. (The plain path also takes a few plain values torch's refuses, such as
    an int of thousands of digits; never anything that can import or call.)"""
    data = blob.getvalue() if isinstance(blob, io.BytesIO) else blob
    value = _plain(data)
    if value is _NOT_PLAIN:
        value = torch.load(io.BytesIO(data), weights_only=True)
    return value


def load_plain_pickle(blob: bytes, what: str) -> Any:
    """A pickle (`pickle.dumps`, not torch.save) of plain values only: numbers, strings, None,
    booleans, and tuples, lists and dicts of them. Anything else is refused, naming `what`."""
    if not isinstance(blob, bytes):
        raise ValueError(f"{what} is a {type(blob).__name__}, not a pickle")
    try:
        return _PlainUnpickler(io.BytesIO(blob)).load()
    except Exception as e:
        raise ValueError(f"{what} is not plain values ({type(e).__name__}: {e}): it is not loaded") from e


def _plain(blob: bytes) -> Any:
    """The plain value in a torch.save zip holding no storage, or _NOT_PLAIN."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            records = z.infolist()
            pkl = [r for r in records if r.filename.endswith("/data.pkl")]
            if len(pkl) != 1 or any(r.compress_type != zipfile.ZIP_STORED or r.filename.rsplit("/", 1)[-1] not in _PLAIN_RECORDS for r in records):
                return _NOT_PLAIN
            return _PlainUnpickler(io.BytesIO(z.read(pkl[0])), encoding="ASCII").load()
    except Exception:  # not a zip, a refused global, a broken pickle: torch.load says which
        return _NOT_PLAIN
