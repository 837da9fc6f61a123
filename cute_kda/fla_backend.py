"""cute_kda as a backend of flash-linear-attention's ``fla.ops.kda.chunk_kda``.

FLA dispatches ``chunk_kda`` through its own backend registry (``fla.backends``; FlashKDA's backend
uses the same mechanism): each registered backend is asked, in priority order, whether it takes a
call (its verifier), and the first that does computes it; otherwise FLA's Triton kernels run. This
module registers :class:`CuteKDABackend` there:

- **priority 2**, ahead of FlashKDA's 3 (FLA runs lower numbers first);
- **verifier** :func:`verify` accepts exactly the calls ``cute_kda.chunk_kda`` computes, inference and
  training alike (inputs that require grad get cute_kda's backward, :mod:`cute_kda.executors.training`): it runs
  the same argument translation and input checks the call would (no kernel), on a CUDA device of
  compute capability 9.x (the kernels are built for sm_90a); what it refuses FLA computes itself.
  Every distinct reason is logged once at INFO on the ``cute_kda.fla_backend`` logger (FLA also logs
  its first one);
- **opt-out** ``FLA_CUTE_KDA=0`` (read by FLA on every call).

The same backend serves FLA's ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (GatedDeltaNet) through
FLA's ``gated_delta_rule`` registry, inference and training: its verifier :func:`verify_gdn` accepts what
``cute_kda.chunk_gated_delta_rule`` computes. There it runs at **priority 4**: behind FlashQLA's 3 (Qwen's TileLang kernels, which we
have not measured against), ahead of FLA's own Triton kernels.

FLA's decode kernel ``fla.ops.kda.fused_recurrent_kda_fwd`` (the one ``fla.ops.kda.fused_recurrent_kda`` and FLA's
KDA layer in decode mode call, and the one engines call with a state pool) dispatches through FLA's operation registry
``kda``: the backend joins it at **priority 2** with :func:`verify_fused_recurrent`, which accepts what
:func:`cute_kda.serving.fla_fwd_call` translates (the decode kernel: bf16 tokens, head size 128, the pool contract of
:mod:`cute_kda.serving`) on a compute capability 9.x device. FLA 0.6.0 does not dispatch GatedDeltaNet's
``fused_recurrent_gated_delta_rule`` (it is a plain function, no registry), so nothing is registered for it; call
``cute_kda.fused_recurrent_gated_delta_rule`` directly.

Registration happens on ``import cute_kda`` when FLA is installed: at once for each of ``fla.ops.kda`` and
``fla.ops.gated_delta_rule`` that is already imported, otherwise right after it is (a one-shot import hook
per module; importing cute_kda does not import FLA). :func:`register` and :func:`register_gdn` do it
explicitly. FLA stays optional: without it nothing happens.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)

BACKEND_TYPE = "cute_kda"
ENV_VAR = "FLA_CUTE_KDA"
PRIORITY = 2  # FLA: lower values run first; FlashKDA registers 3
GDN_PRIORITY = 4  # behind FlashQLA's 3 for chunk_gated_delta_rule, ahead of FLA's Triton kernels
FLA_MODULE = "fla.ops.kda"
FLA_GDN_MODULE = "fla.ops.gated_delta_rule"
_MAX_LOGGED_REASONS = 64

_state = threading.local()
_logged_reasons: set[str] = set()
_registered: set[str] = set()  # the FLA functions cute_kda is registered for


# ---------------------------------------------------------------------------------------------
# the verifier and the implementation (plain functions of FLA's chunk_kda arguments)


def _device_reason(q: Any) -> str | None:
    """Why the kernels cannot run on ``q``'s device, or None."""
    import torch

    if not isinstance(q, torch.Tensor):
        return f"q must be a torch tensor, got {type(q).__name__}"
    return _device_rule(q.device)


def _device_rule(device: Any) -> str | None:
    import torch

    if device.type != "cuda":
        return f"q is on {device}; cute_kda's kernels run on CUDA devices"
    from .device import unsupported_reason

    return unsupported_reason(device.index if device.index is not None else torch.cuda.current_device())


def _call_key(args: tuple, kwargs: dict) -> tuple:
    """Identity of one call's tensors, to hand the verifier's translation to the implementation."""
    return tuple(id(x) for x in args) + tuple((name, id(value)) for name, value in sorted(kwargs.items()))


def _verify(args: tuple, kwargs: dict, entry_point: str, translate: Callable[..., Any],
            checked: Callable[[Any], dict]) -> tuple[bool, str | None]:
    """The verdict on one FLA call: the device rule, ``translate(*args, **kwargs)`` (a canonical call), the input
    checks on ``checked(call)`` (``validate_forward``'s keywords) and, for a call autograd records, the backward's
    coverage. An accepted call's translation is kept for the implementation (:func:`_pending_call`)."""
    from . import validation


    def checked_call() -> Any:
        call = translate(*args, **kwargs)
        options = checked(call)
        validation.validate_forward(*call.tensors, **options)
        if validation.needs_autograd(*call.tensors, options["A_log"], options["dt_bias"], options["initial_state"]):
            q, _, v, _, _ = call.tensors
            validation.check_trainable(options["gate"], q, v)
        return call

    return _verdict(args, kwargs, entry_point, _bind(args, kwargs).get("q"), checked_call)


def _verdict(args: tuple, kwargs: dict, entry_point: str, q: Any, build: Callable[[], Any]) -> tuple[bool, str | None]:
    """The device rule on ``q``, then ``build()`` (the checked translation, raising what cute_kda does not take); an
    accepted call's translation is kept for the implementation (:func:`_pending_call`), a refusal logged once."""
    _state.pending = None
    reason = _device_reason(q)
    if reason is None:
        try:
            call = build()
        except (TypeError, ValueError, NotImplementedError) as error:
            reason = f"{type(error).__name__}: {error}"
    if reason is not None:
        _log_once(reason, entry_point)
        return False, reason
    _state.pending = (_call_key(args, kwargs), call)
    return True, None


def _pending_call(args: tuple, kwargs: dict, call_type: type, translate: Callable[..., Any]) -> Any:
    """The translation the verifier made for this very call (a ``call_type``), else a fresh one."""
    pending, _state.pending = getattr(_state, "pending", None), None
    if pending is not None and pending[0] == _call_key(args, kwargs) and isinstance(pending[1], call_type):
        return pending[1]
    return translate(*args, **kwargs)


_CHECKED = ("A_log", "dt_bias", "lower_bound", "scale", "initial_state", "cu_seqlens", "gate")


def verify(*args: Any, **kwargs: Any) -> tuple[bool, str | None]:
    """(True, None) if cute_kda computes this FLA ``chunk_kda`` call, else (False, the reason)."""
    from . import api

    return _verify(args, kwargs, "fla.ops.kda.chunk_kda", api.translate_fla_call,
                   lambda call: {name: call.options[name] for name in _CHECKED})


def chunk_kda(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Compute an accepted FLA ``chunk_kda`` call (the translation :func:`verify` made, when it is
    this call's)."""
    from . import api
    from .fla_calls import CanonicalCall

    call = _pending_call(args, kwargs, CanonicalCall, api.translate_fla_call)
    if call.chunk_states:  # return_intermediate_states: (o, final state, h), as api.chunk_kda returns them
        return api.run_with_chunk_states(call)
    return call.run(functools.partial(api.kda_forward, recompute=call.recompute))


def verify_gdn(*args: Any, **kwargs: Any) -> tuple[bool, str | None]:
    """(True, None) if cute_kda computes this FLA ``chunk_gated_delta_rule`` call, else (False, the reason)."""
    from . import api

    def checked(call: Any) -> dict:  # no lower bound
        return {**{name: call.options.get(name) for name in _CHECKED}, "lower_bound": -5.0}

    return _verify(args, kwargs, "fla.ops.gated_delta_rule.chunk_gated_delta_rule", api.translate_fla_gdn_call,
                   checked)


def chunk_gated_delta_rule(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Compute an accepted FLA ``chunk_gated_delta_rule`` call (the translation :func:`verify_gdn` made, when
    it is this call's)."""
    from . import api
    from .fla_calls import GdnCall

    call = _pending_call(args, kwargs, GdnCall, api.translate_fla_gdn_call)
    return call.run(functools.partial(api.kda_forward, recompute=call.recompute))


def verify_fused_recurrent(*args: Any, **kwargs: Any) -> tuple[bool, str | None]:
    """(True, None) if cute_kda computes this FLA ``fused_recurrent_kda_fwd`` call, else (False, the reason)."""
    from . import serving

    return _verdict(args, kwargs, "fla.ops.kda.fused_recurrent_kda_fwd", _bind_fwd(args, kwargs).get("q"),
                    lambda: serving.fla_fwd_call(*args, **kwargs))


def fused_recurrent_kda_fwd(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Compute an accepted FLA ``fused_recurrent_kda_fwd`` call (the translation :func:`verify_fused_recurrent`
    made, when it is this call's)."""
    from . import serving

    return _pending_call(args, kwargs, serving.PoolCall, serving.fla_fwd_call).run()


_FLA_POSITIONAL = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state")
_FLA_FWD_POSITIONAL = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "scale")


def _bind_fwd(args: tuple, kwargs: dict) -> dict:
    bound = dict(zip(_FLA_FWD_POSITIONAL, args))
    bound.update(kwargs)
    return bound


def _bind(args: tuple, kwargs: dict) -> dict:
    bound = dict(zip(_FLA_POSITIONAL, args))
    bound.update(kwargs)
    return bound


def _log_once(reason: str, entry_point: str) -> None:
    key = f"{entry_point}: {reason}"
    if key in _logged_reasons or len(_logged_reasons) >= _MAX_LOGGED_REASONS:
        return
    _logged_reasons.add(key)
    logger.info("cute_kda does not take this %s call (FLA computes it): %s", entry_point, reason)


# ---------------------------------------------------------------------------------------------
# registration with fla.backends


def backend_class(base: type, priority: int = PRIORITY) -> type:
    """The backend class on FLA's ``BaseBackend`` (built here so FLA is imported only when present), at
    ``priority`` in the registry it joins. FLA looks up ``<function>_verifier`` and ``<function>`` by the name
    of the dispatched function, so one class serves ``chunk_kda``, ``chunk_gated_delta_rule`` and
    ``fused_recurrent_kda_fwd`` (in the ``kda`` registry it is asked about FLA's other dispatched functions too:
    without a method of that name it is skipped)."""

    class CuteKDABackend(base):  # type: ignore[misc, valid-type]
        """cute_kda's CuTe DSL kernels for Hopper; ``FLA_CUTE_KDA=0`` disables it."""

        backend_type = BACKEND_TYPE
        package_name = "cute_kda"
        env_var = ENV_VAR
        default_enable = True

        def chunk_kda_verifier(self, *args: Any, **kwargs: Any) -> tuple[bool, str | None]:
            return verify(*args, **kwargs)

        def chunk_kda(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            return chunk_kda(*args, **kwargs)

        def chunk_gated_delta_rule_verifier(self, *args: Any, **kwargs: Any) -> tuple[bool, str | None]:
            return verify_gdn(*args, **kwargs)

        def chunk_gated_delta_rule(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            return chunk_gated_delta_rule(*args, **kwargs)

        def fused_recurrent_kda_fwd_verifier(self, *args: Any, **kwargs: Any) -> tuple[bool, str | None]:
            return verify_fused_recurrent(*args, **kwargs)

        def fused_recurrent_kda_fwd(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            return fused_recurrent_kda_fwd(*args, **kwargs)

    CuteKDABackend.priority = priority
    return CuteKDABackend


def _register(function: str, entry_point: Callable[[], Any], priority: int) -> bool:
    """Register the backend for FLA's ``function`` at ``priority``; ``entry_point()`` (imports FLA) is what
    ``fla.backends.register`` takes. False if FLA is missing."""
    try:
        from fla.backends import BaseBackend
        from fla.backends import register as fla_register

        target = entry_point()
    except ImportError as error:
        logger.debug("FLA is not importable (%s); cute_kda is not registered as its backend", error)
        return False
    fla_register(target)(backend_class(BaseBackend, priority))
    _registered.add(function)
    logger.info("cute_kda registered as an FLA %s backend (priority %d; %s=0 disables it)", function, priority,
                ENV_VAR)
    return True


def register() -> bool:
    """Register cute_kda with FLA's ``chunk_kda`` registry and its ``kda`` operation registry (which dispatches
    ``fused_recurrent_kda_fwd``); imports FLA. False if FLA is missing."""
    return (_register("chunk_kda", lambda: importlib.import_module(FLA_MODULE).chunk_kda, PRIORITY)
            and _register("fused_recurrent_kda_fwd", lambda: "kda", PRIORITY))


def register_gdn() -> bool:
    """Register cute_kda with FLA's ``gated_delta_rule`` registry (imports FLA). False if FLA is missing."""
    return _register("chunk_gated_delta_rule", lambda: "gated_delta_rule", GDN_PRIORITY)


def is_registered() -> bool:
    return "chunk_kda" in _registered


_REGISTRATIONS = {FLA_MODULE: register, FLA_GDN_MODULE: register_gdn}  # FLA module → what registers with it


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when a module of :data:`_REGISTRATIONS` not yet seen is being imported, wraps
    its loader so that its registration runs right after the module has executed; leaves ``sys.meta_path``
    once every one has been seen."""

    def __init__(self) -> None:
        self.waiting = set(_REGISTRATIONS)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.waiting:
            return None
        self.waiting.discard(fullname)
        if not self.waiting:
            _remove_hook()
        spec = importlib.util.find_spec(fullname)  # the real finders (this one no longer waits for it)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader, _REGISTRATIONS[fullname])
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, registration: Any) -> None:
        self._loader = loader
        self._registration = registration

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _register_safely(self._registration)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _register_safely(registration: Any) -> None:
    try:
        registration()
    except Exception as error:  # noqa: BLE001 - never break FLA's import
        logger.warning("cute_kda could not register as an FLA backend: %s", error)


_HOOK = _RegisterAfterImport()


def _remove_hook() -> None:
    try:
        sys.meta_path.remove(_HOOK)
    except ValueError:
        pass


def install() -> None:
    """Register with each FLA module of :data:`_REGISTRATIONS` now if it is imported, else as soon as it is
    (called by ``import cute_kda``)."""
    for module, registration in _REGISTRATIONS.items():
        if module in sys.modules:
            _HOOK.waiting.discard(module)
            _register_safely(registration)
    if _HOOK.waiting and _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
