"""Which parameters a unit manages, and checks on them before anything is changed."""

from __future__ import annotations

from typing import Callable, Iterable

from torch import nn

UnitParam = tuple[str, nn.Module, str, nn.Parameter]


def collect_unit_params(
    module: nn.Module, is_other_unit: Callable[[nn.Module], bool]
) -> list[UnitParam]:
    """Lists ``(module_name, module, param_name, param)`` for every parameter name of the unit.

    Pre-order over ``module``'s subtree (the order of ``named_parameters``), skipping the
    subtrees of other units (nested FSDP instances, or modules a policy will wrap). A parameter
    reachable under two names appears twice; FlatParamHandle stores it once.
    """
    result: list[UnitParam] = []
    seen_modules: set[int] = set()

    def visit(prefix: str, mod: nn.Module) -> None:
        if id(mod) in seen_modules:
            return
        seen_modules.add(id(mod))
        for name, param in mod._parameters.items():
            if param is not None:
                result.append((prefix, mod, name, param))
        for child_name, child in mod._modules.items():
            if child is None or is_other_unit(child):
                continue
            visit(f"{prefix}.{child_name}" if prefix else child_name, child)

    visit("", module)
    return result


def _fqn(module_name: str, param_name: str) -> str:
    return f"{module_name}.{param_name}" if module_name else param_name


def validate_unit_params(unit_name: str, params: Iterable[UnitParam]) -> None:
    """Raises if a unit's parameters cannot share one FlatParameter.

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
    if len(flags) > 1:
        listing = "; ".join(
            f"requires_grad={flag}: {', '.join(names[:4])}" for flag, names in flags.items()
        )
        raise ValueError(
            f"fsdp: the FSDP unit '{unit_name}' mixes frozen and trainable parameters ({listing}). "
            f"With use_orig_params=False a unit's parameters must all have the same "
            f"requires_grad: wrap the frozen submodules as their own units, or freeze/unfreeze "
            f"the whole unit."
        )


def check_no_param_in_two_units(units: dict[str, list[UnitParam]]) -> None:
    """Raises if one Parameter would be flattened into two units (tied weights across units).

    Raises:
        ValueError: Naming both parameters, both units and the fix.
    """
    owner: dict[int, tuple[str, str]] = {}
    for unit_name, params in units.items():
        for module_name, _, name, param in params:
            fqn = _fqn(module_name, name)
            if id(param) in owner and owner[id(param)][0] != unit_name:
                other_unit, other_fqn = owner[id(param)]
                raise ValueError(
                    f"fsdp: parameter '{fqn}' of FSDP unit '{unit_name}' is the same Parameter "
                    f"as '{other_fqn}' of FSDP unit '{other_unit}' (tied weights across units). "
                    f"Tied parameters must live in one unit: wrap a common ancestor of both "
                    f"modules instead (e.g. exclude one of them from the auto_wrap_policy)."
                )
            owner.setdefault(id(param), (unit_name, fqn))
