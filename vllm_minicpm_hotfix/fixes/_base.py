"""The machinery every fix shares: run one fix (mode, probe, decision, apply, record, one log line), a fix's patch
table applied transactionally, revert.

A *fix* is a module in this package with the same small interface (the idea of ddtrace's one ``patch()`` module per
integration under ``contrib/``, or OpenTelemetry's one ``BaseInstrumentor`` per library, made smaller)::

    NAME: str                        # key in status()["fixes"], doctor, the README table, e.g. "qkv_loader"
    LABEL: str                       # what it fixes, in words, for the one log line
    MODELS: tuple[str, ...]          # the family members it applies to ("MiniCPM-V 4.6", ...); see covers()
    PATCHES: dict[str, Factory]      # target -> factory(original, owner) -> new value (None: not on this release)
    def probe(module) -> Verdict     # behaviour of the installed code; never raises; no version strings
    SETS: tuple[str, ...]            # derived (complete): the PATCHES keys, "Class.attr" / "pkg.module:Class.attr"
    def apply(module) -> None        # derived (complete): apply_patches of PATCHES; what the hook calls
    SCOPE: str                       # optional: the checkpoints it matters for (doctor: unapplied is WARN)
    SCOPE_CHECK: str                 # optional, with SCOPE: the command that checks a checkpoint (default --model)
    DEFER_AT: str                    # optional: probe at the first use of this entry point (_deferred)

``PATCHES`` has one line per target, as ddtrace's ``_w("redis", "Redis.execute_command", wrapper)`` or wrapt's
``wrap_object(module, name, factory)``: :func:`apply_patches` resolves each target (:func:`resolve`), calls its
factory with the value there now and the owner, and sets what it returns, all in one :func:`set_attributes`
transaction. A factory returning None leaves its target alone (a method this release does not have); a target
whose owner is missing raises (nothing is set); :func:`on_import` marks a target in a module vLLM may import later.

Two rules for ``probe``: it judges by running the installed code (vLLM's, transformers') on stand-ins, never by a
version string; and re-run on a module where the fix *is* applied it must answer ``CORRECT`` -- ``doctor`` re-probes
every fix in a fresh vLLM process after the hook ran and reports a fix whose patched code still fails its own probe.

:data:`vllm_minicpm_hotfix.fixes.REGISTRY` lists them in the order the post-import hook runs them (:func:`run` each,
each guarded on its own). Every value :func:`set_attributes` puts on a class is recorded with the value it replaced
(so a failure half-way restores the classes exactly as vLLM defined them, and :func:`revert_fix` undoes a fix) and,
where the value takes attributes, marked with the fix's name (``__vllm_minicpm_hotfix__``), so that a second copy of
the package in the same process (a bundle on PYTHONPATH shadowing a pip install) sees the fix as applied.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import weakref
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from .. import decision
from . import _deferred
from ..record import FixStatus, current, logger

#: Attribute that marks a value set by a fix; its value is the fix's NAME.
MARKER_ATTR = "__vllm_minicpm_hotfix__"

_MISSING = object()
#: fix name -> {(owner, attribute): value before the fix set it (``_MISSING`` if the owner itself did not define it)}.
_ORIGINALS: dict[str, dict[tuple[Any, str], Any]] = {}


# --------------------------------------------------------------------------------------------------------------------
# The model family: which classes a fix applies to
# --------------------------------------------------------------------------------------------------------------------

#: vLLM's model module of each family member -> the member's name in messages. vLLM 0.32+ defines MiniCPM-V 4.7's
#: classes in ``minicpmv4_7.py`` as subclasses of the 4.6 classes, so a wrapper set on a 4.6 class also runs for 4.7
#: instances; a fix acts on an instance only if the member it belongs to is in the fix's ``MODELS``.
FAMILY: dict[str, str] = {
    "vllm.model_executor.models.minicpmv4_6": "MiniCPM-V 4.6",
    "vllm.model_executor.models.minicpmv4_7": "MiniCPM-V 4.7",
}

#: Default ``MODELS`` of a fix that declares none: 4.6 only.
DEFAULT_MODELS: tuple[str, ...] = ("MiniCPM-V 4.6",)


def model_of(obj: Any) -> str | None:
    """The family member (``"MiniCPM-V 4.6"``, ``"MiniCPM-V 4.7"``) that ``obj`` -- a vLLM model, processing info or
    multimodal processor instance, or such a class -- belongs to, judged by the module that defines its *own* class
    (not an ancestor's): a subclass vLLM defines in a module not in :data:`FAMILY` (a future 4.8) is ``None``."""
    cls = obj if isinstance(obj, type) else type(obj)
    return FAMILY.get(getattr(cls, "__module__", ""))


def models_of(fix: ModuleType) -> tuple[str, ...]:
    """The family members ``fix`` declares (its ``MODELS``; :data:`DEFAULT_MODELS` if it declares none)."""
    return tuple(getattr(fix, "MODELS", DEFAULT_MODELS))


#: fix NAME -> the members it acts for in this process (the declared members whose own verdict and the mode chose
#: to apply it, set by :func:`run`); a fix applied outside :func:`run` (a test calling ``apply``) acts for all it
#: declares.
_ACTIVE: dict[str, frozenset[str]] = {}

#: (fix NAME, class) pairs already reported as an undeclared subclass in this process (logged once each).
_REPORTED: set[tuple[str, type]] = set()


def covers(fix: ModuleType | tuple[str, ...], obj: Any) -> bool:
    """Whether ``fix`` (a fix module, or its ``MODELS`` tuple) acts for ``obj`` (an instance or class): ``obj``'s own
    class belongs to a member the fix declares and, for a fix module run by the hook, one it chose to apply to. Its
    wrappers hand every other instance to vLLM's own code. An instance of a class no member owns (a subclass vLLM
    defines in a module not in :data:`FAMILY`) is reported once (status, one WARNING line) by :func:`note_unknown`."""
    member = model_of(obj)
    if isinstance(fix, tuple):
        return member in fix
    if member is None:
        note_unknown(fix, obj)
        return False
    active = _ACTIVE.get(fix.NAME)
    return member in (active if active is not None else models_of(fix))


class WeakMemo:
    """A bounded memo of values computed per request from objects vLLM builds once and keeps (its processors, its
    tokenizer), for the wrappers on the request path. A key names those objects by ``id()``; the entry keeps weak
    references to them and counts only while they are still those very objects, so an id is never taken for a later
    object's and nothing is kept alive. Objects that cannot be weakly referenced are not memoised. Cleared when
    ``limit`` entries are held."""

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self._entries: dict[Any, tuple[tuple[Any, ...], Any]] = {}

    def get(self, key: Any, objects: tuple[Any, ...] = ()) -> Any:
        """The value kept for ``key`` and ``objects``, else None. Raises ``TypeError`` for an unhashable key."""
        hit = self._entries.get(key)
        if hit is None or any(ref() is not obj for ref, obj in zip(hit[0], objects)):
            return None
        return hit[1]

    def put(self, key: Any, objects: tuple[Any, ...], value: Any) -> None:
        """Keep ``value`` (not None) for ``key`` while ``objects`` live."""
        try:
            refs = tuple(weakref.ref(obj) for obj in objects)
        except TypeError:  # not weakly referenceable: not kept
            return
        if len(self._entries) >= self.limit:
            self._entries.clear()
        self._entries[key] = (refs, value)


def binder(original: Callable[..., Any]) -> Callable[..., dict[str, Any]]:
    """A function ``bind(*args, **kwargs) -> {parameter: value}`` for calls of ``original``: the arguments passed,
    by parameter name (defaults not filled in), as ``inspect.signature(original).bind(...).arguments`` gives them,
    and ``TypeError`` where that raises (too many positional arguments, an unknown or repeated keyword, a required
    argument missing). The wrappers read the arguments they act on with it (one request goes through several). For
    a signature of plain and keyword-only parameters (every vLLM method the fixes wrap) the binding is computed
    once here, not per call; any other signature is bound by ``inspect`` on each call."""
    sig = inspect.signature(original)
    params = list(sig.parameters.values())
    if not all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
        def bind_any(*args: Any, **kwargs: Any) -> dict[str, Any]:
            return dict(sig.bind(*args, **kwargs).arguments)

        return bind_any
    positional = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
    names = frozenset(sig.parameters)
    required = frozenset(p.name for p in params if p.default is p.empty)

    def bind(*args: Any, **kwargs: Any) -> dict[str, Any]:
        if len(args) > len(positional):
            raise TypeError(f"{original.__qualname__}: too many positional arguments")
        out = dict(zip(positional, args))
        for key, value in kwargs.items():
            if key not in names or key in out:
                raise TypeError(f"{original.__qualname__}: unexpected or repeated argument {key!r}")
            out[key] = value
        if not required <= out.keys():
            raise TypeError(f"{original.__qualname__}: missing {sorted(required - out.keys())}")
        return out

    return bind


def class_name(cls: type) -> str:
    """``module.QualName`` of a class: the key of an undeclared subclass in ``status()["fixes"][NAME]["models"]``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _undeclared_row(fix: ModuleType, cls: type, base: type) -> dict[str, Any]:
    return {
        "declared": False, "verdict": "n/a", "reason": "", "applied": False, "unknown": True,
        "why": (f"{class_name(cls)} subclasses vLLM's {base.__name__} but is no member of the family this hotfix "
                f"knows ({', '.join(FAMILY.values())}); {fix.NAME} does not cover it: its instances get vLLM's own "
                "code"),
    }


def note_unknown(fix: ModuleType, obj: Any) -> None:
    """Record (in ``status()``, under the fix's ``models``) and log once that ``fix``'s wrapper was reached by an
    instance of a class no family member owns, and handed it to vLLM. Never raises."""
    try:
        cls = obj if isinstance(obj, type) else type(obj)
        if (fix.NAME, cls) in _REPORTED:
            return
        _REPORTED.add((fix.NAME, cls))
        base = next((b for b in cls.__mro__[1:] if b.__module__ in FAMILY), cls)
        row = _undeclared_row(fix, cls, base)
        entry = current().fixes.get(fix.NAME)
        if entry is not None:
            entry.models[class_name(cls)] = row
        logger.warning("vllm-minicpm-hotfix: %s", row["why"])
    except Exception:  # noqa: BLE001 - reporting must never break vLLM's call
        pass


def unknown_subclasses(fix: ModuleType, module: ModuleType) -> dict[str, dict[str, Any]]:
    """Every class defined so far in this process (``__subclasses__``, recursively) that subclasses a class ``fix``
    patches in ``module`` and that no family member owns: ``{module.QualName: status row}``. Never raises."""
    out: dict[str, dict[str, Any]] = {}
    for target in getattr(fix, "SETS", ()):
        found = resolve(module, target, imported_only=True)
        if found is None or not isinstance(found[0], type) or found[0].__module__ not in FAMILY:
            continue
        base = found[0]
        todo = list(base.__subclasses__())
        while todo:
            cls = todo.pop()
            todo.extend(cls.__subclasses__())
            if cls.__module__ not in FAMILY:
                out.setdefault(class_name(cls), _undeclared_row(fix, cls, base))
    return out


def member_modules(module: ModuleType, *, imported_only: bool = False) -> dict[str, ModuleType]:
    """The family members present in this vLLM, each as the module a fix's probe runs on: ``module`` (vLLM's 4.6
    model module) for its own member and, for every other member whose model module exists here
    (``vllm.model_executor.models.minicpmv4_7`` on vLLM 0.32+; imported now if vLLM has not yet), a view of
    ``module`` whose 4.6 classes (``MiniCPMV4_6ProcessingInfo`` ...) are that member's subclasses of them
    (``MiniCPMV4_7ProcessingInfo`` ...; classes the member does not subclass, e.g. the window attention, stay
    4.6's). A probe written against the 4.6 names thereby judges the member's own classes. Never raises: a member
    module that fails to import is left out.

    ``imported_only`` (the post-import hook and first-use probes): only the members whose model module vLLM has
    finished importing in this process (:func:`imported_member`). A process serving 4.6 never imports
    ``minicpmv4_7``, so nothing of 4.7 runs there; a process serving 4.7 imports ``minicpmv4_7``, which imports
    ``minicpmv4_6`` first -- the hook then runs while ``minicpmv4_7`` is still being executed, before its classes
    exist, and the whole hook runs at the end of that import instead
    (:func:`vllm_minicpm_hotfix.hook.on_member_import`)."""
    own = FAMILY.get(module.__name__, DEFAULT_MODELS[0])
    out: dict[str, ModuleType] = {own: module}
    for mod_name, member in FAMILY.items():
        if member in out:
            continue
        other = imported_member(mod_name) if imported_only else _import_member(mod_name)
        if other is not None:
            out[member] = member_view(module, other)
    return out


#: Model modules whose body has run to its end (their post-import hook fired): importlib keeps
#: ``__spec__._initializing`` set until its loader returns, which is after wrapt's post-import hooks ran.
_COMPLETE: set[str] = set()


def mark_complete(mod_name: str) -> None:
    """Record that ``mod_name``'s body has been executed to its end (called from its post-import hook)."""
    _COMPLETE.add(mod_name)


def initialising(mod_name: str) -> bool:
    """Whether ``mod_name`` is in ``sys.modules`` but its body is still being executed (importlib's
    ``__spec__._initializing``, unless :func:`mark_complete` said otherwise): its classes may not exist yet."""
    mod = sys.modules.get(mod_name)
    if mod is None or mod_name in _COMPLETE:
        return False
    return bool(getattr(getattr(mod, "__spec__", None), "_initializing", False))


def imported_member(mod_name: str) -> ModuleType | None:
    """The member model module ``mod_name`` if vLLM has finished importing it in this process, else None (never
    imports anything)."""
    mod = sys.modules.get(mod_name)
    return None if mod is None or initialising(mod_name) else mod


def _import_member(mod_name: str) -> ModuleType | None:
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    try:
        import importlib.util

        if importlib.util.find_spec(mod_name) is None:
            return None
        return importlib.import_module(mod_name)
    except Exception:  # noqa: BLE001 - a member module that does not import is not served by this vLLM anyway
        return None


def member_view(module: ModuleType, other: ModuleType) -> ModuleType:
    """A module named as ``other`` holding everything of ``module``, except that each class of ``module`` that
    ``other`` subclasses (same name with ``other``'s member tag, e.g. ``4_6`` -> ``4_7``) is ``other``'s class."""
    tag = module.__name__.rsplit("minicpmv", 1)[-1]
    other_tag = other.__name__.rsplit("minicpmv", 1)[-1]
    view = ModuleType(other.__name__)
    swapped: dict[str, str] = {}
    view.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    for name, value in vars(module).items():
        if isinstance(value, type) and tag in name:
            sub = getattr(other, name.replace(tag, other_tag), None)
            if isinstance(sub, type) and issubclass(sub, value):
                setattr(view, name, sub)
                swapped[name] = sub.__name__
    view.__member_module__ = other
    view.__member_names__ = swapped
    return view


def member_reason(view: ModuleType, reason: str) -> str:
    """A probe's ``reason`` as it reads for the member ``view`` stands for: the vLLM classes the view swapped named as
    that member's (``MiniCPMV4_6ProcessingInfo`` -> ``MiniCPMV4_7ProcessingInfo``) and "MiniCPM-V 4.6" as the member;
    unchanged for a module that is not a view (transformers' classes a probe names stay as they are)."""
    names = getattr(view, "__member_names__", None)
    if not names:
        return reason
    for old, new in names.items():
        reason = reason.replace(old, new)
    return reason.replace(DEFAULT_MODELS[0], FAMILY.get(view.__name__, DEFAULT_MODELS[0]))


# --------------------------------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------------------------------


def resolve(module: ModuleType, target: str, *, imported_only: bool = False) -> tuple[Any, str] | None:
    """``(owner, attribute)`` for one entry of a fix's ``SETS``, or None if the owner does not exist here.

    ``"Class.attr"`` is looked up in ``module`` (the model module); ``"pkg.module:Class.attr"`` in that module, which
    is imported if it is importable without error -- with ``imported_only``, only if vLLM already imported it (it is
    in ``sys.modules``): nothing in a module not yet imported can have been patched, and importing a vLLM module
    vLLM has not needed yet costs a process its import time (``vllm.multimodal.encoder_budget`` imports the whole
    v1 request and structured-output stack, ~0.5 s of CPU). Never raises.
    """
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
    """The NAME of the fix whose value ``owner.attr`` is (defined on ``owner`` itself), or None."""
    value = getattr(owner, "__dict__", {}).get(attr, _MISSING)
    if value is _MISSING:
        return None
    # Two fixes may wrap the same attribute (the later one wraps the earlier one's value): the value's own mark names
    # the fix that set it last; unmarkable values fall back to the record, latest fix first.
    mark = getattr(value, MARKER_ATTR, None)
    if isinstance(mark, str):
        return mark
    for fix, saved in reversed(_ORIGINALS.items()):
        if (owner, attr) in saved:
            return fix
    return None


def acts_for(fix: ModuleType, cls: type, attr: str) -> bool:
    """Whether ``fix``'s value of ``attr`` runs for instances of ``cls`` and acts for them: some class of ``cls``'s MRO
    holds ``fix``'s value (``cls`` itself, or the 4.6 class a 4.7 override reaches through ``super()``) and ``fix``
    covers ``cls`` (:func:`covers`)."""
    return any(patched_by(c, attr) == fix.NAME for c in getattr(cls, "__mro__", ())) and covers(fix, cls)


def is_patched(fix: ModuleType, module: ModuleType) -> bool:
    """Whether any attribute ``fix`` sets is, in ``module``'s classes, a value ``fix`` set (this copy or another)."""
    for target in fix.SETS:
        found = resolve(module, target, imported_only=True)
        if found is not None and patched_by(*found) == fix.NAME:
            return True
    return False


# --------------------------------------------------------------------------------------------------------------------
# Transactional setting and revert
# --------------------------------------------------------------------------------------------------------------------


def has_set(fix: str) -> bool:
    """Whether ``fix`` has values in place that :func:`set_attributes` set (applied and not reverted)."""
    return bool(_ORIGINALS.get(fix))


def _mark(value: Any, fix: str) -> None:
    try:
        setattr(value, MARKER_ATTR, fix)
    except (AttributeError, TypeError):  # e.g. a bound method, a builtin: recorded in _ORIGINALS only
        pass


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
    """Set attributes for ``fix``, all or nothing.

    ``changes`` yields ``(owner, attribute, make)``; the new value is ``make(current value)`` (the current value as
    ``getattr`` sees it, inherited or not; None if absent). The new value is marked with ``fix``. On any exception
    every attribute already set is restored and the exception re-raised. The replaced values are kept for
    :func:`revert_fix`.
    """
    undo: list = []
    try:
        for owner, attr, make in changes:
            new = make(getattr(owner, attr, None))
            _mark(new, fix)
            _set(owner, attr, new, undo)
    except BaseException:
        _undo(undo)
        raise
    saved = _ORIGINALS[fix] = _ORIGINALS.pop(fix, {})  # (re)inserted last: the record is in apply order
    for owner, attr, old in undo:
        saved.setdefault((owner, attr), old)


# --------------------------------------------------------------------------------------------------------------------
# A fix's patch table
# --------------------------------------------------------------------------------------------------------------------

#: A ``PATCHES`` factory: ``(the value the target has now, inherited or not, None if absent; its owner)`` -> the new
#: value, or None where the target is not to be set on this release.
Factory = Callable[[Any, Any], Any]


class OnImport:
    """A ``PATCHES`` value for a ``"pkg.module:Class.attr"`` target in a module vLLM may import after the model module
    (or never): set with the fix's other targets if vLLM has already imported that module, else when vLLM imports it
    (a ``wrapt`` post-import hook), if the fix is still applied then. The fix never imports the module itself.
    ``without`` says what vLLM does if the wrapper cannot be set then (the warning line names it)."""

    __slots__ = ("factory", "without")

    def __init__(self, factory: Factory, without: str = "vLLM's own code is used") -> None:
        self.factory, self.without = factory, without


def on_import(factory: Factory, without: str = "vLLM's own code is used") -> OnImport:
    """``factory`` as a target set when vLLM imports the target's module (:class:`OnImport`)."""
    return OnImport(factory, without)


def apply_patches(fix: ModuleType | str, module: ModuleType, patches: dict[str, Any] | None = None) -> list[str]:
    """Set ``fix``'s ``PATCHES`` (``fix`` a fix module; or ``fix`` its NAME and ``patches`` a table of that shape) through
    :func:`set_attributes`: all or nothing, each value marked and recorded for :func:`revert_fix`. Returns the targets
    set now.

    Per target, in table order: :func:`resolve` finds the owner (in ``module`` for ``"Class.attr"``; importing
    ``pkg.module`` for ``"pkg.module:Class.attr"``) -- a target whose owner is not there raises ``AttributeError``,
    and nothing is set -- and the factory gets the target's current value and the owner; the value it returns is
    set, and where it returns None the target is left as it is (not on this release). An :class:`OnImport` target
    whose module vLLM has not imported yet is set when vLLM imports it; one whose module is imported but has no such
    owner is left alone. Raises what a factory raises (nothing is set then)."""
    name = fix if isinstance(fix, str) else fix.NAME
    table = fix.PATCHES if patches is None else patches
    done: list[str] = []
    later: list[str] = []

    def changes() -> Iterable[tuple[Any, str, Callable[[Any], Any]]]:
        for target, factory in table.items():
            if isinstance(factory, OnImport):
                found = resolve(module, target, imported_only=True)
                if found is None:
                    later.append(target)
                    continue
                factory = factory.factory
            else:
                found = resolve(module, target)
                if found is None:
                    raise AttributeError(f"{name}: {target} is not there (model module {module.__name__})")
            owner, attr = found
            new = factory(getattr(owner, attr, None), owner)
            if new is not None:
                done.append(target)
                yield owner, attr, lambda _current, new=new: new

    set_attributes(name, changes())
    for target in later:
        _set_on_import(name, target, table[target])
    return done


def complete(fix: ModuleType) -> ModuleType:
    """Give the fix module ``fix`` what its ``PATCHES`` implies, unless it defines them itself: ``SETS`` (the
    targets, in table order) and ``apply(module)`` (:func:`applier`). The registry does this for every fix it lists,
    so a fix module writes its targets once. Returns ``fix``."""
    if hasattr(fix, "PATCHES"):
        if not hasattr(fix, "SETS"):
            fix.SETS = tuple(fix.PATCHES)
        if not hasattr(fix, "apply"):
            fix.apply = applier(fix.__name__)
    return fix


def applier(fix_module: str) -> Callable[[ModuleType], None]:
    """The ``apply(module)`` of the fix module named ``fix_module``: :func:`apply_patches` of its ``PATCHES``,
    looked up at call time (what the hook calls, through ``fix.apply``, and what a test may replace)."""

    def apply(module: ModuleType) -> None:
        apply_patches(sys.modules[fix_module], module)

    apply.__module__, apply.__qualname__ = fix_module, "apply"
    apply.__doc__ = "Set this fix's PATCHES on ``module``'s classes, all or nothing (``_base.apply_patches``)."
    return apply


#: (fix NAME, target) of every :class:`OnImport` target whose post-import hook is registered in this process.
_ON_IMPORT: set[tuple[str, str]] = set()


def _set_on_import(fix: str, target: str, patch: OnImport) -> None:
    """Register (once per process) the post-import hook that sets ``target`` for ``fix`` when vLLM imports its
    module: if ``fix`` is applied then (not reverted since), the owner is there and the value is not already
    ``fix``'s. ``wrapt`` runs the hook at once if the module was imported meanwhile. The hook never raises: a failure
    is logged and vLLM's own value stays."""
    if (fix, target) in _ON_IMPORT:
        return
    import wrapt

    _ON_IMPORT.add((fix, target))

    def hook(imported: ModuleType) -> None:
        try:
            found = resolve(imported, target, imported_only=True)
            if not has_set(fix) or found is None or patched_by(*found) == fix:
                return
            owner, attr = found
            new = patch.factory(getattr(owner, attr, None), owner)
            if new is not None:
                set_attributes(fix, [(owner, attr, lambda _current: new)])
        except Exception as exc:  # noqa: BLE001 - a failure here must not break vLLM's import
            logger.warning("vllm-minicpm-hotfix: %s could not wrap %s (%s); %s", fix, target, exc, patch.without,
                           exc_info=True)

    wrapt.register_post_import_hook(hook, target.partition(":")[0])


def wraps_of(fix: str) -> dict[str, str]:
    """The chains ``fix``'s values are the outer part of in this process: ``"Class.attr"`` -> the NAME of the fix
    whose value ``fix`` replaced (and its wrapper calls) there, read from the values :func:`set_attributes` kept for
    :func:`revert_fix`; empty where ``fix`` set no attribute another fix had set."""
    out = {}
    for (owner, attr), old in _ORIGINALS.get(fix, {}).items():
        inner = getattr(old, MARKER_ATTR, None)
        if isinstance(inner, str) and inner != fix:
            out[f"{getattr(owner, '__qualname__', owner)}.{attr}"] = inner
    return out


def shared_targets(registry: Iterable[ModuleType] | None = None) -> dict[str, tuple[str, ...]]:
    """The targets (``SETS`` entries) two or more fixes set: ``"Class.attr"`` -> their NAMEs in registry order,
    which is the order they wrap in (the first wraps vLLM's own method, each later one the one before; the hook
    applies the registry in order). Derived from the fixes' ``SETS``, so a new fix on an attribute another fix
    already sets shows here, in ``status()`` (``wraps``) and in ``doctor``."""
    if registry is None:
        from . import REGISTRY as registry
    by_target: dict[str, list[str]] = {}
    for fix in registry:
        for target in fix.SETS:
            by_target.setdefault(target, []).append(fix.NAME)
    return {t: tuple(names) for t, names in by_target.items() if len(names) > 1}


def _owner_module(owner: Any) -> str:
    return owner.__name__ if isinstance(owner, ModuleType) else getattr(owner, "__module__", "")


def revert_fix(fix: str, module: ModuleType | None = None) -> bool:
    """Restore what ``fix`` set (in ``module``'s own classes only, if given; attributes set on other modules'
    classes are restored only when ``module`` is None); mark its status entry ``reverted``. Returns whether anything
    was set."""
    saved = _ORIGINALS.get(fix, {})
    keys = [k for k in saved if module is None or _owner_module(k[0]) == module.__name__]
    if keys:
        _deferred.forget(fix)  # a trigger reverted before its first use: nothing left to probe
    undo = []
    for owner, attr in keys:
        old = saved.pop((owner, attr))
        # A later fix wrapped this fix's value (two fixes set one attribute): hand it this fix's original, so that
        # reverting it restores vLLM's own value; the class keeps the later fix's value (which still calls this one's
        # until it is reverted in turn -- revert() undoes the latest first and is exact).
        later = next((s for f, s in _ORIGINALS.items()
                      if f != fix and getattr(s.get((owner, attr)), MARKER_ATTR, None) == fix), None)
        if later is not None:
            later[(owner, attr)] = old
        else:
            undo.append((owner, attr, old))
    _undo(undo)
    _ACTIVE.pop(fix, None)
    if keys:
        entry = current().fixes.get(fix)
        if entry is not None:
            entry.applied, entry.why = False, "reverted"
    return bool(keys)


def revert(module: ModuleType | None = None) -> bool:
    """Restore every attribute any fix set; with ``module``, every fix that set anything in ``module``'s classes,
    including what the same fix set elsewhere (transformers, vLLM's layers), and every registered fix that is patched
    as seen from ``module`` (one whose ``SETS`` name only other modules, e.g. ``vllm.config.model``). Returns whether
    any was set."""
    from . import REGISTRY  # not at import time: this package's __init__ imports this module

    seen = {fix.NAME for fix in REGISTRY if module is not None and is_patched(fix, module)}
    reverted = False
    # Latest applied first: where two fixes wrap the same attribute, the earlier fix's original is the one that stays.
    for fix, saved in reversed(list(_ORIGINALS.items())):
        if module is None or fix in seen or any(_owner_module(owner) == module.__name__ for owner, _ in saved):
            reverted |= revert_fix(fix)
    return reverted


# --------------------------------------------------------------------------------------------------------------------
# Running one fix
# --------------------------------------------------------------------------------------------------------------------


def _short(text: str, limit: int = 300) -> str:
    """``text`` on one line, cut at ``limit`` characters (the full reason is in ``status()`` and ``doctor``)."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def run(fix: ModuleType, module: ModuleType) -> FixStatus:
    """What the post-import hook does for one fix: read the mode; per family member present in this vLLM
    (:func:`member_modules`) that the fix declares, probe that member's classes (not under ``off``) and decide; apply
    if any member needs it (the wrappers then act for exactly those members, :func:`covers`); record the outcome in
    the status record under ``fix.NAME`` (the top-level verdict / reason / why are the 4.6 member's, ``models`` holds
    every member's and every undeclared subclass's) and log its reason at INFO (the hook then logs the one WARNING line of the
    process, :func:`vllm_minicpm_hotfix.record.summary_line`, which also names undeclared subclasses).

    A fix already patched in this process (by this copy of the package or another) is reported as such and left
    alone. Raises only what ``fix.apply`` raises (the hook catches and logs it); the classes are then left exactly as
    they were (:func:`set_attributes` is all or nothing).
    """
    status = current()
    name = fix.NAME
    if is_patched(fix, module):
        entry = status.fixes.get(name) or FixStatus(name, "n/a", "patched before this status record began", True, "")
        entry.applied, entry.why = True, "already patched in this process"
        status.fixes[name] = entry
        return entry
    mode = decision.Mode(status.mode)
    if mode is not decision.Mode.OFF and _deferred.enabled(fix):  # probed at first use of its code path
        deferred = _deferred.defer(fix, module, mode)
        if deferred is not None:
            for member in member_modules(module, imported_only=True):  # one row per member, as decide_and_apply writes
                deferred.models[member] = _pending_row(fix, member, deferred)
            deferred.models.update(unknown_subclasses(fix, module))  # said now, not only at first use
            return deferred
    return decide_and_apply(fix, module, mode)


def _pending_row(fix: ModuleType, member: str, entry: FixStatus) -> dict[str, Any]:
    """The status row of ``member`` for a fix whose probe waits for first use (:mod:`._deferred`)."""
    declared = member in models_of(fix)
    return {"declared": declared, "verdict": entry.verdict if declared else "n/a", "reason": entry.reason,
            "applied": False, "why": entry.why if declared else
            f"{fix.NAME} does not declare {member}: its instances get vLLM's own code"}


def decide_and_apply(fix: ModuleType, module: ModuleType, mode: decision.Mode,
                     entry: FixStatus | None = None) -> FixStatus:
    """Probe ``fix`` per declared family member (not under ``off``), decide, apply for the members that need it,
    record (in ``entry`` if given, else a new :class:`FixStatus`) and log the reason at INFO: the part of
    :func:`run` that a fix deferred to first use (:mod:`._deferred`) runs when its path is first taken. Raises only
    what ``fix.apply`` raises."""
    status = current()
    name = fix.NAME
    declared = models_of(fix)
    own = FAMILY.get(module.__name__, DEFAULT_MODELS[0])
    rows: dict[str, dict[str, Any]] = {}
    choices: dict[str, decision.Decision] = {}
    verdicts: dict[str, decision.Verdict] = {}
    for member, view in member_modules(module, imported_only=True).items():
        if member not in declared:
            rows[member] = {"declared": False, "verdict": "n/a", "reason": "", "applied": False,
                            "why": f"{name} does not declare {member}: its instances get vLLM's own code"}
            continue
        if mode is decision.Mode.OFF:
            verdict = decision.Verdict(decision.State.UNDETERMINED, "not probed (off)")
        else:
            verdict = fix.probe(view)
        verdicts[member], choices[member] = verdict, decision.decide(mode, verdict)
        rows[member] = {"declared": True, "verdict": verdict.state.value, "reason": member_reason(view, verdict.reason),
                        "applied": False, "why": member_reason(view, choices[member].why)}
    verdict = verdicts.get(own) or decision.Verdict(decision.State.UNDETERMINED, f"{name} does not declare {own}")
    chosen = choices.get(own) or decision.decide(decision.Mode.OFF, verdict)
    acting = frozenset(m for m, c in choices.items() if c.apply)
    if entry is None:
        entry = FixStatus(name, verdict.state.value, verdict.reason, False, chosen.why, label=fix.LABEL)
    else:  # a deferred fix resolved at first use: the entry status() already lists, updated in place
        entry.verdict, entry.reason, entry.applied, entry.why = verdict.state.value, verdict.reason, False, chosen.why
    entry.models = rows
    status.fixes[name] = entry
    if acting:
        _ACTIVE[name] = acting
        try:
            fix.apply(module)
        except BaseException:
            _ACTIVE.pop(name, None)
            raise
        entry.applied = True
        entry.wraps = wraps_of(name)
        if not chosen.apply:
            entry.why = f"applied for {', '.join(sorted(acting))} only; {own}: {chosen.why}"
        for member in acting:
            rows[member]["applied"] = True
    # INFO: the hook's one WARNING line per process (record.summary_line) names every fix applied; the reasons are
    # here, shown with VLLM_LOGGING_LEVEL=INFO (and by `doctor`, in full).
    logger.info(
        "vllm-minicpm-hotfix: %s (%s) %s%s: %s", name, fix.LABEL, "PATCHED" if entry.applied else "not applied",
        f" for {' and '.join(sorted(acting))}" if acting else "", _short(entry.why),
    )
    for cls_name, row in unknown_subclasses(fix, module).items():
        rows[cls_name] = row
        logger.info("vllm-minicpm-hotfix: %s", row["why"])
    return entry
