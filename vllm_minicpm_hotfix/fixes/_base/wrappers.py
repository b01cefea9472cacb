"""What a ``PATCHES`` line declares, and the function the framework builds from it for vLLM to call.

A fix writes only its behaviour. The three kinds of line:

* ``wrap(behaviour)`` -- ``behaviour(wrapped, instance, args, kwargs)``, as a ``wrapt`` wrapper receives them
  (``wrapped`` bound to ``instance``; ``instance`` None for a module function); with ``bind=True``
  ``behaviour(wrapped, instance, call)``, ``call`` a :class:`Call` (the arguments by parameter name, bound once per
  target by :class:`Binding`);
* ``replace(function)`` -- the fix's function in place of vLLM's;
* ``attribute(value)`` -- a class data attribute.

:meth:`Patch.build` makes the value that is set, and owns for every fix, once: the class policy (which instances a
behaviour runs for: :func:`.family.covers`; any other call goes to vLLM's own code unchanged), the argument binding,
``functools.update_wrapper`` (vLLM's name, docstring and ``__wrapped__``; an ``lru_cache``'s ``cache_info`` /
``cache_clear``), and coroutine functions. The mark (``__vllm_minicpm_hotfix__``) is set by
:func:`.patching.set_attributes`. Nothing here imports vLLM, torch or transformers.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import MethodType, ModuleType
from typing import Any

from ... import metrics
from .family import _ACTIVE, covers, model_of

#: ``model=SELF`` (the default): the instance a method is called on decides, by its own class.
SELF: Any = type("SELF", (), {"__repr__": lambda self: "SELF"})()
#: ``model=EVERY_CALL``: the target belongs to no one model (a vLLM function every model calls, a class every member
#: shares): the behaviour runs for every call.
EVERY_CALL: Any = type("EVERY_CALL", (), {"__repr__": lambda self: "EVERY_CALL"})()
#: Attributes of vLLM's value that stay reachable on the built function (``functools.lru_cache``'s).
CARRIED = ("cache_info", "cache_clear")
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


class Binding:
    """The binding of calls of ``function``, computed once: :meth:`bind` gives the arguments passed, by parameter
    name (defaults not filled in), as ``inspect.signature(function).bind(...).arguments`` gives them, and the same
    ``TypeError`` where that raises. For a signature of plain and keyword-only parameters (every vLLM method the
    fixes wrap) the binding is computed here once; any other signature is bound by ``inspect`` on each call."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.signature = sig = inspect.signature(function)
        params = list(sig.parameters.values())
        self.simple = all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)
        self.positional = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
        self.names = frozenset(sig.parameters)
        self.required = frozenset(p.name for p in params if p.default is p.empty)
        self.qualname = getattr(function, "__qualname__", repr(function))
        # Only positional arguments, every required one passed and no more than there are: bound by a zip.
        required_at = [i + 1 for i, name in enumerate(self.positional) if name in self.required]
        self.fewest = max(required_at, default=0) if self.required <= set(self.positional) else None

    def bind(self, /, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.arguments(args, kwargs)

    def arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """:meth:`bind` of ``args`` and ``kwargs`` as a wrapper received them (no repacking of the call)."""
        if not self.simple:
            return dict(self.signature.bind(*args, **kwargs).arguments)
        if not kwargs and self.fewest is not None and self.fewest <= len(args) <= len(self.positional):
            return dict(zip(self.positional, args))
        if len(args) > len(self.positional):
            raise TypeError(f"{self.qualname}: too many positional arguments")
        out = dict(zip(self.positional, args))
        if kwargs:
            if not (kwargs.keys() <= self.names and out.keys().isdisjoint(kwargs)):
                key = next(k for k in kwargs if k not in self.names or k in out)
                raise TypeError(f"{self.qualname}: unexpected or repeated argument {key!r}")
            out.update(kwargs)
        if not self.required <= out.keys():
            raise TypeError(f"{self.qualname}: missing {sorted(self.required - out.keys())}")
        return out


def binder(function: Callable[..., Any]) -> Callable[..., dict[str, Any]]:
    """``Binding(function).bind``: the framework's binding, for the tests that pin it against ``inspect``."""
    return Binding(function).bind


class Call(dict):
    """One call of a wrapped method, as a ``bind=True`` behaviour receives it: a dict of the arguments passed by
    parameter name (the instance's parameter included, defaults not filled in), plus ``args`` / ``kwargs`` as passed
    after the instance (to call ``wrapped`` with). :meth:`replaced` gives ``(args, kwargs)`` with some parameters
    changed, split as ``inspect.BoundArguments`` splits them. A dict, so that reading an argument is one C call on the
    request path."""

    __slots__ = ("args", "kwargs", "_binding")

    @property
    def arguments(self) -> dict[str, Any]:
        """The arguments by parameter name (this mapping itself)."""
        return self

    @property
    def parameters(self) -> frozenset[str]:
        """Every parameter name of the wrapped function's signature."""
        return self._binding.names

    def replaced(self, **changes: Any) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of this call with ``changes`` (parameter -> value; the instance's parameter too), the
        instance's own argument included for a method (to call the plain function with)."""
        bound = inspect.BoundArguments(self._binding.signature, {**self, **changes})
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
        """The value to set on ``owner.attr`` for ``fix``, over vLLM's ``original`` (None where there is none).
        Raises ``AttributeError`` for a ``wrap`` with nothing to wrap."""
        if self.kind == "attribute":
            return ForMembers(fix, attr, self.behaviour, owner)
        method = isinstance(owner, type)
        if self.kind == "wrap" and not callable(original):
            raise AttributeError(f"{fix.NAME}: nothing to wrap at {getattr(owner, '__name__', owner)}.{attr}")
        acts = _policy(fix, self.model, method)
        fn = _built(fix.NAME, self.kind, self.behaviour, original, acts, method,
                    Binding(original) if self.bind else None)
        if callable(original):
            functools.update_wrapper(fn, original)
            for name in CARRIED:
                if hasattr(original, name):
                    setattr(fn, name, getattr(original, name))
        elif self.kind == "replace":
            functools.update_wrapper(fn, self.behaviour)
            del fn.__wrapped__
        setattr(fn, BEHAVIOUR_ATTR, self.behaviour)
        return fn


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


def _built(name: str, kind: str, behaviour: Any, original: Any, acts: Any, method: bool,
           binding: Binding | None) -> Any:
    """The plain function that runs ``behaviour`` for the calls ``acts`` selects and ``original`` for the others
    (counting a :class:`Refusal` for fix ``name``). For a method under :class:`ByClass`, the usual call (a decision
    kept for the instance's class and, for a binding, a call shape bound before) takes one frame, with no call on its
    way to the behaviour; every other call is decided and bound in full (:func:`function`)."""
    decided, fix = (acts.decided, acts.fix) if isinstance(acts, ByClass) else (None, None)
    # Call shapes (positional count, keyword names) that bound once: for plain parameters such a shape binds by a zip.
    shapes: set[Any] = set()  # an int for a call without keywords
    positional = binding.positional if binding is not None else ()
    replacing = kind == "replace"

    def own(args: tuple, kwargs: dict) -> Any:
        if original is None:
            raise AttributeError(f"{behaviour.__qualname__}: vLLM defines no such attribute for this class")
        return original(*args, **kwargs)

    def function(*args: Any, **kwargs: Any) -> Any:
        """Any call: decided by ``acts`` (which keeps a class's decision for :func:`kept`), bound in full."""
        try:
            instance, rest = (args[0] if args else None, args[1:]) if method else (None, args)
            if acts is not None and not acts(instance, rest, kwargs):
                return own(args, kwargs)
            if kind == "replace":
                return behaviour(*args, **kwargs)
            wrapped = MethodType(original, instance) if method else original
            if binding is None:
                return behaviour(wrapped, instance, rest, kwargs)
            try:
                call = Call(binding.arguments(args, kwargs))
            except TypeError:
                return own(args, kwargs)
            if binding.simple and len(shapes) < 64:
                shapes.add((len(args), *kwargs) if kwargs else len(args))  # the positional count alone: no tuple
            call.args, call.kwargs, call._binding = rest, kwargs, binding
            return behaviour(wrapped, instance, call)
        except Refusal as exc:
            return _counted(name, exc)

    def kept(*args: Any, **kwargs: Any) -> Any:
        """The usual call of a method: what :func:`function` does, from the decision kept for the instance's class
        (read inline: ``ByClass.against()``'s members, no call) and, for a binding, a shape bound before (by a zip)."""
        entry = decided.get(type(args[0])) if args else None
        if entry is None or entry[0] is not (_ACTIVE[name] if name in _ACTIVE else getattr(fix, "MODELS", None)):
            return function(*args, **kwargs)
        if not entry[1]:
            return own(args, kwargs)
        try:
            instance = args[0]
            if binding is None:  # a replace, or a wrap without a binding
                if replacing:
                    return behaviour(*args, **kwargs)
                return behaviour(MethodType(original, instance), instance, args[1:], kwargs)
            if (len(args), *kwargs) not in shapes if kwargs else len(args) not in shapes:
                return function(*args, **kwargs)
            call = Call(zip(positional, args))
            if kwargs:  # no empty dict made or merged where there are none
                call.update(kwargs)
            call.args, call.kwargs, call._binding = args[1:], kwargs, binding
            return behaviour(MethodType(original, instance), instance, call)
        except Refusal as exc:
            return _counted(name, exc)

    entry_point = kept if method and decided is not None else function
    if inspect.iscoroutinefunction(original) or inspect.iscoroutinefunction(behaviour):
        async def coroutine(*args: Any, **kwargs: Any) -> Any:
            try:
                return await entry_point(*args, **kwargs)
            except Refusal as exc:
                return _counted(name, exc)

        return coroutine

    return entry_point


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
