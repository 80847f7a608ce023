"""How a fastdl op is defined: one schema string, used twice.

``fastdl::<op>``      the public op: schema, fake kernel, autograd, autocast rule, and one dispatch kernel
                      (CompositeExplicitAutograd, so every device) that routes to the backend chosen by
                      ``fastdl.backends`` for the device of the inputs.
``fastdl_cpp::<op>``  the same schema, implemented by the compiled extension with TORCH_LIBRARY_IMPL for CPU
                      and CUDA (csrc/). No C++ file defines a schema.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import forward_ad as _forward_ad

from .. import backends

LIB = torch.library.Library("fastdl", "DEF")
CPP_LIB = torch.library.Library("fastdl_cpp", "FRAGMENT")

SCHEMAS: dict[str, str] = {}
_OPS: dict[str, Op] = {}  # name -> the Op that define() made (register_autocast_rule gives it its cast rule)


# Argument errors: one exception type per kind of mistake, the same on every backend (the Python checks below run
# for the torch and triton backends and in the fake kernels; the C++ kernels raise the same types). PyTorch's own
# conventions (c10/util/Exception.h, torch._check_type / torch._check_value):
#   wrong dtype or kind of tensor (layout, quantized), unsupported dtype argument  TypeError     TORCH_CHECK_TYPE
#   wrong shape, size, rank, or any other value (activation name, offsets, ...)   ValueError    TORCH_CHECK_VALUE
#   wrong device, or tensors on different devices                                  RuntimeError  TORCH_CHECK
# (the last as PyTorch's own "Expected all tensors to be on the same device"). Every message names the op, the
# argument and the expected value, and says what it got.
def require(cond, message: Callable[[], str], exc: type[Exception] = ValueError) -> None:
    """Argument check for the op wrappers, fakes and references: ``raise exc(message())`` unless ``cond``.
    The default is the ValueError of a wrong shape or value.

    A plain ``if`` (rather than ``torch._check``) costs ~0.3 us: the checks run on every call of every op."""
    if not cond:
        raise exc(message())


def require_dtype(cond, message: Callable[[], str]) -> None:
    """A dtype check: TypeError (``TORCH_CHECK_TYPE`` in C++)."""
    if not cond:
        raise TypeError(message())


def require_device(cond, message: Callable[[], str]) -> None:
    """A device check: RuntimeError (``TORCH_CHECK`` in C++)."""
    if not cond:
        raise RuntimeError(message())


def _recheck(check: Callable, args) -> None:
    """Run ``check`` after a C++ kernel raised; its argument error replaces the C++ one."""
    try:
        check(*args)
    except (TypeError, ValueError, RuntimeError) as err:
        raise err from None


def _device_type(args) -> str:
    a = args[0] if args else None
    if isinstance(a, torch.Tensor):  # the first argument, in every op but loader_fill
        return "cpu" if a.is_cpu else a.device.type  # is_cpu: 0.13 us, .device.type: 0.73 us (a device object)
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    return b.device.type
    return "cpu"


def _load_triton(path: str) -> Callable:
    """Resolve 'module:function' under fastdl.kernels lazily (importing triton is not free)."""
    cache: dict = {}

    def call(*args):
        fn = cache.get("fn")
        if fn is None:
            import importlib

            mod_name, fn_name = path.split(":")
            fn = cache["fn"] = getattr(importlib.import_module(f"fastdl.kernels.{mod_name}"), fn_name)
        return fn(*args)

    return call


_PARAMETER = torch.nn.Parameter
_PLAIN_ARGS = frozenset((str, bool, int, float))


def _tensor_state(args, grad: bool) -> int:
    """0: every tensor argument is a plain tensor (or Parameter) and none needs a gradient; 1: plain tensors, some
    need a gradient (``grad`` is whether grad mode is on); 2: a tensor subclass is among them (the dispatcher's job)."""
    state = 0
    for a in args:
        t = type(a)
        if t is torch.Tensor or t is _PARAMETER:
            if grad and a.requires_grad:
                state = 1
        elif a is None or t in _PLAIN_ARGS:  # first: in most ops half of the arguments (~0.4 us of 1.4 us in 6)
            continue
        elif t is list or t is tuple:
            sub = _tensor_state(a, grad)
            if sub == 2:
                return 2
            state |= sub
        elif isinstance(a, torch.Tensor):
            return 2
    return state


def _plain_tensors(args) -> bool:
    """True when every tensor argument is a plain tensor (or Parameter) that needs no gradient."""
    return _tensor_state(args, torch.is_grad_enabled()) == 0


def _in_mode() -> bool:
    """torch.compile tracing, a dispatch or torch-function mode, a torch.func transform (vmap, grad, ...): the calls
    that need the dispatcher. (Autocast alone does not: ``Op`` applies the op's autocast rule itself.)"""
    return (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._are_functorch_transforms_active()
    )


def _has_tangent(args) -> bool:
    """Whether a tensor argument carries a forward-AD tangent (only asked while a dual level is open)."""
    for a in args:
        if isinstance(a, torch.Tensor) and _forward_ad.unpack_dual(a).tangent is not None:
            return True
    return False


def _wants_differentiable(args) -> bool:
    """A call that the op's compiled kernels cannot differentiate: under a torch.func transform (grad, jvp, vjp,
    jacrev, jacfwd, vmap, ...) or with a forward-AD tangent on an argument (``torch.autograd.forward_ad``).
    torch.compile traces the op itself (its fake kernel and registered autograd), so not while compiling."""
    if torch._C._are_functorch_transforms_active():
        return not torch.compiler.is_compiling()
    return _forward_ad._current_level >= 0 and _has_tangent(args)


_AUTOCAST_KEYS = {
    "cpu": torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU),
    "cuda": torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA),
}


class Op:
    """A fastdl op as the Python wrappers call it.

    It is ``torch.ops.fastdl.<name>`` whenever the dispatcher has work to do (torch.compile, fake or other tensor
    modes and subclasses). A plain eager call on plain tensors skips the trips through the dispatcher into Python
    (under autocast too: ``Op`` applies the op's autocast rule itself):
      * no gradient needed: the backend router is called directly (~10 us per call: measured 26 -> 15 us for
        fused_linear on tiny inputs, which is what decides M = 1 inference);
      * a gradient needed: a ``torch.autograd.Function`` built from the op's own ``setup_context`` and ``backward``
        (``register_autograd`` below) runs the router. The same formulas as the op's registered autograd, without
        the generic wrapper of ``torch.library`` (default filling, pytree, a redispatch). fused_linear at M = 1,
        K = N = 64 with a gradient, median thread CPU time on the 2-core Zen 4 (loaded by other processes, so the
        absolute numbers are high): forward 60 -> 30 us, forward + backward 278 -> 208 us. Ops defined with
        ``cpp_autograd=True`` skip the Python Function too when the C++ backend runs: the extension's Autograd
        kernel records the graph and its backward calls the backward op, all in C++.

    Under torch.func transforms (grad, jvp, vjp, jacrev, jacfwd, vmap, ...) and forward-mode AD (a tangent on an
    argument, ``torch.autograd.forward_ad``) a fastdl op runs its PyTorch reference instead (the ``differentiable``
    form given to ``register_autograd``: the op's value, with the op's documented derivative - straight-through
    estimators included - written in differentiable torch ops): correct for every transform, no fastdl kernel.
    Costs the plain path one comparison (no dual level open). ``torch.ops.fastdl.<name>`` called directly does the
    same (its Autograd kernel routes such calls to the same function). Double backward (``create_graph=True``) runs
    the op's ``double_backward`` formulas (``register_autograd``); first-order backward keeps the fast kernels.
    Attributes (``.default``, ...) are the op packet's.
    """

    def __init__(self, packet, route: Callable):
        self._packet = packet
        self._route = route
        self._function = None
        self._grad_route = None  # define(cpp_autograd=True): a call that needs a gradient (C++ autograd or Function)
        self._autocast_cast = None  # the op's autocast rule (register_autocast_rule)
        self._reference = None  # define(): the op's pure-PyTorch reference
        self._differentiable = None  # register_autograd: the forward in differentiable torch ops (transforms, fwd AD)

    def __getattr__(self, attr):
        return getattr(self._packet, attr)

    def __call__(self, *args):
        if _in_mode():
            return self._call_mode(args)
        if _forward_ad._current_level >= 0 and self._differentiable is not None and _has_tangent(args):
            return self._call_differentiable(args)
        if torch._C._is_any_autocast_enabled():
            return self._call_autocast(args)
        return self._call_plain(args)

    def _call_mode(self, args):
        if self._differentiable is not None and _wants_differentiable(args):
            return self._call_differentiable(args)
        return self._packet(*args)

    def _call_differentiable(self, args):
        """The op's differentiable PyTorch form (torch.func transforms, forward AD), under autocast with the op's cast
        rule applied and autocast off (as the dispatcher's Autocast kernel does), so its value is the op's."""
        if torch._C._is_any_autocast_enabled():
            device = _device_type(args)
            if self._autocast_cast is not None and device in _AUTOCAST_KEYS and torch.is_autocast_enabled(device):
                args = self._autocast_cast(args, torch.get_autocast_dtype(device))
                with torch.autocast(device, enabled=False):
                    return self._differentiable(*args)
        return self._differentiable(*args)

    def _call_plain(self, args):
        state = _tensor_state(args, torch.is_grad_enabled())
        if state == 0:
            return self._route(*args)
        if state == 1 and self._grad_route is not None:
            return self._grad_route(*args)
        if state == 1 and self._function is not None:
            return self._function.apply(*args)
        return self._packet(*args)

    def _call_autocast(self, args):
        """Under autocast: what the dispatcher's Autocast kernel (register_autocast_rule) does - the op's cast rule,
        then the op with autocast off for the device - without the trips through the dispatcher into Python, which
        cost a training step 63 us (fused_linear, M = 64, K = 64, N = 512 on the Zen 2: 675 -> 612 us)."""
        device = _device_type(args)
        keys = _AUTOCAST_KEYS.get(device)
        if self._autocast_cast is None or keys is None or not torch.is_autocast_enabled(device):
            return self._packet(*args)  # no rule of ours, or autocast is on only for another device
        args = self._autocast_cast(args, torch.get_autocast_dtype(device))
        with torch._C._ExcludeDispatchKeyGuard(keys):
            return self._call_plain(args)


def register_autograd(
    op: Op,
    backward: Callable,
    setup_context: Callable,
    *,
    double_backward: Callable,
    differentiable: Callable | None = None,
) -> None:
    """The op's autograd, for every way it is called.

    ``backward(ctx, *grads)`` is the first-order backward (the fast kernels); ``double_backward(ctx, *grads)`` gives
    the same gradients written in differentiable torch ops, and runs instead when the backward is itself recorded
    (``create_graph=True``: grad mode is on inside backward - gradient penalties, Hessian-vector products, double
    backward). ``grad_of`` below writes it from the differentiable forward; a ``backward`` that is already made of
    differentiable torch ops can be its own ``double_backward``. ``setup_context`` saves what both need.
    ``differentiable(*args)`` is the op's forward in differentiable torch ops (default: the op's reference): its value
    is the op's, its derivative the one the op documents (straight-through estimators included); it serves calls
    under torch.func transforms and forward-mode AD (``Op``), which no autograd.Function with kernels inside can.

    Registered as the Autograd kernel of ``fastdl::<op>`` (the dispatcher's path: torch.compile, modes, subclasses,
    direct ``torch.ops.fastdl`` calls; it is ``torch.library.register_autograd``'s kernel, with the calls above sent
    to ``differentiable``) and as a ``torch.autograd.Function`` for the eager calls of ``Op`` that need a gradient.
    """
    op._differentiable = differentiable = differentiable or op._reference

    def backward_any_order(ctx, *grads):
        if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable themselves
            return double_backward(ctx, *grads)
        return backward(ctx, *grads)

    packet = op._packet
    torch_kernel = None
    try:  # torch.library.register_autograd's own kernel (torch >= 2.4), to put the transforms in front of it
        from torch._library.autograd import Info, make_autograd_impl

        torch_kernel = make_autograd_impl(packet.default, Info(backward_any_order, setup_context))
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - a torch without them
        torch.library.register_autograd(packet._qualified_op_name, backward_any_order, setup_context=setup_context)
    if torch_kernel is not None:

        def autograd_kernel(keyset, *args):
            if _wants_differentiable(args):  # torch.ops.fastdl.<name> under a transform / forward AD
                return differentiable(*args)  # (an Autocast kernel before this one has cast the arguments)
            return torch_kernel(keyset, *args)

        LIB.impl(packet._qualified_op_name.split("::")[1], autograd_kernel, "Autograd", with_keyset=True)

    route = op._route

    def forward(ctx, *args):
        out = route(*args)
        setup_context(ctx, args, out)
        return out

    op._function = type(
        f"{packet.__name__}_eager",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward_any_order)},
    )


def grad_of(fn: Callable, args: tuple, needs, grads: tuple) -> tuple:
    """The gradients of ``fn(*args)`` for the output gradients ``grads`` (one per output; None: that output got
    none) with respect to the tensor arguments flagged in ``needs`` (None for the others), as a differentiable graph
    (``create_graph=True``): an op's ``double_backward`` from its differentiable forward, recomputed on the inputs
    ``setup_context`` saved. Costs a forward of the reference: only backward passes that are recorded run it."""
    result: list = [None] * len(args)
    wanted = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i < len(needs) and needs[i]]
    if not wanted:
        return tuple(result)
    with torch.enable_grad():
        if torch._C._is_any_autocast_enabled():  # a backward run inside an autocast region: the op's dtypes, as saved
            with torch.autocast(_device_type(args), enabled=False):
                outputs = fn(*args)
        else:
            outputs = fn(*args)
    if isinstance(outputs, torch.Tensor):
        outputs = (outputs,)
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    if not pairs:
        return tuple(result)
    got = torch.autograd.grad(
        [o for o, _ in pairs],
        [args[i] for i in wanted],
        [g for _, g in pairs],
        create_graph=True,
        allow_unused=True,
    )
    for i, g in zip(wanted, got):
        result[i] = g
    return tuple(result)


CPU_ORDER = ("cpp", "torch")  # every op's auto order on the CPU: the extension's kernel, else the reference


def define(
    name: str,
    schema: str,
    *,
    reference: Callable,
    fake: Callable,
    cuda: tuple[str, ...] = ("torch",),
    triton: str | None = None,
    supports: Callable | None = None,
    check: Callable | None = None,
    cpp_autograd: bool = False,
    prefer: dict[str, tuple[str, ...]] | None = None,
) -> Op:
    """Define ``fastdl::name`` and ``fastdl_cpp::name`` from one schema and route calls between backends.

    ``cuda``: the backends to try in ``auto`` mode on CUDA, best first; on the CPU every op tries ``CPU_ORDER``
    (the extension, then the PyTorch reference). ``prefer`` (rarely needed) replaces both: a map from device type to
    that order. ``triton`` names the launcher as 'module:function' in fastdl.kernels. ``supports(backend, args)``
    returns None when the backend can take these inputs, else the reason it cannot (the auto choice then moves on).
    ``check(*args)`` validates the arguments before any backend runs, so every backend reports bad input with the
    same message.
    ``cpp_autograd``: the extension registers an Autograd kernel for ``fastdl_cpp::name`` (csrc/<name>_autograd.cpp,
    the same formulas as the Python ``register_autograd``): eager calls that need a gradient and run the C++ backend
    call it directly, with no Python in their forward or backward.
    """
    SCHEMAS[name] = schema
    LIB.define(name + schema)
    CPP_LIB.define(name + schema)
    triton_impl = _load_triton(triton) if triton else None
    if prefer is None:
        prefer = {"cpu": CPU_ORDER, "cuda": tuple(cuda)}
    backends.register_op(name, prefer, triton_impl=triton_impl, supports=supports)

    cpp_op = getattr(torch.ops.fastdl_cpp, name).default  # the overload: ~2 us less per call than the packet

    def call_cpp(args):
        # the C++ kernels check every argument themselves, so the Python checks are skipped (~5 us per call, which
        # matters at M = 1). When a C++ kernel raises, the Python check runs: a bad argument is reported with the
        # type and message of every other backend (some C++ checks raise RuntimeError for a dtype or a shape); an
        # error that is not about the arguments propagates as raised.
        try:
            return cpp_op(*args)
        except (RuntimeError, TypeError, ValueError, IndexError):
            if check is not None:
                _recheck(check, args)
            raise

    def route(*args):
        device = _device_type(args)
        if device == "meta":  # shapes only (meta-device models): the fake kernel, which reads no data
            if check is not None:
                check(*args)
            return fake(*args)
        backend = backends.select(name, device, args)
        if backend == "cpp":
            return call_cpp(args)
        if check is not None:
            check(*args)
        if backend == "triton":
            return triton_impl(*args)
        return reference(*args)

    LIB.impl(name, route, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fastdl::{name}", fake, lib=LIB)
    op = _OPS[name] = Op(getattr(torch.ops.fastdl, name), route)
    op._reference = reference
    if cpp_autograd:

        def grad_route(*args):
            if _has_cpp_autograd(name) and backends.select(name, _device_type(args), args) == "cpp":
                return call_cpp(args)
            return op._function.apply(*args)  # other backends: the Python formulas (register_autograd)

        op._grad_route = grad_route
    return op


def has_cpp_kernel(name: str, device_type: str) -> bool:
    """True when the compiled extension serves ``fastdl::name`` on ``device_type`` (loaded, and built with that
    kernel), whatever backend the current ``FASTDL_BACKEND`` / ``use_backend`` would pick. Each capability's module
    asks it through its own ``has_cpu_kernel()``: the modules in ``fastdl.nn`` call those, never ``backends``."""
    return backends.available("cpp", name, device_type)[0]


_CPP_AUTOGRAD: dict[str, bool] = {}


def _has_cpp_autograd(name: str) -> bool:
    """Whether the loaded extension registers an Autograd kernel for ``fastdl_cpp::name`` (checked once)."""
    has = _CPP_AUTOGRAD.get(name)
    if has is None:
        has = _CPP_AUTOGRAD[name] = torch._C._dispatch_has_kernel_for_dispatch_key(f"fastdl_cpp::{name}", "Autograd")
    return has


def cast_first_arg(args, dtype):
    """The autocast rule of fastdl's linear ops: cast x (the first argument) to the autocast dtype, leave the rest
    (fp32 master weights, scales, bias) alone; float64 stays float64."""
    x, *rest = args
    if x.is_floating_point() and x.dtype != torch.float64:
        x = x.to(dtype)
    return (x, *rest)


def register_autocast_rule(name: str, cast: Callable = cast_first_arg) -> None:
    """Autocast for ``fastdl::name``: ``cast(args, dtype)`` returns the arguments to call the op with.

    Unlike ``torch.library.register_autocast`` (which casts every float input), fastdl's mixed-precision ops keep
    fp32 master weights and cast only the activations; the kernels round the weight tile by tile.
    """
    op = getattr(torch.ops.fastdl, name).default
    for device_type in ("cpu", "cuda"):
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        key = getattr(torch._C.DispatchKey, key_name)

        def kernel(keyset, *args, _key=key, _device=device_type):
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_key)):
                return op(*cast(args, torch.get_autocast_dtype(_device)))

        LIB.impl(name, kernel, key_name, with_keyset=True)
    _OPS[name]._autocast_cast = cast
