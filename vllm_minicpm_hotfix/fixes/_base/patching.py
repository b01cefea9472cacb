"""Setting a fix's ``PATCHES`` on vLLM's classes as one transaction, the record of what it replaced, the chains two
fixes form on one attribute, and revert.

Every value :func:`set_attributes` puts on a class is recorded with the value it replaced, so a failure half-way
restores the classes exactly as vLLM defined them and :func:`revert_fix` undoes a fix; where the value takes
attributes it is marked with the fix's name (:data:`MARKER_ATTR`), so that a second copy of the package in the same
process (a bundle on PYTHONPATH shadowing a pip install) sees the fix as applied.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from types import ModuleType, SimpleNamespace
from typing import Any

from ...record import current, logger
from . import family
from .wrappers import Patch

#: Attribute that marks a value set by a fix; its value is the fix's NAME.
MARKER_ATTR = "__vllm_minicpm_hotfix__"

_MISSING = object()
#: fix name -> {(owner, attribute): value before the fix set it (``_MISSING`` if the owner itself did not define it)}.
_ORIGINALS: dict[str, dict[tuple[Any, str], Any]] = {}
#: fix name -> the fix module whose PATCHES were applied (what :func:`revert` asks about a model module).
_APPLIED: dict[str, ModuleType] = {}


def resolve(module: ModuleType, target: str, *, imported_only: bool = False) -> tuple[Any, str] | None:
    """``(owner, attribute)`` for one entry of a fix's ``SETS``, or None if the owner does not exist here.
    ``"Class.attr"`` is looked up in ``module`` (the model module); ``"pkg.module:Class.attr"`` in that module, imported
    if importable without error -- with ``imported_only``, only if vLLM already imported it (importing a vLLM module
    vLLM has not needed yet costs a process its import time). Never raises."""
    try:
        if ":" in target:
            mod_name, _, path = target.partition(":")
            if imported_only and mod_name not in sys.modules:
                return None
            owner: Any = importlib.import_module(mod_name)
        else:
            owner, path = module, target
        *owners, attr = path.split(".")
        for part in owners:
            owner = getattr(owner, part)
        return owner, attr
    except Exception:  # noqa: BLE001 - a target that is not there is simply not patched
        return None


def patched_by(owner: Any, attr: str) -> str | None:
    """The NAME of the fix whose value ``owner.attr`` is (defined on ``owner`` itself), or None. Where two fixes wrap
    one attribute the value's own mark names the later; unmarkable values fall back to the record, latest first."""
    value = getattr(owner, "__dict__", {}).get(attr, _MISSING)
    if value is _MISSING:
        return None
    mark = getattr(value, MARKER_ATTR, None)
    if isinstance(mark, str):
        return mark
    for fix, saved in reversed(_ORIGINALS.items()):
        if (owner, attr) in saved:
            return fix
    return None


def is_patched(fix: ModuleType, module: ModuleType) -> bool:
    """Whether any attribute ``fix`` sets is, in ``module``'s classes, a value ``fix`` set (this copy or another)."""
    for target in fix.SETS:
        found = resolve(module, target, imported_only=True)
        if found is not None and patched_by(*found) == fix.NAME:
            return True
    return False


def has_set(fix: str) -> bool:
    """Whether ``fix`` has values in place that :func:`set_attributes` set (applied and not reverted)."""
    return bool(_ORIGINALS.get(fix))


def _set(owner: Any, attr: str, value: Any, undo: list) -> None:
    undo.append((owner, attr, owner.__dict__.get(attr, _MISSING)))
    setattr(owner, attr, value)


def _undo(undo: list) -> None:
    for owner, attr, old in reversed(undo):
        if old is _MISSING:
            if attr in owner.__dict__:
                delattr(owner, attr)
        else:
            setattr(owner, attr, old)


def set_attributes(fix: str, changes: Iterable[tuple[Any, str, Callable[[Any], Any]]]) -> None:
    """Set attributes for ``fix``, all or nothing. ``changes`` yields ``(owner, attribute, make)``; the new value is
    ``make(current value)`` (as ``getattr`` sees it, inherited or not; None if absent), marked with ``fix``. On any
    exception every attribute already set is restored and the exception re-raised. The replaced values are kept for
    :func:`revert_fix`."""
    undo: list = []
    try:
        for owner, attr, make in changes:
            new = make(getattr(owner, attr, None))
            try:
                setattr(new, MARKER_ATTR, fix)
            except (AttributeError, TypeError):  # e.g. a bound method, a builtin: recorded in _ORIGINALS only
                pass
            _set(owner, attr, new, undo)
    except BaseException:
        _undo(undo)
        raise
    saved = _ORIGINALS[fix] = _ORIGINALS.pop(fix, {})  # (re)inserted last: the record is in apply order
    for owner, attr, old in undo:
        saved.setdefault((owner, attr), old)


class OnImport:
    """A ``PATCHES`` value for a ``"pkg.module:Class.attr"`` target in a module vLLM may import after the model module
    (or never): set with the fix's other targets if vLLM has already imported it, else when vLLM imports it (a
    ``wrapt`` post-import hook), if the fix is still applied then. The fix never imports the module itself.
    ``without`` says what vLLM does if the value cannot be set then (the warning line names it)."""

    __slots__ = ("factory", "without")

    def __init__(self, factory: Any, without: str = "vLLM's own code is used") -> None:
        self.factory, self.without = factory, without


def on_import(factory: Any, without: str = "vLLM's own code is used") -> OnImport:
    """``factory`` (a :class:`Patch` or a factory of one) as a target set when vLLM imports its module."""
    return OnImport(factory, without)


def lookup(owner: Any, attr: str) -> Any:
    """``owner.attr`` as wrapt's ``lookup_attribute`` finds it: for a class, the value in the ``__dict__`` of the first
    class of its MRO that defines it (a ``classmethod`` or ``staticmethod`` object, not what it binds to); else
    ``getattr``. None if absent."""
    if isinstance(owner, type):
        for cls in owner.__mro__:
            if attr in vars(cls):
                return vars(cls)[attr]
    return getattr(owner, attr, None)


def _value(fix: Any, factory: Any, owner: Any, attr: str) -> Any:
    """What ``factory`` gives for ``owner.attr`` (:func:`lookup`): a :class:`Patch` built, a factory's result (built
    where it is a Patch), or None (leave the target alone)."""
    old = lookup(owner, attr)
    new = factory if isinstance(factory, Patch) else factory(old, owner)
    return new.build(fix, old, owner, attr) if isinstance(new, Patch) else new


def apply_patches(fix: ModuleType | str, module: ModuleType, patches: dict[str, Any] | None = None) -> list[str]:
    """Set ``fix``'s ``PATCHES`` (``fix`` a fix module; or its NAME and ``patches`` a table) through
    :func:`set_attributes`: all or nothing, each value marked and recorded. Returns the targets set now.

    Per target, in table order: :func:`resolve` finds the owner -- one not there raises ``AttributeError`` and nothing
    is set -- and the value is built (:func:`_value`); None leaves the target as it is. An :class:`OnImport` target
    whose module vLLM has not imported yet is set when vLLM imports it. Raises what building raises."""
    if isinstance(fix, str):
        fix = SimpleNamespace(NAME=fix)
    name = fix.NAME
    table = fix.PATCHES if patches is None else patches
    done: list[str] = []
    later: list[str] = []

    def changes() -> Iterable[tuple[Any, str, Callable[[Any], Any]]]:
        for target, factory in table.items():
            on_later = isinstance(factory, OnImport)
            found = resolve(module, target, imported_only=on_later)
            if found is None:
                if not on_later:
                    raise AttributeError(f"{name}: {target} is not there (model module {module.__name__})")
                later.append(target)
                continue
            new = _value(fix, factory.factory if on_later else factory, *found)
            if new is not None:
                done.append(target)
                yield found[0], found[1], lambda _current, new=new: new

    set_attributes(name, changes())
    if isinstance(fix, ModuleType):
        _APPLIED[name] = fix
    for target in later:
        _set_on_import(fix, target, table[target])
    return done


#: (fix NAME, target) of every :class:`OnImport` target whose post-import hook is registered in this process.
_ON_IMPORT: set[tuple[str, str]] = set()


def _set_on_import(fix: Any, target: str, patch: OnImport) -> None:
    """Register (once per process) the post-import hook that sets ``target`` for ``fix`` when vLLM imports its
    module, if ``fix`` is applied then, the owner is there and the value is not already ``fix``'s. Never raises."""
    name = fix.NAME
    if (name, target) in _ON_IMPORT:
        return
    import wrapt

    _ON_IMPORT.add((name, target))

    def hook(imported: ModuleType) -> None:
        try:
            found = resolve(imported, target, imported_only=True)
            if not has_set(name) or found is None or patched_by(*found) == name:
                return
            new = _value(fix, patch.factory, *found)
            if new is not None:
                set_attributes(name, [(found[0], found[1], lambda _current: new)])
        except Exception as exc:  # noqa: BLE001 - a failure here must not break vLLM's import
            logger.warning("vllm-minicpm-hotfix: %s could not wrap %s (%s); %s", name, target, exc, patch.without,
                           exc_info=True)

    wrapt.register_post_import_hook(hook, target.partition(":")[0])


def _checked(fix: ModuleType, factory: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """A registered fix's factory whose result must be a :class:`Patch` or None: the framework builds what vLLM
    calls, so a fix cannot hand it a function of its own."""

    def factory_of_patch(old: Any, owner: Any) -> Patch | None:
        new = factory(old, owner)
        if new is not None and not isinstance(new, Patch):
            raise TypeError(f"{fix.NAME}: a PATCHES factory returns a Patch (wrap, replace, attribute) or None, not "
                            f"{type(new).__name__}")
        return new

    return factory_of_patch


def complete(fix: ModuleType) -> ModuleType:
    """Give the fix module ``fix`` what its ``PATCHES`` implies: ``SETS`` (the targets, in table order) and
    ``apply(module)`` (:func:`apply_patches` of the table as it is when called). Every value must be a :class:`Patch`, a
    factory ``(vLLM's value, owner) -> Patch | None``, or an :class:`OnImport` of either; raises ``TypeError``
    otherwise. The registry does this for every fix it lists. Returns ``fix``."""
    table = {}
    for target, value in fix.PATCHES.items():
        inner = value.factory if isinstance(value, OnImport) else value
        if not isinstance(inner, Patch) and not callable(inner):
            raise TypeError(f"{fix.NAME}: PATCHES[{target!r}] is {inner!r}, not a Patch or a factory of one")
        if not isinstance(inner, Patch):
            inner = _checked(fix, inner)
        table[target] = OnImport(inner, value.without) if isinstance(value, OnImport) else inner
    fix.PATCHES = table
    fix.SETS = tuple(table)

    def apply(module: ModuleType) -> None:
        apply_patches(fix, module)

    apply.__module__, apply.__qualname__ = fix.__name__, "apply"
    apply.__doc__ = "Set this fix's PATCHES on ``module``'s classes, all or nothing (``_base.apply_patches``)."
    fix.apply = apply
    return fix


def wraps_of(fix: str) -> dict[str, str]:
    """The chains ``fix``'s values are the outer part of in this process: ``"Class.attr"`` -> the NAME of the fix
    whose value ``fix`` replaced (and its wrapper calls) there, read from the record."""
    out = {}
    for (owner, attr), old in _ORIGINALS.get(fix, {}).items():
        inner = getattr(old, MARKER_ATTR, None)
        if isinstance(inner, str) and inner != fix:
            out[f"{getattr(owner, '__qualname__', owner)}.{attr}"] = inner
    return out


def shared_targets(registry: Iterable[ModuleType]) -> dict[str, tuple[str, ...]]:
    """The targets two or more fixes of ``registry`` set: ``"Class.attr"`` -> their NAMEs in registry order, which is
    the order they wrap in (the first wraps vLLM's own method, each later one the one before)."""
    by_target: dict[str, list[str]] = {}
    for fix in registry:
        for target in fix.SETS:
            by_target.setdefault(target, []).append(fix.NAME)
    return {t: tuple(names) for t, names in by_target.items() if len(names) > 1}


def _owner_module(owner: Any) -> str:
    return owner.__name__ if isinstance(owner, ModuleType) else getattr(owner, "__module__", "")


#: Called by :func:`revert_fix` with the fix's NAME, each returning whether it undid anything: the deferred probes
#: (:mod:`.deferred`) register one, so that a fix reverted while it still waits for its first use is never applied.
ON_REVERT: list[Callable[[str], bool]] = []


def _set_for(fix: str, module: ModuleType) -> set[tuple[Any, str]]:
    """The ``(owner, attribute)`` pairs ``fix`` set for the model module ``module``: in ``module``'s own classes, and
    at every target of its ``SETS`` as resolved from ``module`` -- a ``"pkg.module:Class.attr"`` in another module
    too (what :func:`is_patched` looks at)."""
    saved = _ORIGINALS.get(fix, {})
    applied = _APPLIED.get(fix)
    targets = [resolve(module, t, imported_only=True) for t in getattr(applied, "SETS", ())]
    return {k for k in saved if _owner_module(k[0]) == module.__name__} | {t for t in targets if t in saved}


def revert_fix(fix: str, module: ModuleType | None = None) -> bool:
    """Restore what ``fix`` set -- with ``module``, what it set for that model module, wherever it set it (its
    classes, and a target of the fix in another module, :func:`_set_for`): afterwards ``is_patched(fix, module)`` is
    False. Mark its status entry ``reverted``. Where a later fix wrapped this fix's value, the later fix is handed
    this fix's original, so that reverting the later one restores vLLM's own value. A fix still waiting for its
    first use (:mod:`.deferred`) stops waiting. Returns whether anything was set or waited."""
    saved = _ORIGINALS.get(fix, {})
    here = None if module is None else _set_for(fix, module)
    keys = [k for k in saved if here is None or k in here]
    undo = []
    for owner, attr in keys:
        old = saved.pop((owner, attr))
        later = next((s for f, s in _ORIGINALS.items()
                      if f != fix and getattr(s.get((owner, attr)), MARKER_ATTR, None) == fix), None)
        if later is not None:
            later[(owner, attr)] = old
        else:
            undo.append((owner, attr, old))
    _undo(undo)
    family._ACTIVE.pop(fix, None)
    waited = module is None and any([stop(fix) for stop in ON_REVERT])
    if keys or waited:
        entry = current().fixes.get(fix)
        if entry is not None:
            entry.applied, entry.why = False, "reverted"
    return bool(keys) or waited


def revert(module: ModuleType | None = None) -> bool:
    """Restore every attribute any fix set; with ``module``, every fix that set anything in ``module``'s classes or is
    patched as seen from it (one whose ``SETS`` name only other modules, e.g. ``vllm.config.model``), with what the
    same fix set elsewhere. Latest applied first. Returns whether any was set."""
    seen = {name for name, fix in _APPLIED.items() if module is not None and is_patched(fix, module)}
    reverted = False
    for fix, saved in reversed(list(_ORIGINALS.items())):
        if module is None or fix in seen or any(_owner_module(owner) == module.__name__ for owner, _ in saved):
            reverted |= revert_fix(fix)
    return reverted
