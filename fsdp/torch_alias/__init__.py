"""Make torch's FSDP1 import path resolve to ``fsdp``, so training stacks run on it unchanged.

Stacks such as accelerate and Lightning, and scripts written for torch's FSDP1, import the
wrapper, its configs and its wrap policies from torch's fsdp package (``torch.distributed`` +
``.fsdp``). :func:`redirect_torch_fsdp`, called once before such code is imported, makes those
imports give ``fsdp``'s objects. The design note is "[Note: torch alias]" in docs/stacks.md; in
short:

* ``sys.modules`` gets an alias package under torch's name. Its attributes are ``fsdp``'s public
  FSDP1 names; its public submodules (``api``, ``wrap``, ``fully_sharded_data_parallel``,
  ``sharded_grad_scaler``) are ``fsdp``'s modules, entered in ``sys.modules`` under torch's names
  (``wrap`` with the private helpers torch's own code imports from it added, see
  :mod:`fsdp.torch_alias._wrap_compat`).
* Its ``__path__`` is torch's package directory, so torch's private submodules (the ones torch's
  own code imports: ``_fully_shard``, ``_common_utils``, ``_shard_utils``, ...) still load from
  torch's files, on demand, and keep working.
* torch's FSDP2 names (``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``, ...) are
  fetched from torch's ``_fully_shard`` subpackage by the alias's ``__getattr__``, only when
  asked for. Nothing of torch's FSDP is imported by the call itself.

Importing this module (``import fsdp`` does) also teaches
``torch.distributed.checkpoint.state_dict`` that fsdp's units are FSDP1 units, with or without
the redirect (:mod:`fsdp.torch_alias._dcp_bridge`, "[Note: DCP state-dict bridge]").

``python -m fsdp.torch_alias SCRIPT [ARGS...]`` (``__main__.py``) makes the call and runs an
unchanged script; launchers take it as a module (``torchrun ... -m fsdp.torch_alias train.py``).

This module names torch's package only through :data:`_TORCH_FSDP` (built at run time) and
imports nothing from it: ``fsdp`` never depends on torch's FSDP implementation.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

from fsdp._common import on_first_wrap
from fsdp.torch_alias import _dcp_bridge
from fsdp.torch_alias._wrap_compat import build_wrap_alias

__all__ = ["TorchFSDPRedirect", "redirect_torch_fsdp"]

_TORCH_DIST = "torch.distributed"
_TORCH_FSDP = _TORCH_DIST + ".fsdp"
# torch's FSDP2 implementation, a private subpackage of torch's fsdp package.
_FSDP2_SUBPACKAGE = "_fully_shard"
# The public submodules of torch's FSDP1 package, each answered by fsdp's module of that name.
_PUBLIC_SUBMODULES: Tuple[str, ...] = (
    "api",
    "wrap",
    "fully_sharded_data_parallel",
    "sharded_grad_scaler",
)

# torch's package ``__init__`` imports these private submodules first, in this order, and its
# other private submodules rely on it (``_common_utils`` and ``_flat_param`` import each other
# and only load in this order). The alias has no such ``__init__``, so :class:`_PrivateOrder`
# imports them, in this order, before the first other private submodule is loaded.
_INIT_ORDER: Tuple[str, ...] = ("_flat_param", _FSDP2_SUBPACKAGE)

_active: Optional["TorchFSDPRedirect"] = None

# torch.distributed.checkpoint.state_dict sees fsdp's units as FSDP1 units, with or without the
# redirect, from the first wrap on ([Note: DCP state-dict bridge] and "What fsdp changes in
# torch" in docs/stacks.md).
on_first_wrap(_dcp_bridge.install)


class _PrivateOrder(importlib.abc.MetaPathFinder):
    """Loads torch's private fsdp submodules in the order torch's package ``__init__`` would.

    It finds nothing itself (``find_spec`` returns ``None``, so the regular path finder loads
    the module from the alias's ``__path__``); it only imports :data:`_INIT_ORDER` first.
    """

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[types.ModuleType] = None
    ) -> None:
        prefix = _TORCH_FSDP + "."
        if not fullname.startswith(prefix):
            return None
        for first in _INIT_ORDER:
            first_name = prefix + first
            if fullname == first_name or fullname.startswith(first_name + "."):
                return None  # being imported now, in order
            if first_name not in sys.modules:
                importlib.import_module(first_name)
        return None


class _AliasPackage(types.ModuleType):
    """The package object entered in ``sys.modules`` under torch's fsdp package name.

    Attributes set on it are fsdp's FSDP1 names and modules. A missing attribute is looked up
    on demand: a private name (``_common_utils``) as torch's submodule of that name, a public
    one (``fully_shard``) in torch's FSDP2 subpackage.
    """

    __all__: list[str]
    wrap: types.ModuleType

    def __getattr__(self, name: str) -> Any:  # Any: a torch submodule or FSDP2 name, as ModuleType's
        if name.startswith("__"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        if name.startswith("_"):
            if importlib.util.find_spec(f"{self.__name__}.{name}") is not None:
                # The import sets the submodule as an attribute of this package.
                return importlib.import_module(f"{self.__name__}.{name}")
        else:
            fsdp2 = importlib.import_module(f"{self.__name__}.{_FSDP2_SUBPACKAGE}")
            if hasattr(fsdp2, name):
                value = getattr(fsdp2, name)
                setattr(self, name, value)
                return value
        raise AttributeError(
            f"module {self.__name__!r} has no attribute {name!r} (it is fsdp's alias package: "
            f"fsdp's FSDP1 names, and torch's FSDP2 names from its {_FSDP2_SUBPACKAGE!r} "
            "subpackage)"
        )


class TorchFSDPRedirect:
    """The handle of an installed redirect (see :func:`redirect_torch_fsdp`).

    Use :meth:`undo` (or the ``with`` statement) to put torch's package back.

    Attributes:
        preloaded: The names of torch's fsdp modules that were already imported when the
            redirect was installed (empty in the recommended order: redirect first). Objects
            that code took from them before the call stay torch's.
    """

    def __init__(
        self,
        saved_modules: Dict[str, types.ModuleType],
        saved_attr: object,
        had_attr: bool,
        finder: _PrivateOrder,
    ):
        self._saved_modules = saved_modules
        self._finder = finder
        self._saved_attr = saved_attr
        self._had_attr = had_attr
        self._active = True
        self.preloaded: Tuple[str, ...] = tuple(sorted(saved_modules))

    @property
    def active(self) -> bool:
        """Whether the redirect is still installed."""
        return self._active

    def undo(self) -> None:
        """Puts torch's fsdp package back as it was before :func:`redirect_torch_fsdp`.

        Every module under torch's package name that was loaded while the redirect was
        installed is dropped from ``sys.modules`` (those were bound to fsdp's public modules),
        except torch's FSDP2 subpackage (it registers torch operators, which cannot be done
        twice, and uses no FSDP1 name), and the entries present before are restored. Names
        that other modules imported while the redirect was installed stay fsdp's (for example
        the wrapper class bound by ``torch.distributed.checkpoint.state_dict`` if it was first
        imported then). Calling it again does nothing.
        """
        global _active
        if not self._active:
            return
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        for name in [n for n in sys.modules if _is_torch_fsdp_module(n)]:
            # torch's FSDP2 subpackage registers torch library operators when it loads, which a
            # second load would register again (an error), so a copy loaded under the alias
            # stays; it uses no FSDP1 name.
            if not name.startswith(f"{_TORCH_FSDP}.{_FSDP2_SUBPACKAGE}"):
                del sys.modules[name]
        sys.modules.update(self._saved_modules)
        dist = sys.modules[_TORCH_DIST]
        if self._had_attr:
            setattr(dist, "fsdp", self._saved_attr)
        elif "fsdp" in vars(dist):
            delattr(dist, "fsdp")
        self._active = False
        if _active is self:
            _active = None

    def __enter__(self) -> "TorchFSDPRedirect":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        return f"TorchFSDPRedirect({state}, preloaded={len(self.preloaded)} modules)"


def _is_torch_fsdp_module(name: str) -> bool:
    return name == _TORCH_FSDP or name.startswith(_TORCH_FSDP + ".")


def _torch_fsdp_dir() -> List[str]:
    """torch's fsdp package directory, found without importing the package."""
    loaded = sys.modules.get(_TORCH_FSDP)
    if loaded is not None and getattr(loaded, "__path__", None):
        return list(loaded.__path__)
    spec = importlib.util.find_spec(_TORCH_FSDP)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"redirect_torch_fsdp(): this torch build has no {_TORCH_FSDP!r} package to stand in "
            "for (torch.distributed unavailable?); fsdp can still be used by importing it directly"
        )
    return list(spec.submodule_search_locations)


def _build_alias_package(search_path: List[str]) -> _AliasPackage:
    import fsdp
    import fsdp.api
    import fsdp.fully_sharded_data_parallel
    import fsdp.sharded_grad_scaler
    import fsdp.wrap

    alias = _AliasPackage(_TORCH_FSDP, fsdp.__doc__)
    spec = importlib.machinery.ModuleSpec(_TORCH_FSDP, None, is_package=True)
    spec.submodule_search_locations = list(search_path)
    alias.__spec__ = spec
    alias.__path__ = list(search_path)
    alias.__package__ = _TORCH_FSDP
    alias.__all__ = [name for name in fsdp.__all__ if name != "FlatParameter"]  # as torch's FSDP1 part
    for name in fsdp.__all__:
        setattr(alias, name, getattr(fsdp, name))
    for sub in _PUBLIC_SUBMODULES:
        setattr(alias, sub, sys.modules[f"fsdp.{sub}"])
    # torch's own code imports private helpers from the wrap module: see fsdp/torch_alias/_wrap_compat.py.
    alias.wrap = build_wrap_alias(f"{_TORCH_FSDP}.wrap")
    return alias


def redirect_torch_fsdp() -> TorchFSDPRedirect:
    """Makes imports of torch's FSDP1 package give ``fsdp``'s implementation.

    Call it once, before importing the training stack or script code that imports torch's
    FSDP (accelerate, Lightning, a script written for torch's FSDP1)::

        import fsdp
        fsdp.redirect_torch_fsdp()
        import accelerate  # its FSDP1 path now wraps with fsdp.FullyShardedDataParallel

    Afterwards importing torch's fsdp package (``import``, ``from ... import``) gives an alias
    package whose FSDP1 names (``FullyShardedDataParallel``, ``ShardingStrategy``, the
    configs, ...) are fsdp's, and whose submodules ``api``, ``wrap``,
    ``fully_sharded_data_parallel`` and ``sharded_grad_scaler`` are fsdp's modules. torch's
    FSDP2 names (``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``,
    ``CPUOffloadPolicy``, ...) and torch's private submodules stay torch's, loaded only when
    asked for, so torch's own users of them (``torch.distributed.checkpoint``, FSDP2) keep
    working.

    The call is idempotent: while a redirect is installed it returns the same handle.

    Returns:
        The handle; :meth:`TorchFSDPRedirect.undo` (or leaving a ``with`` block) removes it.

    Raises:
        RuntimeError: If torch has no ``torch.distributed`` fsdp package to stand in for.

    Warns:
        UserWarning: If torch's package was imported before the call (for example by
            ``import lightning`` or ``import torch.distributed.checkpoint``): names that code
            imported from it before the call stay torch's, so a stack imported earlier may
            still wrap with torch's FSDP. Call it first.
    """
    global _active
    if _active is not None and _active.active:
        return _active
    import torch.distributed  # noqa: F401 (the parent package must exist; this does not import its fsdp)

    search_path = _torch_fsdp_dir()
    alias = _build_alias_package(search_path)
    saved_modules = {name: mod for name, mod in sys.modules.items() if _is_torch_fsdp_module(name)}
    dist = sys.modules[_TORCH_DIST]
    had_attr = "fsdp" in vars(dist)
    saved_attr = vars(dist).get("fsdp")

    if saved_modules:
        warnings.warn(
            f"redirect_torch_fsdp(): torch's {_TORCH_FSDP!r} was already imported (by something "
            "imported earlier, e.g. lightning or torch.distributed.checkpoint); from now on its "
            "imports give fsdp's FSDP1 names, but names imported from it before this call stay "
            "torch's. Call fsdp.redirect_torch_fsdp() before importing the training stack.",
            UserWarning,
            stacklevel=2,
        )
        # torch's private submodules already loaded keep serving (torch's own code holds them);
        # expose them on the alias as the import system would have.
        for name, mod in saved_modules.items():
            child = name[len(_TORCH_FSDP) + 1 :]
            if child and "." not in child and child.startswith("_"):
                setattr(alias, child, mod)

    sys.modules[_TORCH_FSDP] = alias
    for sub in _PUBLIC_SUBMODULES:
        sys.modules[f"{_TORCH_FSDP}.{sub}"] = getattr(alias, sub)
    setattr(dist, "fsdp", alias)
    finder = _PrivateOrder()
    sys.meta_path.insert(0, finder)
    _active = TorchFSDPRedirect(saved_modules, saved_attr, had_attr, finder)
    return _active

