"""What a ``PATCHES`` line declares, and the function the framework builds from it for vLLM to call.

A fix writes only its behaviour. The three kinds of line:

* ``wrap(behaviour)`` -- ``behaviour(wrapped, instance, args, kwargs)``, as a ``wrapt`` wrapper receives them
  (``wrapped`` bound to ``instance``; ``instance`` None for a module function); with ``bind=True``
  ``behaviour(wrapped, instance, call)``, ``call`` a :class:`Call` (the arguments by parameter name, as
  ``inspect.Signature.bind`` binds them);
* ``replace(function)`` -- the fix's function in place of vLLM's;
* ``attribute(value)`` -- a class data attribute.

:meth:`Patch.build` makes the value that is set: wrapt's ``FunctionWrapper`` over vLLM's value as the class
``__dict__`` holds it (so a method, ``classmethod`` or ``staticmethod`` binds as vLLM's does; vLLM's name, docstring,
``__wrapped__`` and any attribute, such as an ``lru_cache``'s ``cache_info``, read through it), with one wrapper
function that owns for every fix: the class policy (which instances a behaviour runs for: :func:`.family.covers`; any
other call goes to vLLM's own code unchanged), the argument access by name, refusals, and coroutine functions. The mark (``__vllm_minicpm_hotfix__``) is set by
:func:`.patching.set_attributes`. Nothing here imports vLLM, torch or transformers.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import MethodType, ModuleType
from typing import Any, NamedTuple

from ... import metrics
from .family import _ACTIVE, covers, model_of

#: ``model=SELF`` (the default): the instance a method is called on decides, by its own class.
SELF: Any = type("SELF", (), {"__repr__": lambda self: "SELF"})()
#: ``model=EVERY_CALL``: the target belongs to no one model (a vLLM function every model calls, a class every member
#: shares): the behaviour runs for every call.
EVERY_CALL: Any = type("EVERY_CALL", (), {"__repr__": lambda self: "EVERY_CALL"})()
#: Attribute of a built function: the fix's behaviour it runs (what a trace of a request looks for).
BEHAVIOUR_ATTR = "__vllm_minicpm_hotfix_behaviour__"


class Refusal(ValueError):
    """A fix's refusal of one request (HTTP 400: vLLM's front end answers a ``ValueError`` from its processor so).
    The framework counts it once, by fix and :attr:`cause`, on vLLM's ``/metrics`` (:mod:`vllm_minicpm_hotfix.metrics`)
    and raises it on; where :attr:`response` is set (vLLM's own error response, for a method that returns errors
    rather than raising them) it returns that instead."""

    #: A short fixed word for the kind of refusal (the metric's ``cause`` label; never the request's values).
    cause = "refused"
    #: What the wrapped method returns instead of raising, or None.
    response: Any = None

    def __init__(self, message: str, *, cause: str | None = None, response: Any = None) -> None:
        super().__init__(message)
        if cause is not None:
            self.cause = cause
        self.response = response


class Signature(NamedTuple):
    """``inspect.signature`` of a wrapped function, with what :func:`arguments` reads of it computed once."""

    signature: inspect.Signature
    positional: tuple[str, ...] | None  # every parameter plain or keyword-only: the positional ones; else None
    required: frozenset[str]

    @classmethod
    def of(cls, function: Callable[..., Any]) -> Signature:
        sig = inspect.signature(function)
        params = sig.parameters.values()
        plain = all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)
        return cls(sig, tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD) if plain else None,
                   frozenset(p.name for p in params if p.default is p.empty))


def arguments(sig: Signature, instance: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of one call by parameter name (the instance's parameter included where there is an instance,
    defaults not filled in), as ``inspect.Signature.bind(...).arguments`` gives them, and its ``TypeError``: for a
    signature of plain and keyword-only parameters (every vLLM method the fixes wrap) by a zip, else by ``bind``."""
    full = args if instance is None else (instance, *args)
    names = sig.positional
    if names is not None and len(full) <= len(names):
        out = dict(zip(names, full))
        if not kwargs or (out.keys().isdisjoint(kwargs) and kwargs.keys() <= sig.signature.parameters.keys()):
            out.update(kwargs)
            if sig.required <= out.keys():
                return out
    return dict(sig.signature.bind(*full, **kwargs).arguments)


class Call(dict):
    """One call of a wrapped method, as a ``bind=True`` behaviour receives it: a dict of the arguments passed by
    parameter name (the instance's parameter included, defaults not filled in), plus ``args`` / ``kwargs`` as passed
    after the instance (to call ``wrapped`` with). :meth:`replaced` gives ``(args, kwargs)`` with some parameters
    changed, split as ``inspect.BoundArguments`` splits them. A dict, so that reading an argument is one C call on the
    request path."""

    __slots__ = ("args", "kwargs", "_signature")

    @property
    def arguments(self) -> dict[str, Any]:
        """The arguments by parameter name (this mapping itself)."""
        return self

    @property
    def parameters(self) -> frozenset[str]:
        """Every parameter name of the wrapped function's signature."""
        return frozenset(self._signature.parameters)

    def replaced(self, **changes: Any) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of this call with ``changes`` (parameter -> value; the instance's parameter too), the
        instance's own argument included for a method (to call the plain function with)."""
        bound = inspect.BoundArguments(self._signature, {**self, **changes})
        return bound.args, bound.kwargs


class Patch:
    """One ``PATCHES`` value: what a fix declares for a target (see the module docstring). ``model`` decides which
    calls the behaviour runs for: :data:`SELF`, :data:`EVERY_CALL`, or ``model(instance, args, kwargs)`` returning the
    subject :func:`.family.covers` judges (a model instance or class, a member's name, or None: vLLM's own code)."""

    __slots__ = ("kind", "behaviour", "bind", "model")

    def __init__(self, kind: str, behaviour: Any, bind: bool = False, model: Any = SELF) -> None:
        self.kind, self.behaviour, self.bind, self.model = kind, behaviour, bind, model

    def __repr__(self) -> str:
        return f"<{self.kind} {getattr(self.behaviour, '__qualname__', self.behaviour)!r}>"

    def build(self, fix: ModuleType, original: Any, owner: Any, attr: str) -> Any:
        """The value to set on ``owner.attr`` for ``fix``, over vLLM's ``original`` as the class ``__dict__`` along
        the MRO holds it (a function, ``classmethod`` or ``staticmethod``; None where there is none). Raises
        ``AttributeError`` for a ``wrap`` with nothing to wrap."""
        if self.kind == "attribute":
            return ForMembers(fix, attr, self.behaviour, owner)
        if self.kind == "wrap" and not _wrappable(original):
            raise AttributeError(f"{fix.NAME}: nothing to wrap at {getattr(owner, '__name__', owner)}.{attr}")
        method = isinstance(owner, type) and not isinstance(original, staticmethod)
        acts = _policy(fix, self.model, method)
        wrapped = original if _wrappable(original) else _absent(self.behaviour)
        signature = Signature.of(getattr(wrapped, "__func__", wrapped)) if self.bind else None
        unbound = method and not isinstance(original, classmethod)  # called from the class __dict__: self first
        built = wrapper_type()(wrapped, _wrapper(fix.NAME, self.kind, self.behaviour, acts, signature, unbound,
                                                 _is_coroutine(wrapped) or _is_coroutine(self.behaviour)))
        setattr(built, BEHAVIOUR_ATTR, self.behaviour)
        return built


def wrap(behaviour: Callable[..., Any], *, bind: bool = False, model: Any = SELF) -> Patch:
    """A ``PATCHES`` value: vLLM's function or method wrapped by ``behaviour`` for the calls ``model`` selects."""
    return Patch("wrap", behaviour, bind, model)


def replace(function: Callable[..., Any], *, model: Any = SELF) -> Patch:
    """A ``PATCHES`` value: ``function`` (vLLM's signature) instead of vLLM's own for the calls ``model`` selects;
    other calls get vLLM's own, or ``AttributeError`` where vLLM has none."""
    return Patch("replace", function, False, model)


def attribute(value: Any) -> Patch:
    """A ``PATCHES`` value: a class data attribute that is ``value`` for the declared members (:class:`ForMembers`)."""
    return Patch("attribute", value)


def _policy(fix: ModuleType, model: Any, method: bool) -> Callable[[Any, tuple, dict], bool] | None:
    """None (every call acts) or ``acts(instance, args, kwargs) -> bool``."""
    if model is EVERY_CALL:
        return None
    if model is SELF:
        if not method:
            raise TypeError(f"{fix.NAME}: a module function has no instance: say model=EVERY_CALL or a resolver")
        return ByClass(fix)

    def acts(instance: Any, args: tuple, kwargs: dict) -> bool:
        try:
            subject = model(instance, args, kwargs)
        except Exception:  # noqa: BLE001 - a call the resolver cannot read: vLLM's own code
            return False
        return covers(fix, subject)

    return acts


class ByClass:
    """The policy of ``model=SELF``: ``covers(fix, instance)``, decided once per member class and kept in
    :attr:`decided` with the members judged against (:meth:`against`: ``family._ACTIVE``'s entry, else ``MODELS``;
    decided again when that object changes). A class no member owns, or a class as instance, is judged (and reported)
    by :func:`.family.covers` each time."""

    __slots__ = ("fix", "name", "decided", "limit")

    def __init__(self, fix: ModuleType, limit: int = 64) -> None:
        self.fix, self.name, self.limit = fix, fix.NAME, limit
        self.decided: dict[type, tuple[Any, bool]] = {}

    def against(self) -> Any:
        active = _ACTIVE.get(self.name)
        return active if active is not None else getattr(self.fix, "MODELS", None)

    def __call__(self, instance: Any, args: tuple = (), kwargs: dict | None = None) -> bool:
        """Decide for ``instance`` now, and keep the decision for its class (the built function's usual call reads
        it)."""
        against, cls, ok = self.against(), type(instance), covers(self.fix, instance)
        if not isinstance(instance, type) and model_of(cls) is not None:
            if len(self.decided) >= self.limit:
                self.decided.clear()
            self.decided[cls] = (against, ok)
        return ok


def _counted(name: str, exc: Refusal) -> Any:
    """Count ``exc`` once for the fix ``name`` (the innermost fix it passes: the one whose behaviour raised it), then
    raise it on, or return its ``response``."""
    if getattr(exc, "_vllm_minicpm_hotfix_counted", False) is False:
        exc._vllm_minicpm_hotfix_counted = True
        metrics.refused(name, exc.cause)
    if exc.response is not None:
        return exc.response
    raise exc


def _wrappable(value: Any) -> bool:
    return callable(value) or isinstance(value, (classmethod, staticmethod))


def _is_coroutine(value: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(value, "__func__", value))


def _absent(behaviour: Any) -> Any:
    """What a ``replace`` wraps where vLLM defines nothing: the fix's function (called only for the calls the policy
    selects; any other call raises ``AttributeError``)."""
    if inspect.iscoroutinefunction(behaviour):
        async def absent(*args: Any, **kwargs: Any) -> Any:
            raise AttributeError(f"{behaviour.__qualname__}: vLLM defines no such attribute for this class")
    else:
        def absent(*args: Any, **kwargs: Any) -> Any:
            raise AttributeError(f"{behaviour.__qualname__}: vLLM defines no such attribute for this class")
    functools.update_wrapper(absent, behaviour)
    del absent.__wrapped__
    return absent


@functools.cache
def wrapper_type() -> type:
    """What the framework sets for a ``wrap`` or ``replace``: a subclass of wrapt's ``FunctionWrapper`` (binding as
    the wrapped descriptor binds: method, ``classmethod``, ``staticmethod``, module function) whose mark
    (:data:`.patching.MARKER_ATTR`) and :data:`BEHAVIOUR_ATTR` are its own attributes, not the wrapped function's
    (wrapt's proxy sets an attribute its class defines on itself). wrapt is imported here, at the first build: importing
    the fixes needs none."""
    from ..._wrapt import ensure_wrapt

    ensure_wrapt()
    import wrapt

    # Compared by identity: wrapt's proxy compares equal to what it wraps, so a value the hotfix set would be equal
    # to vLLM's own and a check that nothing was set on a class (its __dict__ before and after) would pass wrongly.
    return type("Wrapper", (wrapt.FunctionWrapper,), {"__vllm_minicpm_hotfix__": None, BEHAVIOUR_ATTR: None,
                                                       "__module__": __name__, "__eq__": _same, "__ne__": _not_same,
                                                       "__hash__": object.__hash__})


def _same(self: Any, other: Any) -> bool:
    return self is other


def _not_same(self: Any, other: Any) -> bool:
    return self is not other


def _wrapper(name: str, kind: str, behaviour: Any, acts: Any, signature: Signature | None, unbound: bool,
             coroutine: bool) -> Callable[..., Any]:
    """The one wrapt wrapper of a built value (for a method, the value taken from the class ``__dict__`` and called
    with ``self`` first is bound to it here, as the plain function would be): the class policy first (``acts``; under :class:`ByClass` the decision
    kept for the instance's class is read inline), then ``behaviour`` for the calls it selects and vLLM's own
    (``wrapped``) for the others; a :class:`Refusal` is counted for fix ``name``."""
    by_class = acts if isinstance(acts, ByClass) else None
    decided = by_class.decided if by_class is not None else None
    fix = by_class.fix if by_class is not None else None
    replacing = kind == "replace"

    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if unbound and instance is None and args:
            instance, args, wrapped = args[0], args[1:], MethodType(wrapped, args[0])
        try:
            if acts is not None:
                entry = decided.get(type(instance)) if decided is not None else None
                if entry is not None and entry[0] is (_ACTIVE[name] if name in _ACTIVE
                                                      else getattr(fix, "MODELS", None)):
                    ok = entry[1]
                else:
                    ok = acts(instance, args, kwargs)
                if not ok:
                    return wrapped(*args, **kwargs)
            if replacing:
                return behaviour(*args, **kwargs) if instance is None else behaviour(instance, *args, **kwargs)
            if signature is None:
                return behaviour(wrapped, instance, args, kwargs)
            try:
                call = Call(arguments(signature, instance, args, kwargs))
            except TypeError:
                return wrapped(*args, **kwargs)
            call.args, call.kwargs, call._signature = args, kwargs, signature.signature
            return behaviour(wrapped, instance, call)
        except Refusal as exc:
            return _counted(name, exc)

    if not coroutine:
        return wrapper

    async def async_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return await wrapper(wrapped, instance, args, kwargs)
        except Refusal as exc:
            return _counted(name, exc)

    return async_wrapper


class ForMembers:
    """A class data attribute that exists only for the members ``fix`` covers: read on such a class or its instance
    it is ``value``; on any other subclass it is what that class saw without the fix (the attribute of the next class
    in its MRO after ``owner``), else ``AttributeError``."""

    def __init__(self, fix: ModuleType, attr: str, value: Any, owner: type) -> None:
        self.fix, self.attr, self.value, self.owner = fix, attr, value, owner

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        cls = cls if cls is not None else type(obj)
        if covers(self.fix, cls):
            return self.value
        mro = list(getattr(cls, "__mro__", ()))
        for base in mro[mro.index(self.owner) + 1:] if self.owner in mro else ():
            if self.attr in vars(base):
                found = vars(base)[self.attr]
                return found.__get__(obj, cls) if hasattr(found, "__get__") else found
        raise AttributeError(f"{self.attr} ({self.fix.NAME} does not cover {cls.__name__})")
