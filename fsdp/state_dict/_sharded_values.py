"""SHARDED_STATE_DICT values: the DTensors we give, and the DTensors and ShardedTensors we take.

See [Note: Sharded state dict values] in docs/design.md. A managed parameter's value is chunked
along dim 0 over the unit's shard group like ``torch.chunk`` (rank ``r`` holds rows
``[r * ceil(d0 / ws), ...)``, possibly none), which is the layout torch FSDP1 uses for both its
ShardedTensor and its DTensor values. Loading accepts a full tensor, a DTensor over a 1-D mesh of
exactly this group, or a ShardedTensor with exactly this chunk layout; anything else (typically
a state dict written with ``torch.save`` at another world size) is refused with the saved and the
current layout before anything changes.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from fsdp._comm import _collectives as comm
from fsdp.runtime._state import UnitState

__all__ = [
    "local_form",
    "parent_mesh",
    "to_dtensor",
    "check_sharded_value",
    "full_value",
    "is_dtensor",
    "is_sharded_tensor",
    "shard_rows",
    "gather_chunked_rows",
]

_MESHES: dict[tuple[int, str], Any] = {}


def _mesh_for(group: dist.ProcessGroup, device: torch.device) -> Any:
    """The 1-D DeviceMesh of ``group`` for ``device``'s type (one per group and type)."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (id(group), device.type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device.type)
    return _MESHES[key]


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


def _chunk_rows(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(first row, number of rows)`` of ``rank``'s ``torch.chunk`` piece of ``dim0`` rows."""
    rows_per_rank = math.ceil(dim0 / world_size) if dim0 else 0
    first = min(rank * rows_per_rank, dim0)
    return first, max(0, min(rows_per_rank, dim0 - first))


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
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp_placement = value.placements[-1] if isinstance(value, DTensor) else Replicate()
    local = value.to_local() if isinstance(value, DTensor) else value
    replicated = [Replicate()] * root.ndim
    replicated[-1] = tp_placement
    sharded = [Replicate()] * root.ndim
    sharded[-2], sharded[-1] = Shard(0), tp_placement
    result = DTensor.from_local(local, root, replicated, run_check=False).redistribute(root, sharded)
    result = DTensor.from_local(
        result.to_local().clone(), root, sharded, run_check=False, shape=result.shape, stride=result.stride()
    )
    return result.cpu() if offload else result


def local_form(value: Any, state: UnitState) -> Any:
    """A value of a managed parameter as the unit holds it: a 2-D DTensor on the parent mesh
    ([Note: 2-D sharded values]) gathered over dp, a tp DTensor (FULL) its local tensor; any
    other value itself. Collective for a 2-D DTensor (every dp rank calls it in the same order)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(value, DTensor):
        return value
    root = parent_mesh(state)
    if root is not None and value.device_mesh == root:
        placements = [Replicate()] * root.ndim
        placements[-1] = value.placements[-1]
        return value.redistribute(root, placements).to_local()
    if root is not None and value.device_mesh.ndim == 1 and value.device_mesh != state.device_mesh:
        return value.to_local()  # a FULL value of a tensor-parallel parameter
    return value


def to_dtensor(full_value: torch.Tensor, state: UnitState, offload: bool) -> Any:
    """This rank's ``torch.chunk`` piece of ``full_value`` as a ``Shard(0)`` DTensor (owned); on
    a 2-D parent mesh the 2-D DTensor torch FSDP1 gives ([Note: 2-D sharded values])."""
    from torch.distributed.tensor import DTensor, Replicate

    root = parent_mesh(state)
    if root is not None and full_value.dim() > 0:
        return _to_2d_dtensor(full_value, root, offload)
    if full_value.dim() == 0:
        mesh = _mesh_for(state.process_group, state.compute_device)
        value = DTensor.from_local(full_value.clone(), mesh, [Replicate()], run_check=False)
        return value.cpu() if offload else value
    return shard_rows(
        full_value, state.process_group, state.rank, state.world_size, state.compute_device, offload
    )


def shard_rows(
    full_value: torch.Tensor,
    group: dist.ProcessGroup,
    rank: int,
    world_size: int,
    mesh_device: torch.device,
    offload: bool = False,
) -> Any:
    """Rank ``rank``'s ``torch.chunk`` piece of ``full_value`` (dim > 0) along dim 0, owned, as a
    ``Shard(0)`` DTensor on the 1-D mesh of ``group`` for ``mesh_device``'s type (an empty piece on
    ranks past the last chunk). ``offload``: the piece is moved to CPU (the mesh stays)."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = _mesh_for(group, mesh_device)
    first, rows = _chunk_rows(full_value.shape[0], world_size, rank)
    local = full_value.narrow(0, first, rows).clone()
    value = DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=full_value.shape, stride=full_value.stride()
    )
    # Offloaded after construction: DTensor.from_local moves a local tensor to the mesh's device
    # type (a CPU piece on a CUDA mesh would come back to the GPU); DTensor.cpu() keeps the mesh
    # and puts the local piece in host memory, as torch FSDP1's offload_to_cpu does.
    return value.cpu() if offload else value


def _expected_local_shape(shape: torch.Size, state: UnitState) -> tuple[int, ...]:
    if len(shape) == 0:
        return ()
    _, rows = _chunk_rows(shape[0], state.world_size, state.rank)
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
            first, rows = _chunk_rows(shape[0], state.world_size, rank) if len(shape) else (0, 0)
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

    mesh = value.device_mesh
    if mesh.ndim != 1 or tuple(value.placements) != (Shard(0),) or value.dim() == 0:
        return False
    try:
        return _group_ranks(mesh.get_group()) == _group_ranks(state.process_group)
    except (RuntimeError, ValueError):
        return False


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
