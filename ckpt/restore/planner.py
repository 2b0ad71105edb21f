"""DCP's load planner for ckpt: pickled values load with `weights_only=True` (checksum-
verified bytes may still have been written by someone else, so no code runs from them),
values a restore may do without are left as they are, and each distinct tensor layout's
read items are worked out once.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import (
    _create_chunk_list,
    _create_read_items,
    create_read_items_for_chunk_list,
)
from torch.distributed.tensor import DTensor

from ckpt.format import bytes_item
from ckpt.format.dcp_index import held_keys

_OPTIM_STATE = "optim.state."  # DCP's flattened keys of the optimizers' state: <this><param fqn>.<name>


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but pickled values load with `weights_only=True`: checksum-verified
    bytes may still have been written by someone else, so no code runs from them. Values for
    which `optional` says so may be missing from the checkpoint: they are left as they are."""

    def __init__(self, optional: Callable[[str], bool] = lambda fqn: False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optional = optional
        #: Parameters (FQNs) the checkpoint holds no optimizer state for: no step had reached
        #: them when it was saved (an expert no token was routed to). DCP made theirs up for
        #: the state loaded into; `TrainingState.drop_optimizer_state` removes it again.
        self.stateless: set[str] = set()

    def create_local_plan(self) -> LoadPlan:
        """DCP's default local plan (`create_default_local_load_plan`: a read item per piece
        of every value, strict unless `allow_partial_load`), with each distinct tensor layout's
        arithmetic done once: the parameters and the optimizer's moments of a model's layers
        share a few layouts, and DCP works out each of them again for every tensor (DTensor's
        shard geometry, then the overlaps with the saved chunks), a third of a 100 MB restore's
        fixed cost. Unlike DCP it does not probe for keys flattened as torch 2.3 did: ckpt
        needs torch 2.6 or later, so no checkpoint of its own has them."""
        if self.metadata is None:
            raise AssertionError("create_local_plan before set_up_planner")
        stored = self.metadata.state_dict_metadata
        with_state = {k.rpartition(".")[0] for k in stored if k.startswith(_OPTIM_STATE)}
        chunks: dict[tuple[Any, ...], list[ChunkStorageMetadata]] = {}
        reads: dict[tuple[Any, ...], list[ReadItem]] = {}
        items: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            md = stored.get(fqn)
            if md is None:
                if self.allow_partial_load or self.optional(fqn):
                    continue
                param = fqn.rpartition(".")[0]
                if fqn.startswith(_OPTIM_STATE) and param not in with_state:  # none of its state, not a key of it
                    self.stateless.add(param.removeprefix(_OPTIM_STATE))
                    continue
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            if not (isinstance(md, TensorStorageMetadata) and isinstance(obj, torch.Tensor)):
                items += _create_read_items(fqn, md, obj)  # bytes, or a mismatch DCP words
                continue
            if md.size != obj.size():
                raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue  # this rank holds none of it
            mine = chunks_once(obj, chunks)
            key = (tuple((c.offsets, c.sizes) for c in md.chunks), tuple((c.offsets, c.sizes) for c in mine))
            done = reads.get(key)
            if done is None:
                reads[key] = done = create_read_items_for_chunk_list(fqn, md, mine)
                items += done
            else:
                items += [_renamed(item, fqn) for item in done]
        return LoadPlan(items)

    def unasked(self, prefixes: tuple[str, ...]) -> list[str]:
        """The values under `prefixes` that the checkpoint holds and the state loaded into did
        not ask for (DCP leaves them unread: an object that builds its state lazily, a layer
        removed since the save)."""
        if self.metadata is None:
            return []
        return sorted(k for k in held_keys(self.metadata) if k.startswith(prefixes) and k not in self.state_dict)

    def not_in_checkpoint(self, prefix: str) -> list[str]:
        """The values under `prefix` asked for that the checkpoint lacks (`optional` let them
        be: they were left as they are)."""
        stored = self.metadata.state_dict_metadata if self.metadata is not None else {}
        return sorted(k for k in self.state_dict if k.startswith(prefix) and k not in stored)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """DCP's lookup, but a DTensor's shard is its local tensor as it is, not through
        `to_local()`, an autograd function that costs more than reading a small tensor: the
        same memory, which the reader detaches anyway."""
        obj = self.state_dict.get(index.fqn)
        if type(obj) is DTensor and type(obj._local_tensor) is torch.Tensor and not any(p.is_partial() for p in obj.placements):
            return obj._local_tensor
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = bytes_item.load_value(value)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def chunks_once(t: torch.Tensor, memo: dict[tuple[Any, ...], list[ChunkStorageMetadata]]) -> list[ChunkStorageMetadata]:
    """DCP's local chunks of `t` (`_create_chunk_list`), worked out once per layout in `memo`:
    a DTensor's depend on its global shape, mesh and placements, a plain tensor's on its
    shape. Other kinds (a ShardedTensor, a DTensor over a tensor subclass) are asked each time."""
    if isinstance(t, DTensor):
        if hasattr(t._local_tensor, "__create_chunk_list__"):
            return _create_chunk_list(t)
        key: tuple[Any, ...] = (t.shape, id(t.device_mesh), tuple(t.placements))  # meshes outlive the plan
    elif hasattr(t, "__create_chunk_list__") or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return _create_chunk_list(t)
    else:
        key = (t.shape,)
    found = memo.get(key)
    if found is None:
        memo[key] = found = _create_chunk_list(t)
    return found


def _renamed(item: ReadItem, fqn: str) -> ReadItem:
    """A read item planned for another value of the same layout, for the value `fqn`."""
    return ReadItem(  # not dataclasses.replace: a third of the time, for every tensor
        item.type,
        MetadataIndex(fqn, item.dest_index.offset, item.dest_index.index),
        item.dest_offsets,
        MetadataIndex(fqn, item.storage_index.offset, item.storage_index.index),
        item.storage_offsets,
        item.lengths,
    )
