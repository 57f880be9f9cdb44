"""dev/bf16_emulation: bf16 numerics without a bf16 CPU, also under torch.compile."""
import json
import os
import subprocess
import sys

from helpers import ROOT

CHECK = r"""
import json, torch, torch.nn.functional as F
import distributed

torch.manual_seed(0)
x = torch.randn(64, 256)
w = torch.randn(384, 256, requires_grad=True)

def linear(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.linear(x, w)

emulated = linear(x, w)
emulated.float().square().sum().backward()
grad, w.grad = w.grad, None
with torch._C.DisableTorchFunction():  # torch's own bf16 kernels: slow, exact here
    native = linear(x, w)
    native.float().square().sum().backward()
# every product of two bf16 numbers is exact in fp64, and so are these sums
exact = (x.bfloat16().double() @ w.detach().bfloat16().double().t()).bfloat16()
compiled = torch.compile(linear)(x, w)
q = torch.randn(1, 2, 8, 16, requires_grad=True)
with torch.autocast("cpu", dtype=torch.bfloat16):  # attention that trains: torch's own kernel
    F.scaled_dot_product_attention(q, q, q, is_causal=True).float().sum().backward()
print(json.dumps({
    "dtype": str(emulated.dtype),
    "probe": distributed.precision(torch.device("cpu"))[0],
    "off_exact": (emulated.float() != exact.float()).float().mean().item(),
    "off_native": (emulated.float() != native.float()).float().mean().item(),
    "off_fp32": (emulated != (x @ w.detach().t()).bfloat16()).float().mean().item(),
    "grad_off_native": ((grad - w.grad).abs() / w.grad.abs().clamp(min=1e-3)).max().item(),
    "compiled_equal": bool(torch.equal(compiled, emulated)),
    "attention_grad": q.grad is not None,
}))
"""


def test_bf16_emulation_rounds_as_a_bf16_cpu_compiled_too():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "dev" / "bf16_emulation"),
                                                        str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["dtype"] == "torch.bfloat16"
    assert result["probe"] == "bfloat16"
    # bf16 operands, fp32 sums, one rounding: as the exact result rounded, but for rare ties
    assert result["off_exact"] < 0.02
    assert result["off_native"] < 0.02
    assert result["off_fp32"] > 0.3  # fp32 operands, rounded once: half the values differ
    assert result["grad_off_native"] < 0.02  # the backward's products are bf16's too
    # casts around an fp32 matmul with autocast off inside: compiled, other values than eager
    assert result["compiled_equal"]
    assert result["attention_grad"]
