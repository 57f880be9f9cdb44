"""bf16 CPU numerics, fast, on a CPU without native bf16 (developers only).

With this folder on PYTHONPATH every Python process starts with it (Python imports
sitecustomize at start-up): the precision probe answers bf16, as on a CPU with AVX512-BF16 or AMX,
and each bf16 matrix product runs as a native CPU computes it -- bf16 operands, fp32 products
and sums, the result rounded to bf16 -- but in fp32 kernels: torch's own bf16 kernels are ~90x
slower than fp32 on an AVX2-only CPU, so a bf16 run of the demo plan takes days there.

    PYTHONPATH=$PWD/dev/bf16_emulation bash speedrun.sh --no_chat

The products are torch custom ops, opaque to torch.compile: written as casts around an fp32
matmul under autocast disabled, a compiled linear gave other values than the eager one. bf16
attention without gradients (evaluation, decoding) runs in fp32 with a bf16 result (native kernels
also round its probabilities to bf16 before P @ V); attention that trains runs torch's bf16
kernel. Time figures of such a run are not a bf16 CPU's.
Records: dev/LOG.md, 2026-11-30.
"""
import contextlib
import importlib.abc
import importlib.util
import sys

try:
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode
except ImportError:  # launch.py runs on the system Python, before .venv exists
    torch = None

BF16 = torch and torch.bfloat16


def fp32(*tensors):
    return [t.float() for t in tensors]


@contextlib.contextmanager
def plain():
    """Inside an op: no torch function mode, no autocast (it would cast the fp32 operands back
    to bf16 and run torch's slow kernel)."""
    with torch._C.DisableTorchFunction(), torch.autocast("cpu", enabled=False):
        yield


if torch is not None:
    @torch.library.custom_op("bf16_emulation::matmul", mutates_args=())
    def emulated_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with plain():
            return torch.matmul(*fp32(a, b)).to(BF16)

    @emulated_matmul.register_fake
    def _(a, b):
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        return a.new_empty(*batch, a.shape[-2], b.shape[-1])

    def matmul_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def matmul_backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = emulated_matmul(grad, b.mT)
        if ctx.needs_input_grad[1]:
            if b.dim() == 2:  # one product over every row, as a native linear's backward
                grad_b = emulated_matmul(a.reshape(-1, a.shape[-1]).mT,
                                         grad.reshape(-1, grad.shape[-1]))
            elif a.shape[:-2] == b.shape[:-2]:
                grad_b = emulated_matmul(a.mT, grad)
            else:
                raise NotImplementedError(f"bf16 emulation: matmul backward of {tuple(a.shape)} "
                                          f"@ {tuple(b.shape)}")
        return grad_a, grad_b

    emulated_matmul.register_autograd(matmul_backward, setup_context=matmul_setup)

    @torch.library.custom_op("bf16_emulation::baddbmm", mutates_args=())
    def emulated_baddbmm(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float,
                         alpha: float) -> torch.Tensor:
        with plain():
            return torch.baddbmm(*fp32(base, a, b), beta=beta, alpha=alpha).to(BF16)

    @emulated_baddbmm.register_fake
    def _(base, a, b, beta, alpha):
        return a.new_empty(*torch.broadcast_shapes(base.shape, (*a.shape[:-1], b.shape[-1])))

    @torch.library.custom_op("bf16_emulation::attention", mutates_args=())
    def emulated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           is_causal: bool, enable_gqa: bool) -> torch.Tensor:
        with plain():
            return F.scaled_dot_product_attention(*fp32(q, k, v), is_causal=is_causal,
                                                  enable_gqa=enable_gqa).to(BF16)

    @emulated_attention.register_fake
    def _(q, k, v, is_causal, enable_gqa):
        return q.new_empty(*q.shape[:-1], v.shape[-1])

    MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
               torch.Tensor.mm, torch.bmm, torch.Tensor.bmm}
    BADDBMMS = {torch.baddbmm, torch.Tensor.baddbmm}
    # the rest of autocast's CPU bf16 list that a bf16 tensor can reach: not emulated, said once
    UNHANDLED = {torch.addmm, torch.Tensor.addmm, torch.addbmm, torch.einsum,
                 torch.Tensor.__rmatmul__}
    LOOKED_AT = MATMULS | BADDBMMS | UNHANDLED | {F.linear, F.scaled_dot_product_attention}

    class EmulatedBf16(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func not in LOOKED_AT:  # every other torch call passes here: return at once
                return func(*args, **kwargs)
            cpu = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
            if not cpu:
                return func(*args, **kwargs)
            autocast = (torch.is_autocast_enabled("cpu")
                        and torch.get_autocast_dtype("cpu") == BF16)
            bf16 = autocast or any(t.dtype == BF16 for t in cpu)
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if bf16 and func is F.linear and bias is None:
                x, weight = (t.to(BF16) for t in args[:2])
                return emulated_matmul(x, weight.t())
            if bf16 and func in MATMULS and not kwargs:
                return emulated_matmul(*(t.to(BF16) for t in args))
            if bf16 and func in BADDBMMS:
                base, a, b = (t.to(BF16) for t in args[:3])
                return emulated_baddbmm(base, a, b, float(kwargs.get("beta", 1)),
                                        float(kwargs.get("alpha", 1)))
            # attention that trains keeps torch's bf16 kernel: this op has no backward
            if (func is F.scaled_dot_product_attention and bf16 and len(args) == 3
                    and set(kwargs) <= {"is_causal", "enable_gqa"}
                    and not (torch.is_grad_enabled() and any(t.requires_grad for t in cpu))):
                return emulated_attention(*(t.to(BF16) for t in args),
                                          kwargs.get("is_causal", False),
                                          kwargs.get("enable_gqa", False))
            if bf16 and func in UNHANDLED:
                print(f"bf16 emulation: {func.__name__} is not emulated (torch's slow bf16 kernel)",
                      file=sys.stderr)
                UNHANDLED.discard(func)
            return func(*args, **kwargs)

    class PatchDistributed(importlib.abc.MetaPathFinder):
        """After the product's distributed.py loads: its probe answers bf16 on a CPU."""

        def find_spec(self, name, path, target=None):
            if name != "distributed":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.origin or not spec.origin.endswith("distributed.py"):
                return spec
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                probe = module.precision

                def precision(device, width=256):
                    if device.type != "cpu":
                        return probe(device, width)
                    return "bfloat16", "bf16: emulated (dev/bf16_emulation), not measured"
                module.precision = precision
                native = module.native_bf16
                module.native_bf16 = lambda device: device.type == "cpu" or native(device)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, PatchDistributed())
    EmulatedBf16().__enter__()
