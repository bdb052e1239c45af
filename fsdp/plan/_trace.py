"""One forward and backward of the user's model on fake tensors, as a stream of memory events.

[Note: Activation trace]
The model runs once, forward then backward, under ``FakeTensorMode`` (tensors have shapes,
dtypes and a device, no data) with a ``TorchDispatchMode`` on top that sees every operator's
outputs. Each new storage an operator returns is an ``alloc`` event; a weak-reference finalizer
on the storage object emits its ``free`` when the last tensor using it dies (autograd keeping a
saved tensor keeps it alive, exactly as in a real run). Parameters are fake copies in the
compute dtype (``param_dtype`` under mixed precision), swapped in (as ``torch.func.functional_call`` does) for the whole trace, so
the user's module (meta or real) is neither copied nor changed.

Fake tensors on the CPU device, not meta tensors: operators such as
``scaled_dot_product_attention`` choose their kernel by device, and on ``meta`` the choice is
the math fallback that materializes the whole attention matrix, which no real run does.

Markers interleave with the allocations: ``fwd_pre``/``fwd_post`` from module hooks on every
unit's module, ``bwd_pre`` from a hook on the unit's outputs (where FSDP's pre-backward hook
sits), ``grad`` when autograd finishes one parameter's gradient (where FSDP's hooks on the
parameter views run) and ``bwd_post`` where FSDP's post-backward hook runs (see below).
:mod:`fsdp.plan._schedule` replays FSDP's unshard, reshard, prefetch and reduction on this
stream.

[Note: Post-backward follows the views node]
FSDP's post-backward hook for a handle runs when autograd runs the node that turns the
parameters' gradients back into the FlatParameter's: the backward of the views the pre-forward
hook made (``FlatParamHandle``'s split and views). That node is ready once the handle's last
parameter gradient is in, but autograd runs the ready node with the highest sequence number
first, and the views node is numbered at the unit's pre-forward, before every operator of the
unit's forward. For a unit that contains no other unit nothing lies between, and the hook runs
right after the last gradient. A unit whose forward runs other units (the root, always) made its
views before all of their operators: its post-backward waits until autograd has run every node
numbered after it, that is, until backward reaches what was computed before the unit's forward
(for the root: the end of backward), however early its gradients were complete (a root whose
embeddings are frozen has all its gradients after the head's backward, and stays gathered with
them through the whole backward). The trace reproduces this: each unit's pre-forward records
the next sequence number (a view of one of its parameters, which allocates nothing), a handle
whose last gradient is in becomes pending, and a pending handle's ``bwd_post`` is emitted just
before the first backward operator or pre-backward marker of a node numbered below its unit's,
or at the end of backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
# Any below: ``loss_fn``'s argument is the model's output, which torch types Any (nn.Module.__call__).
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.hooks import RemovableHandle

from fsdp._common import p_assert
from fsdp.plan._units import UnitSpec

__all__ = ["Trace", "trace_forward_backward"]

# A memory event: its kind, then ints whose number depends on the kind (the schedule unpacks
# each kind its own way), hence Any.
Event = tuple[Any, ...]


@dataclass
class Trace:
    """The event stream of one forward and backward.

    Attributes:
        events: ``("alloc", key, nbytes)``, ``("free", key)``, ``("fwd_pre", unit)``,
            ``("fwd_post", unit)``, ``("bwd_pre", unit)``, ``("grad", unit, handle, key,
            nbytes)``, ``("bwd_post", unit, handle)``, ``("phase", name)``.
        input_bytes: Bytes of the example inputs (alive throughout).
        op_count: Operators seen (for the docs' timing notes).
    """

    events: list[Event] = field(default_factory=list)
    input_bytes: int = 0
    op_count: int = 0


class _StorageTracker(TorchDispatchMode):
    """Emits ``alloc``/``free`` events for every storage an operator creates."""

    def __init__(self, trace: Trace, external: set[int]) -> None:
        super().__init__()
        self.trace = trace
        self.external = external
        self.live: dict[int, int] = {}  # storage address -> serial number
        self.serial = 0
        self.before_op: Optional[Callable[[], None]] = None

    def __torch_dispatch__(
        self,
        func: Callable[..., object],
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Optional[dict[str, object]] = None,
    ) -> object:
        if self.before_op is not None:
            self.before_op()
        out = func(*args, **(kwargs or {}))
        self.trace.op_count += 1
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        cdata = storage._cdata
        if cdata in self.live or cdata in self.external:
            return
        # Events name a storage by a serial number: a freed storage's address is reused.
        self.serial += 1
        self.live[cdata] = self.serial
        self.trace.events.append(("alloc", self.serial, storage.nbytes()))
        weakref.finalize(storage, self._free, cdata, self.serial)

    def key_of(self, t: torch.Tensor) -> int:
        """The serial number of ``t``'s storage (0 when it was not made inside the trace)."""
        return self.live.get(t.untyped_storage()._cdata, 0)

    def _free(self, cdata: int, serial: int) -> None:
        if self.live.get(cdata) == serial:
            del self.live[cdata]
            self.trace.events.append(("free", serial))


def _default_loss(output: object) -> torch.Tensor:
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise ValueError(
            "fsdp.estimate_memory: the model's output has no tensor that requires grad, so there "
            "is no backward to plan; pass loss_fn=... that turns the output into a scalar loss."
        )
    loss = leaves[0].sum()
    for t in leaves[1:]:
        loss = loss + t.sum()
    return loss


@dataclass
class _TraceRun:
    """What the trace's hooks share while one forward and backward runs.

    Attributes:
        trace: The events being recorded.
        units: The planned units (forward order, root last).
        tracker: The dispatch mode that names storages (set just before the forward).
        in_backward: Set when backward starts: a forward then is a recomputation.
        ran_pre_backward: Units whose pre-backward marker was emitted.
        remaining_grads: Per ``(unit, handle)``, the trainable parameters whose gradient is
            still to come in this backward.
        views_seq: Per unit, the autograd sequence number its views would get, from its first
            forward ([Note: Post-backward follows the views node]).
        pending_post: Handles whose gradients are all in and whose ``bwd_post`` waits for
            backward to reach their unit's views node.
        handles: Every hook registered (removed at the end).
    """

    trace: Trace
    units: list[UnitSpec]
    tracker: Optional[_StorageTracker] = None
    in_backward: bool = False
    ran_pre_backward: set[int] = field(default_factory=set)
    remaining_grads: dict[tuple[int, int], int] = field(default_factory=dict)
    views_seq: dict[int, int] = field(default_factory=dict)
    pending_post: list[tuple[int, int]] = field(default_factory=list)
    handles: list[RemovableHandle] = field(default_factory=list)

    def emit_post_backward(self, below_seq: Optional[int]) -> None:
        """Emits ``bwd_post`` for each pending handle whose views node runs before a node
        numbered ``below_seq`` (all of them when None), highest sequence number first."""
        due = [
            hid for hid in self.pending_post if below_seq is None or self.views_seq[hid[0]] > below_seq
        ]
        for hid in sorted(due, key=lambda hid: -self.views_seq[hid[0]]):
            self.pending_post.remove(hid)
            self.trace.events.append(("bwd_post", hid[0], hid[1]))

    def before_backward_work(self) -> None:
        """Called before each backward operator and pre-backward marker: a pending views node
        numbered above the node now running has run first."""
        if not self.pending_post:
            return
        node = torch._C._current_autograd_node()
        if node is not None:
            self.emit_post_backward(node._sequence_nr())


def trace_forward_backward(
    model: nn.Module,
    example_inputs: object,
    units: list[UnitSpec],
    ignored_params: set[nn.Parameter],
    loss_fn: Optional[Callable[[Any], torch.Tensor]],
    buffer_dtype: Optional[torch.dtype],
) -> Trace:
    """Traces one forward and backward (see [Note: Activation trace]).

    Args:
        model: The user's model (any device, meta included); left unchanged.
        example_inputs: One micro-batch: a tensor or a tuple of tensors (meta allowed).
        units: The planned units (forward order, root last).
        ignored_params: Parameters no unit manages (they keep ordinary ``.grad``).
        loss_fn: Turns the model's output into a scalar; default: the sum of the outputs.
        buffer_dtype: Mixed precision's ``buffer_dtype``, if any.

    Returns:
        The event stream.
    """
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
    )

    run = _TraceRun(Trace(), units)
    try:
        with FakeTensorMode(allow_non_fake_inputs=False):
            replacements = _fake_parameters(model, run)
            replacements.update(_fake_buffers(model, buffer_dtype))
            fake_inputs = tree_map(
                lambda t: torch.empty(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t,
                example_inputs,
            )
            run.trace.input_bytes = sum(
                t.untyped_storage().nbytes() for t in tree_flatten(fake_inputs)[0] if isinstance(t, torch.Tensor)
            )
            external = {
                t.untyped_storage()._cdata
                for t in list(replacements.values()) + tree_flatten(fake_inputs)[0]
                if isinstance(t, torch.Tensor)
            }
            _register_unit_hooks(run)
            args = fake_inputs if isinstance(fake_inputs, tuple) else (fake_inputs,)
            run.tracker = _StorageTracker(run.trace, external)
            _run_forward_backward(model, replacements, args, loss_fn, run)
            del replacements, fake_inputs, args
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        raise ValueError(
            f"fsdp.estimate_memory: the model's forward or loss needs tensor values ({exc}: "
            f".item(), bool(tensor), Python control flow on a tensor, or an output whose shape "
            f"depends on values, such as nonzero() or boolean-mask indexing). Planning runs on "
            f"fake tensors, which have shapes and no values; make that part depend on shapes only "
            f"while planning."
        ) from exc
    finally:
        for hook in run.handles:
            hook.remove()
    return run.trace


def _fake_parameters(model: nn.Module, run: _TraceRun) -> dict[str, torch.Tensor]:
    """Fake copies of the model's parameters in their compute dtype, by every name they have.

    A unit's trainable parameters get a gradient hook (``grad`` and ``bwd_post`` events).
    Precondition: called inside ``FakeTensorMode``.
    """
    owner: dict[int, tuple[int, int]] = {}
    for u, unit in enumerate(run.units):
        for h, handle in enumerate(unit.handles):
            for p in handle.params:
                owner[id(p)] = (u, h)
    replacements: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in replacements:
            continue
        u_h = owner.get(id(p))
        dtype = p.dtype
        if u_h is not None:
            dtype = run.units[u_h[0]].handles[u_h[1]].precision.param_dtype
        fake = nn.Parameter(torch.empty(p.shape, dtype=dtype), requires_grad=p.requires_grad)
        replacements[name] = fake
        if u_h is not None and p.requires_grad:
            run.remaining_grads[u_h] = run.remaining_grads.get(u_h, 0) + 1
            run.handles.append(fake.register_post_accumulate_grad_hook(_grad_hook(run, u_h)))
    return replacements


def _fake_buffers(model: nn.Module, buffer_dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
    """Fake copies of the model's buffers (floating ones in ``buffer_dtype`` when given).

    Precondition: called inside ``FakeTensorMode``.
    """
    fakes: dict[str, torch.Tensor] = {}
    for name, b in model.named_buffers(remove_duplicate=False):
        dtype = buffer_dtype if (buffer_dtype is not None and b.is_floating_point()) else b.dtype
        fakes[name] = torch.empty(b.shape, dtype=dtype)
    return fakes


def _register_unit_hooks(run: _TraceRun) -> None:
    """The forward markers on every unit's module, and from them the pre-backward markers."""
    for u, unit in enumerate(run.units):
        run.handles.append(unit.module.register_forward_pre_hook(_fwd_pre_hook(run, u)))
        run.handles.append(unit.module.register_forward_hook(_fwd_post_hook(run, u)))


def _run_forward_backward(
    model: nn.Module,
    replacements: dict[str, torch.Tensor],
    args: tuple[object, ...],
    loss_fn: Optional[Callable[[Any], torch.Tensor]],
    run: _TraceRun,
) -> None:
    """The forward, the loss and the backward, with the fake parameters and the tracker on."""
    # The fake parameters stay in place through backward: activation checkpointing re-runs
    # forwards there.
    p_assert(run.tracker is not None, "fsdp.plan: the storage tracker is set before the forward")
    assert run.tracker is not None  # for the type checker: p_assert raised otherwise
    tracker = run.tracker
    trace = run.trace
    with _reparametrize_module(model, replacements, tie_weights=True), tracker:
        trace.events.append(("phase", "forward"))
        output = model(*args)
        loss = (loss_fn or _default_loss)(output)
        del output
        trace.events.append(("phase", "backward"))
        run.in_backward = True
        tracker.before_op = run.before_backward_work
        loss.backward()
        tracker.before_op = None
        run.emit_post_backward(None)  # the views nodes numbered first run last
        del loss
        trace.events.append(("phase", "end"))


def _grad_hook(run: _TraceRun, u_h: tuple[int, int]) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is not None:
            p_assert(run.tracker is not None, "fsdp.plan: a gradient outside the traced backward")
            assert run.tracker is not None  # for the type checker: p_assert raised otherwise
            run.trace.events.append(
                ("grad", u_h[0], u_h[1], run.tracker.key_of(grad), grad.untyped_storage().nbytes())
            )
        param.grad = None  # FSDP hands it to the reduction; the replay decides how long it lives
        run.remaining_grads[u_h] -= 1
        if run.remaining_grads[u_h] == 0:
            if u_h[0] in run.views_seq:  # [Note: Post-backward follows the views node]
                run.pending_post.append(u_h)
            else:  # the unit never ran forward with grad enabled: nothing to wait for
                run.trace.events.append(("bwd_post", u_h[0], u_h[1]))

    return hook


def _fwd_pre_hook(run: _TraceRun, u: int) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[object, ...]) -> None:
        run.trace.events.append(("fwd_pre", u))
        if u not in run.views_seq and not run.in_backward and torch.is_grad_enabled():
            run.views_seq[u] = _next_sequence_nr(module)

    return hook


def _next_sequence_nr(module: nn.Module) -> int:
    """The sequence number autograd gives the next node made now (probed with a view of a
    trainable parameter of ``module``, which allocates nothing); -1 when it has none (then its
    handles have no gradients to wait for)."""
    for p in module.parameters():
        if p.requires_grad:
            probe = p.view(p.shape)
            p_assert(probe.grad_fn is not None, "fsdp.plan: a view of a trainable parameter has a grad_fn")
            assert probe.grad_fn is not None  # for the type checker: p_assert raised otherwise
            return int(probe.grad_fn._sequence_nr())
    return -1


def _fwd_post_hook(run: _TraceRun, u: int) -> Callable[..., None]:
    def on_grad(grad: torch.Tensor) -> None:
        if u not in run.ran_pre_backward:
            run.before_backward_work()
            run.ran_pre_backward.add(u)
            run.trace.events.append(("bwd_pre", u))

    def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
        run.trace.events.append(("fwd_post", u))
        if run.in_backward or not torch.is_grad_enabled():
            return  # a recomputation (activation checkpointing): FSDP registers nothing then
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(on_grad)

    return hook
