"""Auto-wrap policies and the ``enable_wrap`` / ``wrap`` annotations (the public names only).

A *wrap policy* decides which submodules of a model become their own sharded unit (their own
wrapper instance, and so their own flat parameter). Two kinds of policy are accepted, exactly
as in PyTorch FSDP1's wrap module:

* **Functional policies**: callables ``policy(module=..., recurse=..., nonwrapped_numel=...)``
  returning a bool. The planner walks the module tree depth-first. For every module it first
  asks ``policy(recurse=True)`` whether to descend into it; after the children have been handled
  it asks ``policy(recurse=False, nonwrapped_numel=remainder)`` whether to wrap the module
  itself, where ``remainder`` is the numel of the module's parameters not already owned by a
  wrapped descendant. :func:`always_wrap_policy`, :func:`size_based_auto_wrap_policy` and (bound
  with :func:`functools.partial`) :func:`lambda_auto_wrap_policy` and
  :func:`transformer_auto_wrap_policy` are functional policies.
* **Policy objects** (subclasses of :class:`_Policy`, i.e. :class:`ModuleWrapPolicy` and
  :class:`CustomPolicy`): they return, in one pass, a map from each module to wrap to the
  keyword arguments its wrapper is constructed with, so different units may be configured
  differently.

Running a policy is the constructor's job: given ``auto_wrap_policy``, it plans every nested unit
first (``fsdp/init/_auto_wrap.py`` and ``fsdp/init/_validate.py``'s ``plan_units``, which check
everything before the model changes), then wraps the chosen submodules bottom-up, in place, and
wraps the root itself last. This module imports nothing from fsdp (it sits with ``fsdp.api`` at
the bottom of the layers, see docs/design.md).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Set, Tuple, Type, Union

from torch import nn

__all__ = [
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "enable_wrap",
    "wrap",
    "CustomPolicy",
    "ModuleWrapPolicy",
]

_ROOT_NAME = "<root>"


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _as_class_tuple(classes: Iterable[type], arg_name: str) -> Tuple[type, ...]:
    """Return ``classes`` (an iterable of classes) as a tuple usable with ``isinstance``.

    Args:
        classes: The user-supplied collection of classes.
        arg_name: The argument's name, used in the error message.

    Returns:
        The classes as a tuple (duplicates removed).

    Raises:
        TypeError: If ``classes`` is a single class or not an iterable of classes.
    """
    if isinstance(classes, type):
        raise TypeError(
            f"{arg_name} must be a collection of module classes, but got the single class "
            f"{classes.__name__}; pass {{{classes.__name__}}} instead."
        )
    try:
        items = tuple(dict.fromkeys(classes))
    except TypeError:
        raise TypeError(
            f"{arg_name} must be a collection of module classes such as {{MyBlock}}, "
            f"but got an object of type {type(classes).__name__}."
        ) from None
    for item in items:
        if not isinstance(item, type):
            raise TypeError(
                f"{arg_name} must contain only classes, but it contains {item!r} "
                f"(of type {type(item).__name__})."
            )
    return items


def _module_name(name: str) -> str:
    """Return a printable qualified name (the root module's empty name becomes ``<root>``)."""
    return name if name else _ROOT_NAME


def _is_class_wrap_decision(module: nn.Module, recurse: bool, classes: Tuple[type, ...]) -> bool:
    """Shared logic of the class-based policies: always descend; wrap instances of ``classes``."""
    if recurse:
        return True
    return isinstance(module, classes)


# ---------------------------------------------------------------------------------------------
# Functional policies
# ---------------------------------------------------------------------------------------------


def always_wrap_policy(*args: object, **kwargs: object) -> bool:
    """Wrap every submodule.

    Always returns ``True``: the planner descends into every module and wraps every submodule
    (the root is wrapped by the caller), so each module becomes its own sharded unit.

    Args:
        *args: Ignored (``module``, ``recurse``, ``nonwrapped_numel`` positionally).
        **kwargs: Ignored (the same, by keyword).

    Returns:
        ``True``.
    """
    return True


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[[nn.Module], bool]
) -> bool:
    """Wrap every module for which a user function returns a truthy value.

    Bind ``lambda_fn`` with :func:`functools.partial` before passing it as a policy, e.g.
    ``functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, MyBlock))``.

    Args:
        module: The module being considered.
        recurse: ``True`` while the planner decides whether to descend into ``module``; ``False``
            when it decides whether to wrap ``module`` itself.
        nonwrapped_numel: Numel of ``module``'s parameters not yet owned by a wrapped descendant
            (unused by this policy).
        lambda_fn: Called with ``module``; the module is wrapped if it returns a truthy value.

    Returns:
        ``True`` when ``recurse`` is ``True`` (always descend); otherwise ``lambda_fn(module)``.
    """
    if recurse:
        return True
    return lambda_fn(module)


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: Set[Type[nn.Module]],
) -> bool:
    """Wrap every instance of the given (transformer block) classes.

    Bind ``transformer_layer_cls`` with :func:`functools.partial` before passing it as a policy,
    e.g. ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={MyBlock})``.
    Parameters outside every block (embeddings, final norm, a tied output head) stay with the
    enclosing unit, which keeps shared parameters in the same unit.

    Args:
        module: The module being considered.
        recurse: ``True`` while the planner decides whether to descend into ``module``; ``False``
            when it decides whether to wrap ``module`` itself.
        nonwrapped_numel: Numel of ``module``'s parameters not yet owned by a wrapped descendant
            (unused by this policy).
        transformer_layer_cls: The module classes to wrap.

    Returns:
        ``True`` when ``recurse`` is ``True`` (always descend); otherwise whether ``module`` is
        an instance of one of ``transformer_layer_cls``.

    Raises:
        TypeError: If ``transformer_layer_cls`` is not a collection of classes.
    """
    if recurse:
        return True
    return isinstance(module, _as_class_tuple(transformer_layer_cls, "transformer_layer_cls"))


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: Optional[Set[Type[nn.Module]]] = None,
    exclude_wrap_modules: Optional[Set[Type[nn.Module]]] = None,
) -> bool:
    """Wrap a module once at least ``min_num_params`` of its parameters are still unwrapped.

    Bind the threshold with :func:`functools.partial`, e.g.
    ``functools.partial(size_based_auto_wrap_policy, min_num_params=int(1e6))``.

    Args:
        module: The module being considered.
        recurse: ``True`` while the planner decides whether to descend into ``module``; ``False``
            when it decides whether to wrap ``module`` itself.
        nonwrapped_numel: Numel of ``module``'s parameters not yet owned by a wrapped
            descendant (when ``recurse`` is ``True``: all of its parameters).
        min_num_params: The numel threshold (kept under this name for compatibility; it counts
            elements, not tensors).
        force_leaf_modules: Module classes whose children are never considered (the planner does
            not descend into them). ``None`` means
            ``size_based_auto_wrap_policy.FORCE_LEAF_MODULES`` (``{nn.MultiheadAttention}``).
        exclude_wrap_modules: Module classes that are never wrapped themselves. ``None`` means
            ``size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES``
            (``{nn.ModuleList, nn.ModuleDict}``).

    Returns:
        When ``recurse`` is ``True``: whether ``module`` is large enough and not a forced leaf.
        Otherwise: whether ``module`` is large enough and not an excluded class.
    """
    if force_leaf_modules is None:
        force_leaf_modules = _size_policy_defaults.FORCE_LEAF_MODULES
    if exclude_wrap_modules is None:
        exclude_wrap_modules = _size_policy_defaults.EXCLUDE_WRAP_MODULES
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(force_leaf_modules))
    return is_large and not isinstance(module, tuple(exclude_wrap_modules))


# Defaults for ``size_based_auto_wrap_policy`` (importable and overridable, as in torch).
# Any: attributes set on a function object, which the type system cannot declare.
_size_policy_defaults: Any = size_based_auto_wrap_policy
_size_policy_defaults.FORCE_LEAF_MODULES = {nn.MultiheadAttention}
_size_policy_defaults.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}


# ---------------------------------------------------------------------------------------------
# Policy objects
# ---------------------------------------------------------------------------------------------


# Any (Dict[str, Any] below): FSDP constructor keyword arguments, of mixed types. Torch's
# policies type them so, and a user's ``dict[str, X]`` must pass (dict is invariant).
class _Policy(ABC):
    """Base class of policies that pick all modules to wrap (and their kwargs) in one pass."""

    @abstractmethod
    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: Set[nn.Module],
        root_kwargs: Dict[str, Any],
    ) -> Dict[nn.Module, Dict[str, Any]]:
        """Return a map from each module to wrap to the kwargs its wrapper is built with.

        Args:
            root_module: The root of the module tree (it may appear in the result; the planner
                never wraps it, the caller does).
            ignored_modules: Modules that must not appear in the result.
            root_kwargs: The root wrapper's keyword arguments, the default for every unit.

        Returns:
            ``{module: kwargs}`` for every module to wrap.
        """


class ModuleWrapPolicy(_Policy):
    """Wrap every module that is an instance of one of the given classes.

    Each wrapped module gets (a shallow copy of) the root's keyword arguments. The instance is
    also usable as a functional policy ``policy(module, recurse, nonwrapped_numel)``.

    Args:
        module_classes: The module classes to wrap, e.g. ``{MyTransformerBlock}``.

    Raises:
        TypeError: If ``module_classes`` is a single class or not a collection of classes.
    """

    def __init__(self, module_classes: Iterable[Type[nn.Module]]) -> None:
        module_classes_set = set(_as_class_tuple(module_classes, "module_classes"))
        self._module_classes: Set[Type[nn.Module]] = module_classes_set
        self._module_classes_str = str(module_classes_set)

    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: Set[nn.Module],
        root_kwargs: Dict[str, Any],
    ) -> Dict[nn.Module, Dict[str, Any]]:
        """Return ``{module: copy of root_kwargs}`` for every instance of the policy's classes.

        Args:
            root_module: The root of the module tree.
            ignored_modules: Modules to skip.
            root_kwargs: The root wrapper's keyword arguments.

        Returns:
            The modules to wrap, each with its own shallow copy of ``root_kwargs``.
        """
        classes = tuple(self._module_classes)
        return {
            module: dict(root_kwargs)
            for module in root_module.modules()
            if module not in ignored_modules and isinstance(module, classes)
        }

    def __call__(self, module: nn.Module, recurse: bool, *args: object, **kwargs: object) -> bool:
        """Functional-policy form: always descend; wrap instances of the policy's classes.

        Args:
            module: The module being considered.
            recurse: Whether the planner is deciding to descend (``True``) or to wrap (``False``).
            *args: Ignored (``nonwrapped_numel``).
            **kwargs: Ignored (``nonwrapped_numel``).

        Returns:
            ``True`` if ``recurse``; else whether ``module`` is an instance of the classes.
        """
        return _is_class_wrap_decision(module, recurse, tuple(self._module_classes))

    def __repr__(self) -> str:
        return super().__repr__() + f"({self._module_classes_str})"


class CustomPolicy(_Policy):
    """Wrap modules chosen by a user function, optionally with per-module kwargs.

    ``lambda_fn(module)`` is called for every (non-ignored) module and returns:

    * ``False`` or ``{}``: do not wrap the module;
    * ``True``: wrap it with the root's kwargs;
    * a non-empty ``dict``: wrap it with the root's kwargs updated by that dict, e.g.
      ``{"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}``.

    The instance is also usable as a functional policy ``policy(module, recurse,
    nonwrapped_numel)`` (always descend; wrap when ``lambda_fn`` returns ``True`` or a non-empty
    dict).

    Args:
        lambda_fn: The per-module decision function.
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], Union[bool, Dict[str, Any]]]) -> None:
        if not callable(lambda_fn):
            raise TypeError(
                "CustomPolicy expects a callable lambda_fn(module) -> bool | dict, but got an "
                f"object of type {type(lambda_fn).__name__}."
            )
        self._lambda_fn = lambda_fn

    def _decide(self, module: nn.Module, module_name: str) -> Union[bool, Dict[str, Any]]:
        """Call ``lambda_fn`` on ``module`` and validate what it returned."""
        result = self._lambda_fn(module)
        if not isinstance(result, (bool, dict)):
            raise ValueError(
                "The lambda_fn passed to CustomPolicy must return True/False or a dict of "
                f"keyword-argument overrides, but for module {_module_name(module_name)!r} "
                f"({type(module).__name__}) it returned {result!r} of type "
                f"{type(result).__name__}."
            )
        return result

    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: Set[nn.Module],
        root_kwargs: Dict[str, Any],
    ) -> Dict[nn.Module, Dict[str, Any]]:
        """Return the modules ``lambda_fn`` selects, each with its merged kwargs.

        Args:
            root_module: The root of the module tree.
            ignored_modules: Modules to skip (``lambda_fn`` is not called on them).
            root_kwargs: The root wrapper's keyword arguments.

        Returns:
            ``{module: {**root_kwargs, **overrides}}`` for every selected module.

        Raises:
            ValueError: If ``lambda_fn`` returns something other than a bool or a dict.
        """
        target_module_to_kwargs: Dict[nn.Module, Dict[str, Any]] = {}
        for name, module in root_module.named_modules():
            if module in ignored_modules:
                continue
            result = self._decide(module, name)
            if not result:
                continue
            kwargs = dict(root_kwargs)
            if isinstance(result, dict):
                kwargs.update(result)
            target_module_to_kwargs[module] = kwargs
        return target_module_to_kwargs

    def __call__(self, module: nn.Module, recurse: bool, *args: object, **kwargs: object) -> bool:
        """Functional-policy form: always descend; wrap when ``lambda_fn`` selects the module.

        Per-module kwargs overrides are not available in this form (a functional policy only
        says yes or no); pass the instance itself as the policy to get them.

        Args:
            module: The module being considered.
            recurse: Whether the planner is deciding to descend (``True``) or to wrap (``False``).
            *args: Ignored (``nonwrapped_numel``).
            **kwargs: Ignored (``nonwrapped_numel``).

        Returns:
            ``True`` if ``recurse``; else whether ``lambda_fn`` returned ``True`` or a non-empty
            dict.

        Raises:
            ValueError: If ``lambda_fn`` returns something other than a bool or a dict.
        """
        if recurse:
            return True
        return bool(self._decide(module, type(module).__name__))

    def __repr__(self) -> str:
        return super().__repr__() + f"({self._lambda_fn!r})"


# ---------------------------------------------------------------------------------------------
# enable_wrap / wrap
# ---------------------------------------------------------------------------------------------


class _WrapContext:
    """Process-wide state of the active :func:`enable_wrap` context (at most one at a time)."""

    active: bool = False
    wrapper_cls: Optional[Callable[..., nn.Module]] = None
    kwargs: Dict[str, object] = {}


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Callable[..., nn.Module], **wrapper_kwargs: object) -> Iterator[None]:
    """Make :func:`wrap` wrap modules with ``wrapper_cls`` while the context is active.

    Useful to shard large layers as they are built, with one shared configuration::

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, **fsdp_kwargs):
            self.layer = wrap(nn.Linear(4096, 4096))

    Args:
        wrapper_cls: The class (or callable) ``wrap`` calls as ``wrapper_cls(module, **kwargs)``.
        **wrapper_kwargs: Default keyword arguments for every ``wrap`` call in the context.

    Yields:
        Nothing; the configuration is active until the ``with`` block exits.

    Raises:
        NotImplementedError: If another ``enable_wrap`` context is already active (nesting is
            not supported).
        TypeError: If ``wrapper_cls`` is not callable.
    """
    if _WrapContext.active:
        raise NotImplementedError(
            "enable_wrap() contexts cannot be nested: an enable_wrap context is already active. "
            "Exit it first, or pass different settings to individual wrap(module, **overrides) "
            "calls instead."
        )
    if not callable(wrapper_cls):
        raise TypeError(
            "enable_wrap() needs a callable wrapper_cls such as FullyShardedDataParallel, but got "
            f"an object of type {type(wrapper_cls).__name__}."
        )
    _WrapContext.active = True
    _WrapContext.wrapper_cls = wrapper_cls
    _WrapContext.kwargs = dict(wrapper_kwargs)
    try:
        yield
    finally:
        _WrapContext.active = False
        _WrapContext.wrapper_cls = None
        _WrapContext.kwargs = {}


def _wrap(module: nn.Module, wrapper_cls: Callable[..., nn.Module], **kwargs: object) -> nn.Module:
    """Construct ``wrapper_cls(module, **kwargs)``, honouring ``module._wrap_overrides``.

    A module may carry a ``_wrap_overrides`` dict whose entries take priority over ``kwargs``
    (as in torch; used e.g. to force ``mixed_precision=None`` on a module).
    """
    overrides = getattr(module, "_wrap_overrides", None)
    if isinstance(overrides, dict):
        kwargs = {**kwargs, **overrides}
    return wrapper_cls(module, **kwargs)


def wrap(module: nn.Module, **wrap_overrides: object) -> nn.Module:
    """Wrap ``module`` if called inside :func:`enable_wrap`; otherwise return it unchanged.

    This lets a model be built with or without wrapping without changing its code.

    Args:
        module: The module to wrap.
        **wrap_overrides: Keyword arguments taking priority over the ``enable_wrap`` ones.

    Returns:
        ``wrapper_cls(module, **{**wrapper_kwargs, **wrap_overrides})`` inside an
        ``enable_wrap`` context, else ``module`` itself.
    """
    if not _WrapContext.active or _WrapContext.wrapper_cls is None:
        return module
    return _wrap(module, _WrapContext.wrapper_cls, **{**_WrapContext.kwargs, **wrap_overrides})
