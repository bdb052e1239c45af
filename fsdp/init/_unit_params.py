"""Which parameters a unit manages, and checks on them before anything is changed."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional

from torch import nn

from fsdp._common import clean_fqn
from fsdp.runtime._state import is_fsdp

UnitParam = tuple[str, nn.Module, str, nn.Parameter]


def collect_unit_params(
    module: nn.Module, is_other_unit: Callable[[nn.Module], bool]
) -> list[UnitParam]:
    """Lists ``(module_name, module, param_name, param)`` for every parameter name of the unit.

    Pre-order over ``module``'s subtree (the order of ``named_parameters``), skipping the
    subtrees of other units (nested FSDP instances, or modules a policy will wrap). A parameter
    reachable under two names appears twice; FlatParamHandle stores it once.
    """
    # An explicit stack, not a recursive closure: a closure that calls itself is a reference
    # cycle, and it would keep the (soon replaced) original parameters alive until Python's
    # cyclic garbage collector happens to run.
    result: list[UnitParam] = []
    seen_modules: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, mod = stack.pop()
        if id(mod) in seen_modules:
            continue
        seen_modules.add(id(mod))
        for name, param in mod._parameters.items():
            if param is not None:
                result.append((prefix, mod, name, param))
        children = [
            (f"{prefix}.{child_name}" if prefix else child_name, child)
            for child_name, child in mod._modules.items()
            if child is not None and not is_other_unit(child)
        ]
        stack.extend(reversed(children))  # pre-order: the first child is visited next
    return result


# Set on a Parameter used by several units, during the construction that planned it: the unit
# module that owns it (see [Note: Tied parameters across units] in _validate.py).
TIED_OWNER_ATTR = "_fsdp_tied_owner"


def tied_owner_of(param: nn.Parameter) -> Optional[nn.Module]:
    """The unit module that owns ``param`` if it is tied across units, else None."""
    return getattr(param, TIED_OWNER_ATTR, None)


def unit_params(
    unit_module: nn.Module,
    is_other_unit: Callable[[nn.Module], bool],
    ignored_params: set[nn.Parameter],
) -> list[UnitParam]:
    """The parameter names a unit manages: its own (not ignored, not owned by an ancestor for
    tying) plus the references inside nested units to tied parameters it owns.
    """
    own = [
        p
        for p in collect_unit_params(unit_module, is_other_unit)
        if p[3] not in ignored_params and tied_owner_of(p[3]) in (None, unit_module)
    ]
    seen = {(id(m), name) for _, m, name, _ in own}
    extra: list[UnitParam] = []
    for module_name, mod in unit_module.named_modules(remove_duplicate=False):
        for name, param in mod._parameters.items():
            if param is None or tied_owner_of(param) is not unit_module:
                continue
            if (id(mod), name) not in seen:
                seen.add((id(mod), name))
                extra.append((clean_fqn(module_name), mod, name, param))
    return own + extra


@contextlib.contextmanager
def mark_tied_owners(tied_owner: dict[int, tuple[nn.Parameter, nn.Module]]) -> Iterator[None]:
    """Marks each tied Parameter with its owning unit module for the duration of construction."""
    marked = [param for param, _ in tied_owner.values() if tied_owner_of(param) is None]
    for param, owner in tied_owner.values():
        if param in marked:
            setattr(param, TIED_OWNER_ATTR, owner)
    try:
        yield
    finally:
        for param in marked:
            if hasattr(param, TIED_OWNER_ATTR):
                delattr(param, TIED_OWNER_ATTR)


def unit_modules(unit_module: nn.Module, ignored_modules: set[nn.Module]) -> list[nn.Module]:
    """The modules whose own parameters and buffers belong to this unit (pre-order).

    Nested FSDP instances and ignored modules are not descended into; a unit whose wrapped
    module is itself ignored has none (torch FSDP1 leaves such a module's buffers alone: not
    moved, synced or cast for mixed precision, and saved as the very tensors).
    """
    if unit_module in ignored_modules:
        return []
    result: list[nn.Module] = []
    seen: set[int] = set()
    # Pre-order with an explicit stack (children pushed in reverse): a recursive closure would
    # be a reference cycle holding the modules until the cyclic collector runs.
    stack = [unit_module]
    while stack:
        mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        result.append(mod)
        children = [c for c in mod.children() if not is_fsdp(c) and c not in ignored_modules]
        stack.extend(reversed(children))
    return result


def _fqn(module_name: str, param_name: str) -> str:
    return f"{module_name}.{param_name}" if module_name else param_name


def split_by_requires_grad(params: list[UnitParam], use_orig_params: bool) -> list[list[UnitParam]]:
    """One parameter list per handle: all together, or (use_orig_params) trainable then frozen.

    A separate frozen handle has no gradient at all, so frozen parameters cost no gradient
    memory (torch FSDP1 allocates a gradient for the whole flat parameter).
    """
    if not params:
        return []
    if not use_orig_params:
        return [params]
    trainable = [p for p in params if p[3].requires_grad]
    frozen = [p for p in params if not p[3].requires_grad]
    return [group for group in (trainable, frozen) if group]


def validate_unit_params(
    unit_name: str, params: Iterable[UnitParam], use_orig_params: bool = False, fqn_prefix: str = ""
) -> None:
    """Raises if a unit's parameters cannot share one FlatParameter.

    Args:
        unit_name: The unit's qualified name, for the message.
        params: The parameters the unit would flatten (names relative to the unit).
        use_orig_params: Frozen and trainable parameters may then share a unit.
        fqn_prefix: The unit's qualified name with a trailing dot (the message lists full
            parameter names, as torch FSDP1 does).

    Raises:
        ValueError: Parameters of different dtypes, or mixed requires_grad (which needs
            use_orig_params=True), naming the parameters.
    """
    params = list(params)
    dtypes: dict[object, list[str]] = {}
    flags: dict[bool, list[str]] = {}
    for module_name, _, name, param in params:
        dtypes.setdefault(param.dtype, []).append(_fqn(module_name, name))
        flags.setdefault(param.requires_grad, []).append(_fqn(module_name, name))
    if len(dtypes) > 1:
        listing = "; ".join(f"{dtype}: {', '.join(names[:4])}" for dtype, names in dtypes.items())
        raise ValueError(
            f"fsdp: the FSDP unit '{unit_name}' has parameters of different dtypes ({listing}). "
            f"A unit's parameters are flattened into one tensor and must share a dtype: cast "
            f"the module (e.g. module.to(torch.float32)) or wrap the differing submodules as "
            f"their own units."
        )
    if len(flags) > 1 and not use_orig_params:
        trainable, frozen = ([fqn_prefix + n for n in flags[flag]] for flag in (True, False))
        raise ValueError(
            f"fsdp: {unit_name} has both parameters with requires_grad=True and False. FSDP "
            f"does not support wrapping such modules when use_orig_params=False. Must flatten "
            f"tensors with uniform `requires_grad` when `use_orig_params=False`. If possible, "
            f"wrap the frozen parameters with FSDP separately (or pass use_orig_params=True, "
            f"or freeze/unfreeze the whole unit).\n"
            f"The following parameters have requires_grad=True:\n{trainable}\n"
            f"The following parameters have requires_grad=False:\n{frozen}"
        )


def check_not_flattened_elsewhere(
    unit_name: str, params: Iterable[UnitParam], unit_names: dict[object, str]
) -> None:
    """Raises if a Parameter of this unit was already flattened by another unit.

    That happens for tied weights when one of the modules was wrapped by hand first: the
    parameter can no longer move to a common ancestor unit.

    Args:
        unit_name: This unit's name, for the message.
        params: The parameters this unit would flatten.
        unit_names: Qualified names of known FSDP units by handle, for the message.

    Raises:
        ValueError: Naming both parameters, both units and the fix.
    """
    for module_name, _, name, param in params:
        marker = getattr(param, "_fsdp_flattened_into", None)
        if marker is None:
            continue
        handle_ref, other_fqn = marker
        handle = handle_ref()
        if handle is None:
            continue
        other_unit = unit_names.get(handle, handle.unit_name)
        raise ValueError(
            f"fsdp: parameter '{_fqn(module_name, name)}' of FSDP unit '{unit_name}' is the same "
            f"Parameter as '{other_fqn}' of FSDP unit '{other_unit}' (tied weights across units). "
            f"A unit wrapped by hand has already flattened it, so it cannot move to a common "
            f"ancestor unit. Wrap with auto_wrap_policy instead (fsdp then places tied "
            f"parameters in the lowest common ancestor unit), or do not wrap either module "
            f"separately."
        )
