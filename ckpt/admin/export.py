"""`ckpt export`: a checkpoint's tensors, whole (every shard put together), in the format the
next tool wants, and `read_export` to load one back.

- safetensors: one file, written as the tensors are read (memory: one batch of tensors, not
  the model); objects (counters, the scheduler's state) cannot go in and are listed in its
  `__metadata__`.
- torch: one `torch.save` file of a flat dict, objects included (memory: the whole state).
- zarr: a directory with one zarr v3 array per tensor, written through tensorstore (readable
  by zarr-python and JAX tooling); objects cannot go in.

Keys are the checkpoint's flat keys (`model.0.weight`, `optim.state.0.weight.exp_avg`);
`model_only` keeps the model's and drops the `model.` prefix, so that
`model.load_state_dict(ckpt.read_export(path))` takes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
from typing import Any

from ckpt.admin import tools
from ckpt.errors import CheckpointError
from ckpt.storage import catalog
from ckpt.storage.store import Store

FORMATS = ("safetensors", "torch", "zarr")
_ZARR_SUFFIX = "zarr.json"


def export(
    store: Store,
    entry: catalog.Entry,
    fmt: str,
    out: str,
    *,
    model_only: bool = False,
    dtype: str | None = None,
    progress: bool | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Write the checkpoint's tensors to `out`, a new file or directory (`force`: a file there
    is replaced). Returns what was written: tensors, bytes, the objects left out."""
    import torch

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    cast = getattr(torch, dtype, None) if dtype else None
    if dtype and not (isinstance(cast, torch.dtype) and cast.is_floating_point):
        raise ValueError(f"--dtype must be a floating dtype (bfloat16, float16, float32), not {dtype!r}")
    _check_out(store, fmt, out, force)
    md = tools.inventory(store, entry)
    keys = sorted(k for k in md.state_dict_metadata if not model_only or k.startswith("model."))
    if not keys:
        raise CheckpointError(f"{store.display}/{entry.dir} holds no {'model ' if model_only else ''}tensors")
    names = {k: k.removeprefix("model.") if model_only else k for k in keys}
    tensor_keys = [k for k in keys if hasattr(md.state_dict_metadata[k], "size")]  # the rest are objects
    objects = [k for k in keys if k not in tensor_keys]
    if fmt == "zarr":  # before anything is written
        for k in tensor_keys:
            _zarr_dtype(out_dtype_of(md.state_dict_metadata[k], cast))
        _check_zarr_names([names[k] for k in tensor_keys], store, entry)

    def out_dtype(key: str) -> Any:
        return out_dtype_of(md.state_dict_metadata[key], cast)

    bar = tools.Progress(sum(tools.tensor_bytes(md.state_dict_metadata[k]) for k in tensor_keys), f"export {fmt}", progress)
    written = 0
    try:
        if fmt == "torch":
            state: dict[str, Any] = {}
            for group in tools.batches(md, keys):
                for k, v in tools.read_whole(store, entry, group, md).items():
                    state[names[k]] = v.to(out_dtype(k)) if isinstance(v, torch.Tensor) else v
                    bar.add(tools.tensor_bytes(md.state_dict_metadata[k]))
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            fd, part = _new_part(out)
            try:
                with os.fdopen(fd, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(part, out)  # IMPORTANT: `out` appears whole or not at all
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(part)
                raise
            _sync_dir(os.path.dirname(os.path.abspath(out)))
            written = os.path.getsize(out)
            objects = []
        elif fmt == "safetensors":
            shapes = {k: (tuple(md.state_dict_metadata[k].size), out_dtype(k)) for k in tensor_keys}
            with _SafetensorsWriter(out, {names[k]: shapes[k] for k in tensor_keys}, {"ckpt.step": str(entry.step), "ckpt.objects_left_out": json.dumps([names[k] for k in objects])}) as w:
                for group in tools.batches(md, tensor_keys):
                    for k, v in tools.read_whole(store, entry, group, md).items():
                        w.write(names[k], v.to(out_dtype(k)))
                        bar.add(tools.tensor_bytes(md.state_dict_metadata[k]))
            written = os.path.getsize(out)
        else:
            # IMPORTANT: written into a directory of its own, moved into place once whole: a
            # directory of some of the arrays would read back as a smaller checkpoint.
            place = os.path.realpath(out.rstrip(os.sep) or out)
            there = os.path.isdir(place)  # empty (_check_out): made by the user, a mount point, "."
            # Beside `place`, or inside it when it is there: on its filesystem, whichever it is.
            part = _new_part(os.path.join(place, "export") if there else place, directory=True)[1]
            try:
                for group in tools.batches(md, tensor_keys):
                    for k, v in tools.read_whole(store, entry, group, md).items():
                        written += _write_zarr(os.path.join(part, names[k]), v.to(out_dtype(k)))
                        bar.add(tools.tensor_bytes(md.state_dict_metadata[k]))
                _move_into(part, place, there)
            except BaseException:
                shutil.rmtree(part, ignore_errors=True)
                raise
            _sync_dir(place if there else os.path.dirname(place))
    finally:
        bar.close()
    return {"tensors": len(tensor_keys), "bytes": written, "objects_left_out": [names[k] for k in objects]}


def out_dtype_of(item: Any, cast: Any) -> Any:
    """What a tensor is exported as: `cast` for a floating one. Scalars keep theirs: an
    optimizer's step count is a float tensor, and bfloat16 counts exactly only to 256."""
    return cast if cast is not None and item.properties.dtype.is_floating_point and len(item.size) > 0 else item.properties.dtype


def _check_out(store: Store, fmt: str, out: str, force: bool) -> None:
    """`--out` is a place an export may be written: never inside the checkpoint root (a typo
    must not overwrite a checkpoint's file), never over what is there unless `force` (a file)."""
    if not out or (fmt != "zarr" and out.endswith(os.sep)):
        raise ValueError(f"--out {out!r} is not a {'directory' if fmt == 'zarr' else 'file'} name")
    if store.is_local:
        root, where = os.path.realpath(store.root), os.path.realpath(out)
        if where == root or where.startswith(root + os.sep):
            raise ValueError(f"--out {out} is inside the checkpoint root {store.display}: export somewhere else")
    if fmt == "zarr":
        if os.path.exists(out) and not os.path.isdir(out):
            raise ValueError(f"--out {out} is a file: a zarr export is a directory")
        if os.path.isdir(out) and os.listdir(out):
            raise ValueError(f"--out {out} is a directory that holds files: a zarr export goes to a new or empty one")
    elif os.path.isdir(out):
        raise ValueError(f"--out {out} is a directory: a {fmt} export is one file")
    elif os.path.lexists(out) and not force:
        raise ValueError(f"--out {out} exists; --force replaces it")


def _new_part(path: str, directory: bool = False) -> tuple[int, str]:
    """A new file (or `directory`: fd -1) of our own beside `path` to write it into, then
    renamed to it; its mode as the umask says, like a file or directory made the usual way."""
    where = dict(prefix=f".{os.path.basename(path)}.", suffix=".part", dir=os.path.dirname(os.path.abspath(path)))
    umask = os.umask(0)
    os.umask(umask)
    if directory:
        os.makedirs(where["dir"], exist_ok=True)
        part = tempfile.mkdtemp(**where)
        os.chmod(part, 0o777 & ~umask)
        return -1, part
    fd, part = tempfile.mkstemp(**where)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, part


def _move_into(part: str, place: str, there: bool) -> None:
    """The finished directory `part` becomes `place`: renamed to it, or where `place` is a
    directory already (`part` inside it), its entries moved up into it one by one, and taken
    out again if one cannot be: nothing but the whole export is left there."""
    if not there:
        os.rename(part, place)
        return
    moved: list[str] = []
    try:
        for name in os.listdir(part):
            os.rename(os.path.join(part, name), os.path.join(place, name))
            moved.append(name)
    except BaseException:
        for name in moved:
            shutil.rmtree(os.path.join(place, name), ignore_errors=True)
        raise
    os.rmdir(part)


def _sync_dir(directory: str) -> None:
    """Make the entries just renamed into `directory` durable."""
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_export(path: str) -> dict[str, Any]:
    """An export read back: a zarr directory, a `.safetensors` file, or else a torch file
    (loaded with `weights_only=True`). Tensors come back as they were written, on the CPU."""
    import torch

    if os.path.isdir(path):
        return _read_zarr(path)
    if path.endswith(".safetensors") or _is_safetensors(path):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, weights_only=True)


def _is_safetensors(path: str) -> bool:
    """By its first bytes: a u64 header size, then the JSON header (a torch file is a zip)."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < os.path.getsize(path)


# -- safetensors, written as the tensors come ----------------------------------------------------
_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "uint16": "U16", "uint32": "U32", "uint64": "U64",
}  # fmt: skip


class _SafetensorsWriter:
    """The safetensors layout (a little-endian u64 header size, a JSON header with every
    tensor's dtype, shape and byte range, the raw bytes in that order), written as the
    tensors come: the header is known from the checkpoint's metadata beforehand."""

    def __init__(self, path: str, tensors: dict[str, tuple[tuple[int, ...], Any]], meta: dict[str, str]) -> None:
        header: dict[str, Any] = {"__metadata__": meta}
        offset = 0
        for name, (shape, dtype) in tensors.items():
            code = _SAFETENSORS_DTYPES.get(str(dtype).removeprefix("torch."))
            if code is None:
                raise CheckpointError(f"{name}: safetensors has no {dtype}")
            n = dtype.itemsize
            for s in shape:
                n *= s
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._order = list(tensors)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd, self._tmp = _new_part(path)
        self._path = path
        self._f = os.fdopen(fd, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._pending: dict[str, Any] = {}

    def write(self, name: str, tensor: Any) -> None:
        """Tensors may come in any order; each is written when its turn comes."""
        import torch

        self._pending[name] = tensor
        while self._order and self._order[0] in self._pending:
            t = self._pending.pop(self._order.pop(0)).detach().cpu().contiguous()
            if t.numel():
                self._f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))

    def __enter__(self) -> _SafetensorsWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        whole = exc_type is None and not self._order
        try:
            with self._f:
                if whole:
                    self._f.flush()
                    os.fsync(self._f.fileno())
            if whole:
                os.replace(self._tmp, self._path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._tmp)
            raise
        if whole:
            _sync_dir(os.path.dirname(os.path.abspath(self._path)))
            return
        os.remove(self._tmp)
        if exc_type is None:
            raise CheckpointError(f"export to {self._path}: tensors missing: {self._order[:5]}")


# -- zarr v3 through tensorstore ------------------------------------------------------------------
def _zarr_dtype(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"):
        raise CheckpointError(f"zarr has no {name}")
    return name


def _check_zarr_names(names: list[str], store: Store, entry: catalog.Entry) -> None:
    """Each array is the directory `out/<name>`, replaced if there (tensorstore's
    `delete_existing`): a name that is absolute or climbs out (`..`, a module named
    "/etc"), or that holds another array inside it, would write, or delete, outside its own.
    The names come from `.metadata`, which anyone who can write the root can plant."""
    given = set(names)
    for name in names:
        parts = name.split("/")
        if name.startswith(("/", os.sep)) or any(p in ("", ".", "..") for p in parts) or "\0" in name:
            raise CheckpointError(f"{store.display}/{entry.dir}: the tensor {name!r} cannot be a zarr array's path under --out")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in given:
                raise CheckpointError(
                    f"{store.display}/{entry.dir}: the tensors {'/'.join(parts[:i])!r} and {name!r} would be zarr arrays "
                    "one inside the other: export them as safetensors or torch"
                )


def _write_zarr(path: str, tensor: Any) -> int:
    import tensorstore as ts

    array = _to_numpy(tensor)
    store = ts.open(
        {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": path},
            "metadata": {"shape": list(array.shape), "data_type": _zarr_dtype(tensor.dtype)},
        },
        create=True,
        delete_existing=True,
    ).result()
    store.write(array).result()
    return array.nbytes


def _read_zarr(root: str) -> dict[str, Any]:
    import tensorstore as ts
    import torch

    out: dict[str, Any] = {}
    for base, _, files in os.walk(root):
        doc = json.load(open(os.path.join(base, _ZARR_SUFFIX))) if _ZARR_SUFFIX in files else {}
        if doc.get("node_type") != "array":
            continue
        array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": base}}).result().read().result()
        name = os.path.relpath(base, root)
        if str(array.dtype) == "bfloat16":
            out[name] = torch.from_numpy(array.view("int16").copy()).view(torch.bfloat16)
        else:
            out[name] = torch.from_numpy(array.copy())
    return out


def _to_numpy(tensor: Any) -> Any:
    import torch

    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
