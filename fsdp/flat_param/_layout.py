"""Where a handle's original parameters sit in its flat parameter, and which part a rank holds.

The layout concern of :class:`~fsdp.flat_param.flat_param.FlatParamHandle`: the names of a
unit's parameters (:class:`ParamInfo`, :class:`SharedParamInfo`), their flat layout with its
padding and this rank's shard of it (:class:`ShardLayout`, built on the pure arithmetic of
``_sharding.py``), flattening the parameters into one tensor and cutting this rank's shard out
of it. Nothing here holds state that changes after construction.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp._common import p_assert
from fsdp.flat_param._sharding import FlatLayout, ParamShardSlice, flat_layout, padded_unsharded_numel, shard_bounds

__all__ = [
    "ALIGNMENT_PADDING_VALUE",
    "FLATTENED_ATTR",
    "FSDP_FLATTENED",
    "ParamInfo",
    "SharedParamInfo",
    "ShardParamInfo",
    "ShardLayout",
    "UnitParams",
    "collect_params",
    "itemsize",
    "local_tensor",
    "mark_flattened",
]

# What torch FSDP1 fills the alignment padding of a use_orig_params flat parameter with (a
# marker value; no computation reads it). Filling ours alike keeps local state dicts equal bit
# for bit between the two (see [Note: Aligned flat parameter layout] in _sharding.py).
ALIGNMENT_PADDING_VALUE = 42.0

# Set on an original Parameter once a handle has flattened it: (weakref to the handle, its name).
FLATTENED_ATTR = "_fsdp_flattened_into"
# torch's FSDP1 sets this to True on every FlatParameter and on the original parameters it
# flattened; stacks read it (Lightning's FSDP strategy checks that an optimizer holds FSDP's
# parameters with ``getattr(param, "_fsdp_flattened", False)``).
FSDP_FLATTENED = "_fsdp_flattened"


class ParamInfo(NamedTuple):
    """Where an original parameter lives: ``getattr(module, param_name)``.

    Attributes:
        param_name: Attribute name on the owning module (``"weight"``).
        module: The owning module.
        module_name: Qualified name of the owning module inside the unit's wrapped module.
        shape: Original shape (of the local tensor for a DTensor parameter).
        numel: Original number of elements (of the local tensor for a DTensor parameter).
        dtensor_spec: A DTensor parameter's spec (mesh, placements, global shape and stride),
            else None; see [Note: DTensor parameters].
    """

    param_name: str
    module: nn.Module
    module_name: str
    shape: torch.Size
    numel: int
    dtensor_spec: Optional[Any] = None

    @property
    def fqn(self) -> str:
        return f"{self.module_name}.{self.param_name}" if self.module_name else self.param_name


class SharedParamInfo(NamedTuple):
    """A second (or later) name for a parameter already flattened as ``param_infos[prim_index]``."""

    param_name: str
    module: nn.Module
    module_name: str
    prim_index: int

    @property
    def fqn(self) -> str:
        return f"{self.module_name}.{self.param_name}" if self.module_name else self.param_name


class ShardParamInfo(NamedTuple):
    """Which part of one original parameter this rank's shard holds (torch FSDP1's fields).

    Attributes:
        in_shard: Whether the shard holds any of it; the other fields are None if not.
        offset_in_shard: Where the part starts in the shard.
        numel_in_shard: The part's number of elements.
        intra_param_start_idx: The part's first element within the flattened parameter.
        intra_param_end_idx: The part's last element within the flattened parameter
            (inclusive).
    """

    in_shard: bool
    offset_in_shard: Optional[int]
    numel_in_shard: Optional[int]
    intra_param_start_idx: Optional[int]
    intra_param_end_idx: Optional[int]


class UnitParams(NamedTuple):
    """A unit's parameters, each Parameter once, with every name it has.

    Attributes:
        unique_params: The distinct Parameters, in flat order.
        param_infos: One :class:`ParamInfo` per entry of ``unique_params``.
        shared_param_infos: The further names of Parameters met before (tied weights).
        given_params: The distinct Parameters as the modules held them (DTensors included).
    """

    unique_params: list[nn.Parameter]
    param_infos: list[ParamInfo]
    shared_param_infos: list[SharedParamInfo]
    given_params: list[nn.Parameter]


# [Note: DTensor parameters] Tensor parallelism (``parallelize_module``) before FSDP leaves
# DTensor Parameters on the modules, each holding this rank's tp piece as its local tensor.
# A unit flattens the local tensors (so ParamInfo's shape and numel, the flat layout and the
# optimizer's 1-D shards are local: a DTensor Parameter becomes a plain Parameter of its local
# tensor, as torch FSDP1 makes it) and records each spec (mesh, placements, global shape and
# stride). Whatever shows the parameters in their original form (forward's views, the Parameters
# of summon_full_params) wraps the local view with ``DTensor.from_local(view, spec, no check)``:
# TP's forward runs on DTensors, and the wrapping is differentiable, so the gradient reaches the
# local view and from there the flat gradient. Sharding, gathering and reducing never see a
# DTensor, over the dp group only, as torch FSDP1 does.
def collect_params(params: Sequence[tuple[str, nn.Module, str, nn.Parameter]]) -> UnitParams:
    """Groups ``(module_name, module, param_name, param)`` entries: a Parameter met again
    (tied weights) becomes a :class:`SharedParamInfo` of its first name.

    A DTensor Parameter is replaced by a plain Parameter of its local tensor, its spec kept in
    its :class:`ParamInfo` ([Note: DTensor parameters])."""
    result = UnitParams([], [], [], [])
    index_of: dict[int, int] = {}
    for module_name, module, param_name, param in params:
        if id(param) in index_of:
            result.shared_param_infos.append(
                SharedParamInfo(param_name, module, module_name, index_of[id(param)])
            )
            continue
        index_of[id(param)] = len(result.unique_params)
        result.given_params.append(param)
        spec = None
        if isinstance(param, DTensor):
            spec = param._spec
            param = nn.Parameter(param._local_tensor.detach(), requires_grad=param.requires_grad)
        result.unique_params.append(param)
        result.param_infos.append(ParamInfo(param_name, module, module_name, param.shape, param.numel(), spec))
    p_assert(len(result.unique_params) > 0, "a FlatParamHandle needs at least one parameter")
    return result


def mark_flattened(handle: Any, unit_params: UnitParams) -> None:
    """Marks each original Parameter as flattened into ``handle``.

    So that another unit that meets the same Parameter (tied weights, wrapped by hand) fails
    with a clear error, whether or not the original is still alive elsewhere (see
    ``check_not_flattened_elsewhere``).
    """
    for params in (unit_params.given_params, unit_params.unique_params):
        for param, info in zip(params, unit_params.param_infos):
            setattr(param, FLATTENED_ATTR, (weakref.ref(handle), info.fqn))
            setattr(param, FSDP_FLATTENED, True)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """One handle's flat layout and this rank's shard of it (fixed at construction).

    Attributes:
        flat: Where each parameter and each run of alignment padding sits (see
            [Note: Aligned flat parameter layout] in ``_sharding.py``).
        param_shapes: The original parameters' shapes, in flat order.
        rank: This rank in the shard group.
        world_size: The shard group's size.
        uses_sharding: False for NO_SHARD and (but for [Note: CPU offload on one rank]) world
            size 1 (the local shard is then the
            whole flat parameter, unpadded).
        padded_unsharded_numel: Elements of the unsharded flat tensor once padded to a
            multiple of the world size (equal to the unpadded numel without sharding).
        sharded_numel: Elements of the local shard.
        shard_slices: Each parameter's part of the local shard (None where this rank holds
            none of it).
        sharded_ranges: The same as ``(offset in the local shard, numel)``, ``(0, 0)`` where
            this rank holds none.
        dtensor_specs: Each parameter's DTensor spec, None for a plain parameter
            ([Note: DTensor parameters]).
    """

    flat: FlatLayout
    param_shapes: tuple[torch.Size, ...]
    rank: int
    world_size: int
    uses_sharding: bool
    padded_unsharded_numel: int
    sharded_numel: int
    shard_slices: tuple[Optional[ParamShardSlice], ...]  # tuples: caches keyed by the layout rely on it
    sharded_ranges: tuple[tuple[int, int], ...]
    dtensor_specs: tuple[Optional[Any], ...] = ()

    @staticmethod
    def build(
        param_infos: Sequence[ParamInfo], rank: int, world_size: int, uses_sharding: bool, align_numel: int
    ) -> "ShardLayout":
        """Lays out ``param_infos`` (aligned to ``align_numel`` elements if not 0) for ``rank``."""
        flat = flat_layout([info.numel for info in param_infos], world_size, align_numel)
        unpadded = flat.unpadded_unsharded_numel
        padded = padded_unsharded_numel(unpadded, world_size) if uses_sharding else unpadded
        if uses_sharding:
            slices: list[Optional[ParamShardSlice]] = [None] * len(param_infos)
            for piece in flat.slices_in_shard(rank):
                slices[piece.param_index] = piece
        else:  # the local shard is the whole flat parameter
            slices = [
                ParamShardSlice(index, 0, numel, offset)
                for index, (offset, numel) in enumerate(zip(flat.param_offsets, flat.param_numels))
            ]
        ranges = [(0, 0) if piece is None else (piece.offset_in_shard, piece.numel) for piece in slices]
        return ShardLayout(
            flat,
            tuple(info.shape for info in param_infos),
            rank,
            world_size,
            uses_sharding,
            padded,
            padded // (world_size if uses_sharding else 1),
            tuple(slices),
            tuple(ranges),
            tuple(info.dtensor_spec for info in param_infos),
        )

    @property
    def unpadded_unsharded_numel(self) -> int:
        """Elements of the unsharded flat tensor before the shard padding."""
        return self.flat.unpadded_unsharded_numel

    def shard_bounds(self) -> tuple[int, int]:
        """``[start, end)`` of this rank's shard in the padded unsharded flat tensor."""
        return shard_bounds(self.unpadded_unsharded_numel, self.rank, self.world_size)

    def shard_numel_padded(self) -> int:
        """Padding elements in this rank's shard (torch FSDP1's ``_shard_numel_padded``)."""
        if not self.uses_sharding:
            return 0
        start, end = self.shard_bounds()
        return self.sharded_numel - max(min(end, self.unpadded_unsharded_numel) - start, 0)

    def flatten(self, unique_params: Sequence[nn.Parameter], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The unsharded flat tensor of ``unique_params`` in this layout (before shard padding)."""
        pieces: list[torch.Tensor] = []
        params = iter(unique_params)
        for numel, is_padding in zip(self.flat.numels_with_padding, self.flat.is_padding_mask):
            if is_padding:
                pieces.append(torch.full((numel,), ALIGNMENT_PADDING_VALUE, dtype=dtype, device=device))
            else:
                pieces.append(next(params).detach().reshape(-1).to(device))
        return torch.cat(pieces)

    def cut_local_shard(self, flat: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This rank's shard (``dtype``, on ``device``, zero-padded) of the unsharded ``flat``;
        ``flat`` itself when the handle does not shard."""
        if not self.uses_sharding:
            return flat
        start, end = self.shard_bounds()
        local_shard = torch.zeros(self.sharded_numel, dtype=dtype, device=device)
        valid = flat[start:end]
        local_shard[: valid.numel()].copy_(valid)
        return local_shard

    def local_slice(self, padded_unsharded: torch.Tensor) -> torch.Tensor:
        """This rank's shard-sized slice of a padded unsharded flat tensor."""
        if not self.uses_sharding:
            return padded_unsharded
        start, end = self.shard_bounds()
        return padded_unsharded[start:end]

    def unsharded_views(self, source: torch.Tensor) -> list[torch.Tensor]:
        """Views of a (padded) unsharded flat tensor shaped like the original parameters."""
        # Split the whole (padded) tensor, the padding as a last chunk, rather than slicing off
        # the padding first: the backward of a slice zero-fills a padded-size gradient and
        # copies into it, while split's backward writes each gradient straight into place and
        # zero-fills the padding only.
        # Alignment padding (use_orig_params) is split off the same way and skipped.
        sizes = list(self.flat.numels_with_padding)
        padding = source.numel() - self.unpadded_unsharded_numel
        if padding:
            sizes.append(padding)
        splits = torch.split(source, sizes)
        params = [split for split, is_padding in zip(splits, self.flat.is_padding_mask) if not is_padding]
        return [split.view(shape) for split, shape in zip(params, self.param_shapes)]

    @property
    def has_dtensors(self) -> bool:
        """Whether any parameter was a DTensor ([Note: DTensor parameters])."""
        return any(spec is not None for spec in self.dtensor_specs)

    def orig_tensors(self, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What the original parameter names hold for unsharded ``views`` (from
        :meth:`unsharded_views`): the view itself, or for a DTensor parameter a DTensor with the
        view as its local tensor and the parameter's recorded spec ([Note: DTensor
        parameters]). Differentiable: a DTensor's gradient flows into its view's."""
        if not self.has_dtensors:
            return list(views)
        return [view if spec is None else _as_dtensor(view, spec) for view, spec in zip(views, self.dtensor_specs)]

    def orig_sharded_view(self, source: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of a shard-shaped tensor (original shape if unsharded)."""
        offset, numel = self.sharded_ranges[index]
        view = source[offset : offset + numel]
        return view if self.uses_sharding else view.view(self.param_shapes[index])


def _wait_async_grad(grad: torch.Tensor) -> torch.Tensor:
    """A gradient a DTensor's backward left as an asynchronous collective's result, waited for."""
    wait = getattr(grad, "wait", None)
    return wait() if callable(wait) else grad


def _as_dtensor(local: torch.Tensor, spec: Any) -> torch.Tensor:
    """``local`` as the local tensor of a DTensor with ``spec``'s mesh, placements, global shape
    and stride (no communication, no check)."""
    result = DTensor.from_local(
        local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
    )
    if local.requires_grad:
        local.register_hook(_wait_async_grad)
    return result


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, any other tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
