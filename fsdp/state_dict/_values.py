"""State-dict values: the kinds a value takes, and how each kind is made, checked and read.

- FULL values are full tensors the caller owns, gathered straight into the tensor returned
  ([Note: State dict gathers]); the model's and the optimizer's FULL state dicts use them.
- SHARDED values are chunked along dim 0 over a unit's shard group like ``torch.chunk`` (rank
  ``r`` holds rows ``[r * ceil(d0 / ws), ...)``, possibly none: [Note: Row chunks] in
  ``flat_param/_shard_map.py``), which is the layout torch FSDP1 uses for both its ShardedTensor
  and its DTensor values; see [Note: Sharded state dict values] in docs/design.md. We give
  torch FSDP1's types ([Note: Sharded value forms]); loading accepts a full tensor, a DTensor
  over a 1-D mesh of exactly this group or on the unit's hybrid mesh, or a ShardedTensor with
  exactly this chunk layout; anything else (typically a state dict written with ``torch.save``
  at another world size) is refused with the saved and the current layout before anything
  changes.
- LOCAL values are each unit's local flat shard in torch FSDP1's exact format
  ([Note: Local state dict format]).
- An optimizer state value is one of the :class:`ValueKind` s, asked once per value
  ([Note: No ShardedTensor]).
"""

from __future__ import annotations

import contextlib
import enum
import math
import warnings
import weakref
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec.api import _infer_sharding_spec_from_shards_metadata
from torch.distributed.remote_device import _remote_device

from fsdp._common import p_assert
from fsdp._comm import _collectives as comm
from fsdp.flat_param._shard_map import chunk_rows, torch_chunks
from fsdp.flat_param.flat_param import FlatParamHandle
from fsdp.runtime._state import UnitState

__all__ = [
    "NOBODY",
    "PendingGather",
    "start_gather",
    "gather",
    "local_form",
    "parent_mesh",
    "tp_dtensor",
    "to_2d_dtensor",
    "tp_local",
    "ShardedForm",
    "check_sharded_value",
    "full_value",
    "is_dtensor",
    "is_sharded_tensor",
    "gather_chunked_rows",
    "local_value",
    "check_local_value",
    "load_local_value",
    "ValueKind",
    "LOCAL_WITH_MESH",
    "refuse_local_with_mesh",
]


# ----------------------------------------------------------------------------- FULL values
# [Note: State dict gathers]
# A FULL state dict (model or optimizer) returns full tensors that the caller owns. Gathering
# into a buffer that is then copied (the unshard buffer, then one clone per parameter) costs
# twice the memory traffic; here each gather writes straight into a tensor allocated for the
# result, and the per-parameter values are views of it (the padding at its end is a few
# elements).
#
# Who receives:
#
# - ``dst=None``: every rank (one all-gather into the fresh tensor).
# - ``dst=NOBODY``: no rank of this group keeps the result (with hybrid sharding, the rank that
#   saves is in another replica's group): nothing is communicated.
# - ``dst=<group rank>`` (``rank0_only``): one collective, ``fsdp._comm._collectives.gather_flat_to``
#   ([Note: Gather to one rank] there). Each rank sends its shard from where it lives (no copy,
#   no allocation: a rank that keeps nothing never holds an unsharded unit); the receiver gets
#   every shard in place, in its chunk of the fresh tensor (no staging buffer). Each shard moves
#   once, to the receiver, where an all-gather moves every shard to every rank.
#
# As for any collective, the callers issue these gathers in the same order on every rank of the
# group.

#: ``dst`` for a gather whose result no rank of the group keeps.
NOBODY = -1


class PendingGather:
    """A gather in flight; :meth:`wait` returns the padded unsharded tensor (None if not kept)."""

    def __init__(self, padded_unsharded: Optional[torch.Tensor], works: list[Any]) -> None:
        self._padded_unsharded = padded_unsharded
        self._works = works

    def wait(self) -> Optional[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._works = []
        return self._padded_unsharded


def start_gather(
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    rank: int,
    world_size: int,
    dst: Optional[int],
) -> PendingGather:
    """Starts gathering the equal-sized 1-D shards of ``group`` into a new padded unsharded tensor.

    Args:
        shard: This rank's 1-D shard (``padded_numel / world_size`` elements), on the device
            the group communicates on.
        group: The group the shards are spread over; ``rank`` / ``world_size`` in it.
        dst: The group rank that receives, None for every rank, :data:`NOBODY` for none.

    Returns:
        A :class:`PendingGather` whose result is a fresh tensor of ``world_size * shard.numel()``
        elements on the receiving ranks and None on the others.
    """
    if dst == NOBODY:
        return PendingGather(None, [])
    shard = shard.contiguous()
    if dst is None:
        everyone = shard.new_empty(world_size * shard.numel())
        comm.all_gather_flat(everyone, shard, group)
        return PendingGather(everyone, [])
    received = shard.new_empty(world_size * shard.numel()) if rank == dst else None
    work = comm.gather_flat_to(received, shard, group, dst, async_op=True)
    return PendingGather(received, [work])


def gather(
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    rank: int,
    world_size: int,
    dst: Optional[int],
) -> Optional[torch.Tensor]:
    """:func:`start_gather`, waited for."""
    return start_gather(shard, group, rank, world_size, dst).wait()


# ----------------------------------------------------------------------------- SHARDED values
# [Note: Value meshes are cached weakly]
# A zero-dimension SHARDED value of a model built without a mesh is a Replicate() DTensor over
# the 1-D mesh of the unit's group ([Note: Sharded value forms]); building that mesh costs
# about 100 us, so one mesh serves every such value. The cache holds meshes weakly:
# a mesh holds its process group, and a strong module-level cache would keep every group (and
# gloo's worker threads) alive after ``destroy_process_group()``, until the interpreter's own
# teardown, where a gloo worker still releasing a finished collective's tensors needs the GIL
# and aborts the process (torch issue #190489). Keying by ``id(group)`` is sound because a live
# entry's mesh keeps its group alive, so the id cannot be reused while the entry exists.
_MESHES: "weakref.WeakValueDictionary[tuple[int, str], Any]" = weakref.WeakValueDictionary()


def _mesh_for(group: dist.ProcessGroup, device: torch.device) -> Any:
    """The 1-D DeviceMesh of ``group`` for ``device``'s type, shared by every value alive
    ([Note: Value meshes are cached weakly])."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (id(group), device.type)
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = DeviceMesh.from_group(group, device.type)
        _MESHES[key] = mesh
    return mesh


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor."""
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is a (deprecated) ShardedTensor, as torch FSDP1 gives without a mesh."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def _group_ranks(group: dist.ProcessGroup) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def parent_mesh(state: UnitState) -> Any:
    """The 2-D (or larger) mesh the unit's 1-D ``device_mesh`` was sliced from, else None.

    Set for FSDP over the dp dimension of a (dp, tp) mesh: SHARDED values are then DTensors on
    that mesh ([Note: 2-D sharded values]).
    """
    mesh = state.device_mesh
    if mesh is None or mesh.ndim != 1:
        return None
    root = mesh._get_root_mesh()
    return root if root is not None and root.ndim >= 2 and root != mesh else None


# [Note: 2-D sharded values] With FSDP over the dp slice of a (dp, tp) mesh, torch FSDP1 gives
# every SHARDED value as a DTensor on the whole mesh: a tensor-parallel parameter with
# placements (Shard(0), its tp placement), any other value (Shard(0), Replicate()); its local
# tensor is this dp rank's ``torch.chunk`` rows of the tp-local tensor. We build the same
# DTensor the same way, as a redistribution from (Replicate(), tp placement) that only chunks
# locally, so the layout is DTensor's own, and read one back the opposite way (an all-gather
# over dp that leaves the tp-local tensor, see :func:`local_form`).
def _to_2d_dtensor(value: torch.Tensor, root: Any, offload: bool) -> Any:
    from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

    tp_placement = value.placements[-1] if isinstance(value, DTensor) else Replicate()
    local = value.to_local() if isinstance(value, DTensor) else value
    replicated: list[Placement] = [Replicate()] * root.ndim
    replicated[-1] = tp_placement
    sharded: list[Placement] = [Replicate()] * root.ndim
    sharded[-2], sharded[-1] = Shard(0), tp_placement
    result = DTensor.from_local(local, root, replicated, run_check=False).redistribute(root, sharded)
    result = DTensor.from_local(
        result.to_local().clone(), root, sharded, run_check=False, shape=result.shape, stride=result.stride()
    )
    return result.cpu() if offload else result


def to_2d_dtensor(value: torch.Tensor, spec: Any, root: Any, offload: bool) -> Any:
    """The 2-D SHARDED value torch FSDP1 gives for a parameter's tp-local full ``value`` (an
    optimizer state, say): ``spec``, the parameter's DTensor spec (None for a plain parameter),
    ``root``, the unit's parent mesh ([Note: 2-D sharded values])."""
    return _to_2d_dtensor(value if spec is None else tp_dtensor(value, spec), root, offload)


def tp_dtensor(local: torch.Tensor, spec: Any) -> Any:
    """``local`` (a tp-local tensor of a tensor-parallel parameter) as the DTensor on the tp mesh
    with the parameter's placements, global shape and stride ``spec``: a FULL value of it as
    torch FSDP1 gives it. No communication."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)


# [Note: Tensor-parallel values to load] A value given for a tensor-parallel parameter (DTensor
# spec ``spec``) is loaded as its tp-local tensor, whatever form it comes in: our own (or torch
# FSDP1's) FULL value, a DTensor with the parameter's tp mesh and placements, is its local
# tensor; a SHARDED one, a 2-D DTensor on the unit's parent mesh with the parameter's tp
# placement last, is gathered over dp only (torch FSDP1's way); any other DTensor (another
# mesh, e.g. a checkpoint of another layout loaded by DCP into such a template) is made full and
# cut; a ShardedTensor (torch FSDP1's SHARDED optimizer values of a model without a mesh, via
# ``optim_state_dict_to_load``) is gathered over its group and cut; a plain full tensor (a model
# without tensor parallelism saved it: a model state dict's value of the parameter's global
# shape, see :func:`local_form`, or an optimizer state's) is cut to this rank's tp piece with
# DTensor's own arithmetic (``compute_local_shape_and_global_offset``), no communication.
# Collective for the 2-D and foreign DTensors and ShardedTensors: every rank converts the same
# entries in the same order.
def tp_local(value: Any, spec: Any, root: Any, device: torch.device) -> torch.Tensor:
    """The tp-local tensor of ``value`` for a tensor-parallel parameter with DTensor spec
    ``spec`` (on a unit whose parent mesh is ``root``, None if none; a ShardedTensor is gathered
    on the compute ``device``); see [Note: Tensor-parallel values to load]."""
    from torch.distributed.tensor import DTensor, Placement, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(value, DTensor):
        placements = tuple(value.placements)
        if value.device_mesh == spec.mesh and placements == tuple(spec.placements):
            return value.to_local()
        if root is not None and value.device_mesh == root and placements[-1] == spec.placements[-1]:
            gathered: list[Placement] = [Replicate()] * root.ndim
            gathered[-1] = spec.placements[-1]
            return value.redistribute(root, gathered).to_local()
        value = value.full_tensor()
    elif is_sharded_tensor(value):
        value = ValueKind.SHARDED_TENSOR.full_tensor(value, "a value of a tensor-parallel parameter", device)
    shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
    return value[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def local_form(value: Any, state: UnitState, spec: Any = None) -> Any:
    """A value of a managed parameter as the unit holds it: a 2-D DTensor on the parent mesh
    ([Note: 2-D sharded values]) gathered over dp, a tp DTensor (FULL) its local tensor, a plain
    full tensor of a tensor-parallel parameter (DTensor spec ``spec``, None for a plain
    parameter) of the parameter's global shape its tp piece ([Note: Tensor-parallel values to
    load]); any other value itself. Collective for a 2-D DTensor (every dp rank calls it in the
    same order)."""
    from torch.distributed.tensor import DTensor, Placement, Replicate

    if not isinstance(value, DTensor):
        if (
            spec is not None
            and not is_sharded_tensor(value)
            and torch.overrides.is_tensor_like(value)
            and tuple(value.shape) == tuple(spec.shape)
        ):
            return tp_local(value, spec, None, state.compute_device)  # a cut, no communication
        return value
    root = parent_mesh(state)
    if root is not None and value.device_mesh == root:
        placements: list[Placement] = [Replicate()] * root.ndim
        placements[-1] = value.placements[-1]
        return value.redistribute(root, placements).to_local()
    if root is not None and value.device_mesh.ndim == 1 and value.device_mesh != state.device_mesh:
        return value.to_local()  # a FULL value of a tensor-parallel parameter
    return value


# [Note: Sharded value forms]
# A SHARDED value (model or optimizer state) takes the form torch FSDP1 gives for the unit:
#
# - built without ``device_mesh``: a ``ShardedTensor`` over the unit's shard group (with hybrid
#   sharding, the group inside a replica), one local shard of this rank's ``torch.chunk`` rows
#   ([Note: Row chunks] in ``fsdp/flat_param/_shard_map.py``), global metadata listing
#   ``torch.chunk``'s pieces with placements ``rank:<global rank>/<the group's device>`` (``cpu``
#   for gloo, even with CUDA tensors); the local shard's own metadata names the group rank and
#   the tensor's device, as torch FSDP1's does. ``offload_to_cpu``: the local
#   shard is in host memory and every placement says ``cpu`` (torch's ``ShardedTensor.cpu()``);
#   otherwise it is on the device the unit computes on.
# - built with ``device_mesh``: a ``DTensor`` on that mesh, ``Shard(0)`` on a 1-D mesh,
#   ``(Replicate(), Shard(0))`` on a hybrid-sharding 2-D mesh; the local tensor is the same rows.
#   ``offload_to_cpu``: ``DTensor.cpu()`` (the mesh stays, the local tensor moves).
# - FSDP over the dp dimension of a (dp, tp) mesh: the 2-D DTensors of [Note: 2-D sharded values].
# - a zero-dimension value (torch FSDP1 fails to chunk one): a ``Replicate()`` DTensor.
#
# Everything that is the same for every value of a unit (the group's global ranks, each rank's
# placement, the mesh) is computed once per unit per state dict in a :class:`ShardedForm`; per
# value only the chunk is cloned and the metadata objects are made (the sharding spec torch would
# infer from them is inferred once per shape). The global-metadata
# placements (``_remote_device`` objects) are shared by the values of one form: torch copies
# metadata before changing it (``ShardedTensor.cpu()`` deep-copies).


class ShardedForm:
    """How one unit's SHARDED values are made and read ([Note: Sharded value forms]).

    Args:
        state: The unit; its shard group, rank, mesh and compute device are read once.
    """

    def __init__(self, state: UnitState) -> None:
        self.group = state.process_group
        self.rank = state.rank
        self.world_size = state.world_size
        self.device_mesh = state.device_mesh
        self.root = parent_mesh(state)
        self.compute_device = state.compute_device
        self._global_ranks: Optional[list[int]] = None
        self._placements: dict[str, list[Any]] = {}
        self._specs: dict[tuple[tuple[int, ...], str], Any] = {}

    @property
    def gives_sharded_tensors(self) -> bool:
        """Whether values of dimension > 0 are ShardedTensors (no ``device_mesh``)."""
        return self.device_mesh is None

    def global_ranks(self) -> list[int]:
        """The shard group's global ranks, in group-rank order."""
        if self._global_ranks is None:
            self._global_ranks = _group_ranks(self.group)
        return self._global_ranks

    def value(self, full: torch.Tensor, offload: bool) -> Any:
        """The SHARDED value of the full per-parameter tensor ``full`` (owned; ``full`` may be
        a view of anything, it is not kept)."""
        if full.dim() == 0:
            return self._replicated(full, offload)
        if self.root is not None:
            return _to_2d_dtensor(full, self.root, offload)
        chunk = chunk_rows(full.shape[0], self.world_size, self.rank)
        local = full.narrow(0, chunk.first_row, chunk.num_rows)
        if self.device_mesh is None:
            return self._sharded_tensor(full, local, offload)
        from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

        placements: list[Placement] = [Replicate()] * self.device_mesh.ndim
        placements[-1] = Shard(0)
        value = DTensor.from_local(
            local.clone(), self.device_mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
        )
        # Offloaded after construction: DTensor.from_local moves a local tensor to the mesh's
        # device type; DTensor.cpu() keeps the mesh and moves the local piece to host memory,
        # as torch FSDP1's offload_to_cpu does.
        return value.cpu() if offload else value

    def _replicated(self, full: torch.Tensor, offload: bool) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        mesh = self.device_mesh if self.device_mesh is not None else _mesh_for(self.group, self.compute_device)
        value = DTensor.from_local(full.clone(), mesh, [Replicate()] * mesh.ndim, run_check=False)
        return value.cpu() if offload else value

    def _group_device_type(self) -> str:
        """The device type torch FSDP1 names in placements: the group's registered device
        (``cpu`` for gloo, ``cuda`` for NCCL; ``cpu`` where several are registered)."""
        types = [torch.device(d).type for d in getattr(self.group, "_device_types", [])]
        if len(types) == 1:
            return types[0]
        return "cpu" if "cpu" in types or not types else types[0]

    def _device_placements(self, offload: bool) -> list[Any]:
        """Every group rank's ``_remote_device`` in the global metadata, torch FSDP1's strings:
        ``rank:<global>/cpu``, or ``rank:<global>/cuda:<global % devices per node>`` on a
        CUDA group; all ``cpu`` when offloaded (torch's ``ShardedTensor.cpu()``)."""
        device_type = "cpu" if offload else self._group_device_type()
        placements = self._placements.get(device_type)
        if placements is None:
            if device_type == "cpu":
                names = [f"rank:{g}/cpu" for g in self.global_ranks()]
            else:
                count = max(1, torch.get_device_module(device_type).device_count())
                names = [f"rank:{g}/{device_type}:{g % count}" for g in self.global_ranks()]
            placements = [_remote_device(name) for name in names]
            self._placements[device_type] = placements
        return placements

    def _sharded_tensor(self, full: torch.Tensor, local: torch.Tensor, offload: bool) -> Any:
        device = torch.device("cpu") if offload else local.device
        local = local.to(device, copy=True).contiguous()
        placements = self._device_placements(offload)
        rest = list(full.shape[1:])
        zeros = [0] * len(rest)
        shards_metadata = [
            ShardMetadata([c.first_row, *zeros], [c.num_rows, *rest], placements[r])
            for r, c in enumerate(torch_chunks(full.shape[0], self.world_size))
        ]
        local_shards = []
        if self.rank < len(shards_metadata):
            own = ShardMetadata(
                list(shards_metadata[self.rank].shard_offsets), list(local.shape), f"rank:{self.rank}/{device}"
            )
            local_shards.append(Shard(local, own))
        properties = TensorProperties(dtype=full.dtype, layout=full.layout, requires_grad=False, pin_memory=False)
        metadata = ShardedTensorMetadata(shards_metadata, full.shape, properties)
        key = (tuple(full.shape), device.type)
        spec = self._specs.get(key)
        if spec is None:  # what torch infers from the metadata, the same for every value of this shape
            spec = _infer_sharding_spec_from_shards_metadata(shards_metadata)
            self._specs[key] = spec
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards, metadata, process_group=self.group, sharding_spec=spec
        )


def _expected_local_shape(shape: torch.Size, state: UnitState) -> tuple[int, ...]:
    if len(shape) == 0:
        return ()
    _, rows = chunk_rows(shape[0], state.world_size, state.rank)
    return (rows, *shape[1:])


def _remedy() -> str:
    return (
        "A SHARDED_STATE_DICT written with torch.save loads only at the world size (and wrapping) "
        "that saved it; save and load it with torch.distributed.checkpoint instead (dcp.save("
        "model.state_dict(), ...) / dcp.load(template, ...) into this model's own "
        "SHARDED_STATE_DICT, then load_state_dict(template)), which reshards across world sizes, "
        "or use a FULL_STATE_DICT."
    )


def check_sharded_value(key: str, value: Any, shape: torch.Size, state: UnitState) -> Optional[str]:
    """Why ``value`` cannot be loaded as managed parameter ``key`` of ``state``'s unit (None: it can).

    Local check only (no communication); called on every entry before anything changes.
    """
    ranks = _group_ranks(state.process_group)
    current = (
        f"this model shards it over {state.world_size} rank(s) {ranks}, local shard shape "
        f"{_expected_local_shape(shape, state)} on group rank {state.rank}"
    )
    if is_dtensor(value):
        from torch.distributed.tensor import Replicate, Shard

        try:
            mesh_ranks = [int(r) for r in value.device_mesh.mesh.flatten().tolist()]
            placements = tuple(value.placements)
            local_shape = tuple(value._local_tensor.shape)
        except Exception as exc:  # a mesh that does not exist in this job
            return f"fsdp: cannot load '{key}': its DTensor's mesh is unusable here ({exc}); {current}. {_remedy()}"
        if mesh_ranks == ranks and value.device_mesh.ndim == 1:
            if placements == (Replicate(),) and local_shape == tuple(shape):
                return None
            if placements == (Shard(0),) and local_shape == _expected_local_shape(shape, state):
                return None
        if _is_hybrid_row_chunk(value, state) and local_shape == _expected_local_shape(shape, state):
            return None
        return (
            f"fsdp: cannot load '{key}' (shape {tuple(shape)}): it was saved as a DTensor over "
            f"{len(mesh_ranks)} rank(s) {mesh_ranks} with placements {list(placements)} and local "
            f"shard shape {local_shape} on this rank, but {current}. {_remedy()}"
        )
    if is_sharded_tensor(value):
        saved = sorted(
            (tuple(m.shard_offsets), tuple(m.shard_sizes)) for m in value.metadata().shards_metadata
        )
        expected = []
        for rank in range(state.world_size):
            first, rows = chunk_rows(shape[0], state.world_size, rank) if len(shape) else (0, 0)
            if rows:
                expected.append(((first, *[0] * (len(shape) - 1)), (rows, *shape[1:])))
        if len(shape) and saved == sorted(expected) and len(value.local_shards()) <= 1:
            return None
        sizes = [list(s) for _, s in saved]
        return (
            f"fsdp: cannot load '{key}' (shape {tuple(shape)}): it was saved as a ShardedTensor of "
            f"{len(saved)} shard(s) of sizes {sizes}, but {current} (chunks of "
            f"{[list(s) for _, s in expected]}). {_remedy()}"
        )
    return None


def full_value(value: Any, shape: torch.Size, state: UnitState) -> torch.Tensor:
    """The full tensor of a checked value; a collective over the unit's group for sharded ones.

    Every rank of the group must call it for the same entries in the same order.
    """
    if is_dtensor(value):
        if not _is_group_row_chunk(value, state):
            return value.full_tensor()
        # [Note: Gathering our own DTensors] A Shard(0) DTensor over the unit's own group (what
        # fsdp writes and DCP templates from fsdp hold) is gathered through fsdp's collectives,
        # not DTensor.full_tensor(): its functional collectives crash the process on gloo with
        # CUDA tensors (seen in the CUDA lane, torch 2.11), where fsdp's all-gather works.
        return gather_chunked_rows(
            value.to_local(), shape, value.dtype, state.compute_device, state.process_group, state.world_size
        )
    if not is_sharded_tensor(value):
        return value
    shards = value.local_shards()
    return gather_chunked_rows(
        shards[0].tensor if shards else None,
        shape,
        value.metadata().tensor_properties.dtype,
        state.compute_device,
        state.process_group,
        state.world_size,
    )


def _is_group_row_chunk(value: Any, state: UnitState) -> bool:
    """Whether DTensor ``value`` is sharded by rows (``Shard(0)``, ``torch.chunk`` layout) over a
    1-D mesh of exactly the unit's process group."""
    from torch.distributed.tensor import Shard

    if _is_hybrid_row_chunk(value, state):
        return True
    mesh = value.device_mesh
    if mesh.ndim != 1 or tuple(value.placements) != (Shard(0),) or value.dim() == 0:
        return False
    try:
        return _group_ranks(mesh.get_group()) == _group_ranks(state.process_group)
    except (RuntimeError, ValueError):
        return False


def _is_hybrid_row_chunk(value: Any, state: UnitState) -> bool:
    """Whether DTensor ``value`` is what a hybrid-sharding unit built with a 2-D ``device_mesh``
    gives: on that mesh, ``(Replicate(), Shard(0))`` ([Note: Sharded value forms])."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = state.device_mesh
    return (
        mesh is not None
        and mesh.ndim == 2
        and value.dim() > 0
        and value.device_mesh == mesh
        and tuple(value.placements) == (Replicate(), Shard(0))
    )


def gather_chunked_rows(
    local_rows: Optional[torch.Tensor],
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    group: Optional[dist.ProcessGroup],
    world_size: int,
) -> torch.Tensor:
    """The full tensor of shape ``shape`` whose dim-0 ``torch.chunk`` pieces the ranks of
    ``group`` hold (``local_rows``: this rank's, None where it holds none); an all-gather.

    Each rank pads its piece to ``ceil(shape[0] / world_size)`` rows, so the gathered rows are in
    order and the padding is at the end.
    """
    rows_per_rank = math.ceil(shape[0] / world_size)
    row_numel = math.prod(shape[1:])
    padded_local = torch.zeros(rows_per_rank * row_numel, dtype=dtype, device=device)
    if local_rows is not None:
        local = local_rows.reshape(-1).to(device)
        padded_local[: local.numel()].copy_(local)
    everyone = padded_local.new_empty(world_size * padded_local.numel())
    comm.all_gather_flat(everyone, padded_local, group)
    return everyone[: math.prod(shape)].view(shape)


# ----------------------------------------------------------------------------- LOCAL values
# [Note: Local state dict format]
# Torch FSDP1 stores one entry per unit, ``<unit prefix>_flat_param``: a 1-D ShardedTensor of the
# unit's *unpadded* flat parameter (``unpadded_unsharded_numel`` elements), whose only local shard
# is a view of this rank's part of the local flat shard without its padding (offset
# ``rank * sharded_numel``; a rank that holds only padding has no local shard). With
# use_orig_params "unpadded" still counts the alignment padding between parameters and up to a
# multiple of the world size (see [Note: Aligned flat parameter layout] in
# ``flat_param/_sharding.py``), so every rank's part is a whole shard, padding values included.
# We give exactly that, with the same layout, so LOCAL checkpoints move between torch FSDP1 and
# fsdp (same wrapping and world size), with or without use_orig_params.
# The ShardedTensor is built from metadata we compute (every rank's offset and size follow from
# the layout), so saving needs no communication, and torch's deprecation warnings about
# ShardedTensor are hidden around our own construction: they concern our internals, not the
# user's code. Loading checks the ShardedTensor's metadata against this unit's layout (total
# size, every shard's offset and size) and refuses another world size or wrapping, naming the
# entry, before anything changes.


#: Torch FSDP1's error for LOCAL_STATE_DICT on a model built with a ``device_mesh``.
LOCAL_WITH_MESH = (
    "Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible with LOCAL_STATE_DICT. "
    "Please set state_dict_type to SHARDED_STATE_DICT to get DTensor state_dict."
)


def refuse_local_with_mesh(named_states: list[tuple[str, UnitState]], what: str) -> None:
    """Raises torch FSDP1's ``RuntimeError`` if a unit among ``named_states`` (its name, its
    state; those whose state-dict type is LOCAL_STATE_DICT) was built with a ``device_mesh``:
    its values are DTensors on the mesh, which LOCAL's flat-shard ShardedTensors cannot be.
    Called before anything is gathered or changed."""
    for name, state in named_states:
        if state.device_mesh is not None:
            raise RuntimeError(
                f"{LOCAL_WITH_MESH} fsdp: {what} under LOCAL_STATE_DICT, but unit "
                f"'{name or '<root>'}' was built with device_mesh={state.device_mesh}. Use "
                f"StateDictType.SHARDED_STATE_DICT (DTensors on the mesh, loadable at other world "
                f"sizes through torch.distributed.checkpoint), or build the model with "
                f"process_group=... instead of device_mesh to keep LOCAL_STATE_DICT."
            )


@contextlib.contextmanager
def _quiet_sharded_tensor() -> Iterator[None]:
    """Hides torch's ShardedTensor deprecation warnings raised by our own construction."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*")
        yield


def _local_layout(handle: FlatParamHandle) -> list[tuple[int, int]]:
    """``(offset, numel)`` of every rank's unpadded part, in rank order (0-numel parts included)."""
    unpadded_numel = handle.shard_layout.unpadded_unsharded_numel
    sharded_numel = handle.shard_layout.sharded_numel
    parts = []
    for rank in range(handle.world_size):
        offset = rank * sharded_numel
        parts.append((offset, max(0, min(sharded_numel, unpadded_numel - offset))))
    return parts


def local_value(handle: FlatParamHandle, offload: bool) -> Any:
    """The unit's LOCAL_STATE_DICT value (see [Note: Local state dict format]); no copy."""
    local_shard = handle._local_shard.detach()
    parts = _local_layout(handle)
    device = local_shard.device
    shards_metadata = [
        ShardMetadata([offset], [numel], f"rank:{rank}/{device}")
        for rank, (offset, numel) in enumerate(parts)
        if numel > 0
    ]
    offset, numel = parts[handle.rank]
    local_shards = []
    if numel > 0:
        local_shards.append(Shard(local_shard[:numel].view(numel), shards_metadata[handle.rank]))
    properties = TensorProperties.create_from_tensor(local_shard[:0])
    metadata = ShardedTensorMetadata(
        shards_metadata, torch.Size([handle.shard_layout.unpadded_unsharded_numel]), properties
    )
    with _quiet_sharded_tensor():
        value = ShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards, metadata, process_group=handle.process_group
        )
        if offload and device.type != "cpu":
            value = value.cpu()
    return value


def check_local_value(key: str, unit_name: str, value: Any, handle: FlatParamHandle) -> Optional[str]:
    """Why ``value`` cannot be loaded as the local flat shard ``key`` (None: it can); no communication."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    layout = handle.shard_layout
    current = (
        f"this model (its unit '{unit_name}' holds {layout.unpadded_unsharded_numel} elements in "
        f"shards of {layout.sharded_numel} over {handle.world_size} rank(s))"
    )
    remedy = (
        "A local state dict only loads at the same world size and wrapping; use "
        "StateDictType.SHARDED_STATE_DICT to change world size or wrapping."
    )
    if not isinstance(value, ShardedTensor):
        return (
            f"fsdp: the LOCAL_STATE_DICT entry '{key}' must be a ShardedTensor (as state_dict() "
            f"gives under LOCAL_STATE_DICT, here and in torch FSDP1), got {type(value).__name__}."
        )
    metadata = value.metadata()
    saved = sorted((int(m.shard_offsets[0]), int(m.shard_sizes[0])) for m in metadata.shards_metadata)
    expected = [
        part
        for part in _local_layout(handle)
        if part[1] > 0
    ]
    if tuple(metadata.size) != (layout.unpadded_unsharded_numel,) or saved != expected:
        return (
            f"fsdp: the LOCAL_STATE_DICT entry '{key}' was saved with a different layout "
            f"({int(metadata.size.numel())} elements in {len(saved)} shard(s) of sizes "
            f"{[n for _, n in saved]} at offsets {[o for o, _ in saved]}) than {current}, whose "
            f"shards have sizes {[n for _, n in expected]} at offsets {[o for o, _ in expected]}. "
            f"{remedy}"
        )
    offset, numel = _local_layout(handle)[handle.rank]
    shards = value.local_shards()
    local_ok = (not shards and numel == 0) or (
        len(shards) == 1
        and int(shards[0].metadata.shard_offsets[0]) == offset
        and shards[0].tensor.numel() == numel
    )
    if not local_ok:
        held = [(int(s.metadata.shard_offsets[0]), s.tensor.numel()) for s in shards]
        return (
            f"fsdp: the LOCAL_STATE_DICT entry '{key}' holds the part(s) {held} (offset, numel) "
            f"on this rank, but this rank (group rank {handle.rank}) holds ({offset}, {numel}) of "
            f"{current}. Load each rank's own local state dict. {remedy}"
        )
    return None


def load_local_value(handle: FlatParamHandle, value: Any) -> None:
    """Copies a checked local value into the handle's local shard (its padding stays as is)."""
    shards = value.local_shards()
    if shards:
        local = shards[0].tensor.reshape(-1)
        handle._local_shard[: local.numel()].copy_(local)


# ----------------------------------------------------------------------------- optimizer values
# [Note: No ShardedTensor]
# Sharded optimizer state dicts hold the values of [Note: Sharded value forms], as our sharded
# model state dicts do: torch FSDP1's types (ShardedTensors unless built with a device_mesh).
# Torch deprecates ShardedTensor and warns (FutureWarning) at every tensor method called on one,
# so fsdp never calls one: ShardedTensors (ours or torch FSDP1's) are read through their
# metadata and local shards only, which do not warn. The warnings a user sees are torch's own
# (its checkpoint planner's, say), the same ones torch FSDP1's values give.


class ValueKind(enum.Enum):
    """What an optimizer state value is. :meth:`of` asks once; the kind then answers what each
    path needs (whether it has dimensions, whether it is sharded, its global shape and dtype,
    its full tensor), so a ShardedTensor is only ever read through its metadata and local shards
    (see [Note: No ShardedTensor]).
    """

    #: A plain tensor with dimensions (Adam's ``exp_avg``): gathered and split per parameter
    #: when saving, flattened or sliced to this rank's shard when loading.
    TENSOR = "tensor"
    #: A plain zero-dimension tensor (``step``): copied.
    SCALAR = "scalar"
    #: A DTensor, of any dimension (sharded optimizer state dicts hold them for the states with
    #: dimensions): gathered back to a full tensor when loading.
    DTENSOR = "dtensor"
    #: A ShardedTensor (torch FSDP1's sharded values without a mesh): gathered back likewise.
    SHARDED_TENSOR = "sharded_tensor"
    #: Anything else (a number, a string, None): kept as it is.
    OTHER = "other"

    @staticmethod
    def of(value: Any) -> "ValueKind":
        """The kind of ``value``; never calls a tensor method on a ShardedTensor."""
        if is_sharded_tensor(value):
            return ValueKind.SHARDED_TENSOR
        if is_dtensor(value):
            return ValueKind.DTENSOR
        if isinstance(value, torch.Tensor):
            return ValueKind.TENSOR if value.dim() > 0 else ValueKind.SCALAR
        return ValueKind.OTHER

    @property
    def has_dims(self) -> bool:
        """A tensor with dimensions that is read as a tensor (a DTensor too: its global view)."""
        return self in (ValueKind.TENSOR, ValueKind.DTENSOR)

    @property
    def sharded(self) -> bool:
        """A DTensor or a ShardedTensor: its full value is a collective (:meth:`full_tensor`)."""
        return self in (ValueKind.DTENSOR, ValueKind.SHARDED_TENSOR)

    def global_shape(self, value: Any) -> torch.Size:
        """The shape of ``value``'s full tensor (a tensor kind's)."""
        if self is ValueKind.SHARDED_TENSOR:
            return torch.Size(value.metadata().size)
        return value.shape

    def dtype(self, value: Any) -> torch.dtype:
        """The dtype of ``value`` (a tensor kind's)."""
        if self is ValueKind.SHARDED_TENSOR:
            return value.metadata().tensor_properties.dtype
        return value.dtype

    def full_tensor(self, value: Any, where: str, device: torch.device) -> torch.Tensor:
        """The full tensor of a sharded ``value``: a DTensor, or a dim-0 chunk-sharded
        ShardedTensor; a collective over its group (on the compute ``device`` for NCCL).
        ``where`` names it in errors."""
        if self is ValueKind.DTENSOR:
            return value.full_tensor()
        p_assert(self is ValueKind.SHARDED_TENSOR, f"{where}: not a sharded value")
        return _gather_sharded_tensor(value, where, device)


def _gather_sharded_tensor(value: Any, where: str, compute_device: torch.device) -> torch.Tensor:
    """The full tensor of a ShardedTensor chunked along dim 0 over its group (an all-gather),
    read through its metadata and local shards only; another layout raises ``ValueError``."""
    group = value._process_group
    ws = dist.get_world_size(group)
    metadata = value.metadata()
    size = torch.Size(metadata.size)
    metas = sorted(metadata.shards_metadata, key=lambda m: m.shard_offsets[0])
    expected = [len(c) for c in torch.chunk(torch.empty(size[0]), ws)] if size[0] else []
    if [m.shard_sizes[0] for m in metas] != expected or any(
        any(o != 0 for o in m.shard_offsets[1:]) for m in metas
    ):
        raise ValueError(
            f"fsdp: {where} is a ShardedTensor that is not chunked along dim 0 over its group "
            f"(shards {[(m.shard_offsets, m.shard_sizes) for m in metas]}); only the layout "
            f"FSDP's optim_state_dict produces can be loaded."
        )
    shards = value.local_shards()
    dtype = metadata.tensor_properties.dtype
    device = shards[0].tensor.device if shards else torch.device("cpu")
    if group is not None and dist.get_backend(group) == "nccl":
        device = compute_device
    return gather_chunked_rows(shards[0].tensor if shards else None, size, dtype, device, group, ws)
