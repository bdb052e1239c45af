"""Teach ``torch.distributed.checkpoint.state_dict`` that fsdp's units are FSDP1 units.

Torch's DCP state-dict API (``get_state_dict``, ``set_state_dict`` and the model / optimizer
variants) recognises FSDP1 through four names bound in its module when it is first imported: the
wrapper class (``isinstance`` checks and the static methods ``fsdp_modules``,
``state_dict_type``, ``optim_state_dict``, ``optim_state_dict_to_load``), the state lookup
``_get_module_fsdp_state_if_fully_sharded_module`` (torch's composable-state registry, which
knows only torch's own state objects) and ``HYBRID_SHARDING_STRATEGIES``. Without help it treats
an fsdp model as a plain module (full tensors on every rank, optimizer state keyed by fsdp's
internal names: checkpoints that save but do not load, or load wrongly), or, after
:func:`fsdp.redirect_torch_fsdp`, fails in ``_verify_state_dict``.

:func:`install` rebinds those four names in that module, once, to objects that answer for both
libraries: a model holding fsdp's units is driven through fsdp's FSDP1 methods (torch's enums
and configs translated to fsdp's by name), any other model through whatever the module had
bound (torch's FSDP1, or under the redirect fsdp's wrapper itself). A model holding units of
both libraries is refused with an error before anything is gathered or saved. The design note
is "[Note: DCP state-dict bridge]" in docs/stacks.md.

``import fsdp`` calls :func:`install`: if torch's module is already imported it is patched at
once, otherwise right after its first import ([Note: After-import callbacks] in
``fsdp/_common.py``). Nothing of torch's FSDP is imported by fsdp for this: the wrapper class
the bridge falls back to is the one torch's module bound itself.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from typing import Any, Callable, ContextManager, List, Optional

import torch
import torch.distributed as dist
from torch import nn

import fsdp.api as fsdp_api
from fsdp._common import call_after_import
from fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as _OurFSDP
from fsdp.flat_param._policy import HYBRID_STRATEGIES

__all__ = ["install"]

_DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"
_INSTALLED_FLAG = "_fsdp_dcp_bridge"


def _has_our_units(module: nn.Module) -> bool:
    return any(isinstance(m, _OurFSDP) for m in module.modules())


# Any: torch FSDP1's enum member or config in, fsdp's out; neither side can be named here.
def _ours(value: Any) -> Any:
    """torch's FSDP1 enum member or state-dict config as fsdp's equal one (by name and fields)."""
    if value is None or type(value).__module__.startswith("fsdp."):
        return value
    ours = getattr(fsdp_api, type(value).__name__, None)
    if isinstance(value, enum.Enum) and isinstance(ours, type) and issubclass(ours, enum.Enum):
        return ours[value.name]
    if dataclasses.is_dataclass(value) and isinstance(ours, type) and dataclasses.is_dataclass(ours):
        names = {f.name for f in dataclasses.fields(ours)}
        return ours(**{f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.name in names})
    raise TypeError(
        f"fsdp: cannot translate {value!r} ({type(value).__qualname__}) to fsdp's state-dict settings; "
        "pass fsdp's StateDictType and configs"
    )


# torch's FSDP1 wrapper class, or fsdp's: both carry the FSDP1 static methods torch's module
# calls (fsdp_modules, state_dict_type, optim_state_dict, optim_state_dict_to_load); torch's
# cannot be named in a type here (fsdp never imports torch's FSDP), hence Any.
_FSDP1Class = Any


def _make_wrapper_class(bound: _FSDP1Class) -> type:
    """The class torch's module sees as ``FSDP``: both libraries' wrappers are instances of it."""

    class _BothMeta(type):
        def __instancecheck__(cls, obj: object) -> bool:
            return isinstance(obj, (bound, _OurFSDP))

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, (bound, _OurFSDP))

    def _pick(module: nn.Module) -> _FSDP1Class:
        return _OurFSDP if _has_our_units(module) else bound

    class FullyShardedDataParallel(metaclass=_BothMeta):
        """torch's FSDP1 wrapper for torch's units, fsdp's for fsdp's (see this module's docstring)."""

        @staticmethod
        def fsdp_modules(module: nn.Module, root_only: bool = False) -> List[nn.Module]:
            ours: List[nn.Module] = list(_OurFSDP.fsdp_modules(module, root_only))
            theirs: List[nn.Module] = [m for m in bound.fsdp_modules(module, root_only) if not isinstance(m, _OurFSDP)]
            if ours and theirs:
                raise ValueError(
                    "fsdp: this model holds units of both fsdp and torch's FSDP1 "
                    f"({type(ours[0]).__module__}.{type(ours[0]).__qualname__} and "
                    f"{type(theirs[0]).__module__}.{type(theirs[0]).__qualname__}); "
                    "torch.distributed.checkpoint.state_dict cannot save or load such a model: wrap it "
                    "with one library only"
                )
            return ours or theirs

        @staticmethod
        def state_dict_type(
            module: nn.Module,
            state_dict_type: Any,  # Any: torch FSDP1's or fsdp's StateDictType and configs (see _ours)
            state_dict_config: Any = None,
            optim_state_dict_config: Any = None,
        ) -> ContextManager[None]:
            if _pick(module) is _OurFSDP:
                return _OurFSDP.state_dict_type(
                    module, _ours(state_dict_type), _ours(state_dict_config), _ours(optim_state_dict_config)
                )
            return bound.state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)

        @staticmethod
        def optim_state_dict(
            model: nn.Module,
            optim: torch.optim.Optimizer,
            optim_state_dict: Optional[dict] = None,
            group: Optional[dist.ProcessGroup] = None,
        ) -> dict:
            return _pick(model).optim_state_dict(model, optim, optim_state_dict, group=group)

        @staticmethod
        def optim_state_dict_to_load(
            model: nn.Module,
            optim: torch.optim.Optimizer,
            optim_state_dict: dict,
            is_named_optimizer: bool = False,
            load_directly: bool = False,
            group: Optional[dist.ProcessGroup] = None,
        ) -> dict:
            return _pick(model).optim_state_dict_to_load(
                model, optim, optim_state_dict, is_named_optimizer, load_directly, group
            )

    FullyShardedDataParallel.__module__ = __name__
    return FullyShardedDataParallel


def _make_state_lookup(bound: Callable[[nn.Module], object]) -> Callable[[nn.Module], object]:
    def _get_module_fsdp_state_if_fully_sharded_module(module: nn.Module) -> object:
        # An fsdp unit is its own state, as torch's FSDP1 wrapper is (torch returns the module).
        return module if isinstance(module, _OurFSDP) else bound(module)

    return _get_module_fsdp_state_if_fully_sharded_module


def _patch(module: types.ModuleType) -> None:
    """Rebinds the four FSDP1 names of torch's DCP state-dict module (once)."""
    if getattr(module, _INSTALLED_FLAG, False):
        return
    bound = getattr(module, "FSDP")
    if not (isinstance(bound, type) and issubclass(bound, _OurFSDP)):
        setattr(module, "FSDP", _make_wrapper_class(bound))
    lookup = "_get_module_fsdp_state_if_fully_sharded_module"
    setattr(module, lookup, _make_state_lookup(getattr(module, lookup)))
    hybrid = set(getattr(module, "HYBRID_SHARDING_STRATEGIES")) | set(HYBRID_STRATEGIES)
    setattr(module, "HYBRID_SHARDING_STRATEGIES", hybrid)
    setattr(module, _INSTALLED_FLAG, True)


def install() -> None:
    """Makes torch's DCP state-dict API drive fsdp's units (idempotent).

    Patches ``torch.distributed.checkpoint.state_dict`` now if it is imported, otherwise right
    after it is (see the module docstring).
    """
    call_after_import(_DCP_STATE_DICT, _patch)  # [Note: After-import callbacks]
