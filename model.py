"""The GPT: config, presets, layers, chunked loss, KV cache, parameter/FLOP/memory accounting.
Run alone, it shows a preset without allocating a weight:

    python model.py --preset llama3-1b                 # prints params: 1241581568
    python model.py --preset d20 --micro_batch 16      # any field can be overridden: --n_layer 8

fp32 master weights, bf16 compute by autocast (bf16 weights freeze RMSNorm scales). The loss
runs in chunks, its gradient in the forward: no (batch, time, vocab) fp32 logits.
"""
import argparse
import functools
import math
import re
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 1024
    sequence_len: int = 256
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_kv_head: int = 4  # < n_head: grouped-query attention, dividing n_head
    head_dim: int = 0  # 0 = n_embd // n_head
    mlp: str = "relu2"  # relu(x)^2 | swiglu: silu(gate) * up
    mlp_hidden: int = 0  # 0 = 4*n_embd (relu2), 8/3*n_embd up to a multiple of 64 (swiglu)
    rope_theta: float = 10000.0
    norm_learnable: bool = False  # RMSNorm with a scale (Llama) or without (modern GPT)
    norm_eps: float = 1e-6
    qk_norm: bool = True  # RMSNorm on queries and keys before RoPE
    tie_embeddings: bool = False  # the output head reuses the token embedding matrix
    logit_softcap: float = 15.0  # logits -> cap * tanh(logits / cap); 0 = off
    bitnet: bool = False  # BitNet b1.58: ternary weights, 8-bit activations
    activation_checkpointing: bool = False  # recompute each block in backward
    value_embeds: bool = False  # token embeddings gated into the values, alternate layers
    resid_lambdas: bool = False  # block i reads resid[i] * x + x0[i] * (the token embedding)

    def __post_init__(self):
        for name in ("vocab_size", "sequence_len", "n_layer", "n_embd", "n_head", "n_kv_head"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.mlp not in ("relu2", "swiglu"):
            raise ValueError(f"mlp={self.mlp!r} is not allowed: choose one of relu2, swiglu")
        if self.head_dim == 0:
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                                 f"allowed n_head for this width are {_divisors(self.n_embd)} (or "
                                 "set head_dim explicitly)")
            self.head_dim = self.n_embd // self.n_head
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embeddings rotate "
                             "pairs of channels)")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not divisible by "
                             f"n_kv_head={self.n_kv_head}: "
                             f"allowed n_kv_head are {_divisors(self.n_head)}")
        if self.mlp_hidden == 0:
            hidden = 64 * math.ceil(8 * self.n_embd / 3 / 64)
            self.mlp_hidden = 4 * self.n_embd if self.mlp == "relu2" else hidden
        if self.logit_softcap < 0 or self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("logit_softcap must be >= 0, norm_eps and rope_theta > 0")


def _divisors(n):
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


# -----------------------------------------------------------------------------
# Presets: GPTConfig fields, each overridable

PRESETS = {
    # the demo and the tests: 4.2M parameters; the demo world has at most ~1,690 BPE tokens
    "tiny": {"vocab_size": 1024, "sequence_len": 256, "n_layer": 4, "n_embd": 256, "n_head": 4,
             "n_kv_head": 4, "value_embeds": True, "resid_lambdas": True},
    # a measured Llama-3-style run's model: 1,241,581,568 parameters
    "llama3-1b": {"vocab_size": 131072, "sequence_len": 2048, "n_layer": 16, "n_embd": 2048,
                  "n_head": 32, "n_kv_head": 8, "mlp": "swiglu", "mlp_hidden": 8192,
                  "rope_theta": 500000.0, "norm_learnable": True, "norm_eps": 1e-5,
                  "qk_norm": False, "tie_embeddings": True, "logit_softcap": 0.0},
    # a measured BitNet b1.58 run's model: 95,367,936 parameters
    "bitnet-95m": {"vocab_size": 32000, "sequence_len": 256, "n_layer": 8, "n_embd": 768,
                   "n_head": 12, "n_kv_head": 6, "mlp": "swiglu", "mlp_hidden": 3072,
                   "norm_learnable": True, "norm_eps": 1e-5, "qk_norm": False,
                   "tie_embeddings": True, "logit_softcap": 0.0, "bitnet": True},
}
# a value embedding's gate reads the block's first 12 normalized channels
VE_GATE_CHANNELS = 12
DEPTH_HEAD_DIM = 128
DEPTH_ASPECT = 64


def depth_preset(depth):
    """d{N}: nanochat's one-dial family, width 64*N rounded up to 128s (docs/model.md)."""
    width = DEPTH_HEAD_DIM * math.ceil(DEPTH_ASPECT * depth / DEPTH_HEAD_DIM)
    heads = width // DEPTH_HEAD_DIM
    return {"vocab_size": 65536, "sequence_len": 2048, "n_layer": depth, "n_embd": width,
            "n_head": heads, "n_kv_head": heads, "mlp": "relu2", "rope_theta": 10000.0,
            "norm_learnable": False, "qk_norm": True, "tie_embeddings": False,
            "logit_softcap": 15.0, "value_embeds": True, "resid_lambdas": True}


def preset_names():
    return ", ".join(PRESETS) + ", d<N> (the depth dial, e.g. d12, d20)"


def config_from_preset(name, overrides=None):
    match = re.fullmatch(r"d(\d+)", name)
    if match and int(match.group(1)) >= 1:
        values = depth_preset(int(match.group(1)))
    elif name in PRESETS:
        values = dict(PRESETS[name])
    else:
        raise ValueError(f"unknown preset {name!r}: allowed presets are {preset_names()}")
    allowed = [f.name for f in fields(GPTConfig)]
    for key, value in (overrides or {}).items():
        if key not in allowed:
            raise ValueError(f"unknown model field {key!r}: allowed fields are "
                             f"{', '.join(allowed)}")
        values[key] = value
    return GPTConfig(**values)


def parse_bool(text):
    if str(text).lower() in ("1", "true", "yes", "on"):
        return True
    if str(text).lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean: use true or false")


def add_model_args(parser, default_preset="tiny"):
    group = parser.add_argument_group("model (a preset, then any field overridden)")
    group.add_argument("--preset", default=default_preset,
                       help=f"one of {preset_names()} (default: %(default)s)")
    for f in fields(GPTConfig):
        kind = parse_bool if f.type is bool else f.type
        group.add_argument(f"--{f.name}", type=kind, default=None, metavar=f.name.upper(),
                           help=f"override the preset's {f.name}")


def parse_args(parser, argv=None):
    """parse_args naming the model fields at an unknown option; argv may hold paths."""
    def fail(message):  # one line, no usage dump
        parser.exit(2, f"{parser.prog}: error: {message}\n")
    parser.error = fail
    args, unknown = parser.parse_known_args(None if argv is None else [str(a) for a in argv])
    if unknown:
        allowed = ", ".join(f.name for f in fields(GPTConfig))
        fail(f"unknown option {' '.join(unknown)}: model fields are {allowed}; see --help for the "
             "rest")
    return args


def config_from_args(args):
    overrides = {f.name: getattr(args, f.name, None) for f in fields(GPTConfig)}
    overrides = {name: value for name, value in overrides.items() if value is not None}
    return config_from_preset(args.preset, overrides)


# -----------------------------------------------------------------------------
# Accounting from the config alone

def value_embed_layers(c):
    """Every other layer, counted back from the last."""
    return [i for i in range(c.n_layer) if c.value_embeds and i % 2 == (c.n_layer - 1) % 2]


def param_breakdown(c):
    d, q_dim, kv_dim = c.n_embd, c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    ve_layers = len(value_embed_layers(c))
    gates = ve_layers * VE_GATE_CHANNELS * c.n_kv_head
    attention = c.n_layer * (2 * d * q_dim + 2 * d * kv_dim) + gates  # no biases
    mlp = c.n_layer * (3 if c.mlp == "swiglu" else 2) * d * c.mlp_hidden
    qk = 2 * c.head_dim if c.qk_norm else 0
    norms = c.n_layer * (2 * d + qk) + d if c.norm_learnable else 0
    counts = {"embeddings": c.vocab_size * d, "value_embeds": ve_layers * c.vocab_size * kv_dim,
              "attention": attention, "mlp": mlp, "norms": norms,
              "head": 0 if c.tie_embeddings else c.vocab_size * d,
              "scalars": 2 * c.n_layer if c.resid_lambdas else 0}
    counts["total"] = sum(counts.values())
    return counts


def num_params(c):
    return param_breakdown(c)["total"]


def budget_params(c):
    """What --tokens_per_param counts: not the value-embedding tables, lookups without FLOPs
    (most of d20's parameters)."""
    return num_params(c) - param_breakdown(c)["value_embeds"]


def muon_neurons(c):
    """NorMuon's state: the longer side of each block matrix."""
    d, q_dim, kv_dim = c.n_embd, c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    mlp = (3 if c.mlp == "swiglu" else 2) * max(d, c.mlp_hidden)
    gates = len(value_embed_layers(c)) * max(VE_GATE_CHANNELS, c.n_kv_head)
    return c.n_layer * (2 * max(d, q_dim) + 2 * max(d, kv_dim) + mlp) + gates


def flops_per_token(c, seq_len=None):
    """Training FLOPs per token as PaLM and nanochat count them (docs/model.md)."""
    b = param_breakdown(c)
    matmul_params = b["attention"] + b["mlp"] + c.vocab_size * c.n_embd
    T = seq_len or c.sequence_len
    return 6 * matmul_params + 12 * c.n_layer * c.n_head * c.head_dim * T


def memory_estimate(c, micro_batch, seq_len=None, optimizer="muon", bf16=True, device_type="cuda"):
    """Training bytes per device (docs/model.md): weights, gradients, optimizer, activations
    (held after the forward), transient (the largest short-lived)."""
    T = seq_len or c.sequence_len
    P = num_params(c)
    b = param_breakdown(c)
    block_matrices = b["attention"] + b["mlp"]
    # + NorMuon's fp32 second moment per neuron
    if optimizer == "muon":
        opt = 4 * block_matrices + 4 * muon_neurons(c) + 8 * (P - block_matrices)
    else:  # AdamW: two fp32 moments; 8-bit AdamW: two 1-byte moments
        opt = {"adamw": 8, "adam8bit": 2}[optimizer] * P
    tokens = micro_batch * T
    per_layer = activation_bytes_per_token_layer(c, bf16)
    # bf16 casts / BitNet's quantized W
    weight_copies = (2 if bf16 else (4 if c.bitnet else 0)) * block_matrices
    ve_layers, kv_dim = len(value_embed_layers(c)), c.n_kv_head * c.head_dim
    # a value embedding: its lookup and the gate (sigmoid's output, and 3x it)
    per_ve_layer = (2 if bf16 else 4) * (kv_dim + 2 * c.n_kv_head + (VE_GATE_CHANNELS if c.bitnet
                                                                     else 0))
    if c.activation_checkpointing:  # block inputs kept; one block recomputed at a time
        blocks = tokens * (c.n_layer * 4 * c.n_embd + ve_layers * 4 * kv_dim)
        recompute = tokens * (per_layer + (per_ve_layer if ve_layers else 0))
        recompute += weight_copies // c.n_layer
    else:
        blocks = tokens * (c.n_layer * per_layer + ve_layers * per_ve_layer) + weight_copies
        recompute = 0
    final_norm = 4 * c.n_embd + 4 + (4 * c.n_embd if c.norm_learnable else 0)
    # the loss keeps grad_x and grad_weight (fp32) until backward
    loss = tokens * 4 * c.n_embd + 4 * c.vocab_size * c.n_embd
    # the residual scalars keep each block's input, checkpointing or not
    mixes = tokens * c.n_layer * 4 * c.n_embd if c.resid_lambdas else 0
    # 8: int64 token ids for the embedding's backward
    acts = blocks + mixes + tokens * (8 + final_norm) + loss
    chunk_rows = min(tokens, max(1, loss_chunk_elements(device_type) // c.vocab_size))
    # a chunk's logits, probabilities, tanh, the head gradient's sum twice; or grad_x's concat
    loss_transient = max(3 * 4 * chunk_rows * c.vocab_size + 4 * c.vocab_size * c.n_embd,
                         tokens * 4 * c.n_embd)
    transient = max(recompute, loss_transient)
    return {"weights": 4 * P, "gradients": 4 * P, "optimizer": opt, "activations": acts,
            "transient": transient, "total": 8 * P + opt + acts + transient}


def activation_bytes_per_token_layer(c, bf16):
    """Bytes autograd keeps per token per block; norms run in fp32 under autocast."""
    a = 2 if bf16 else 4
    d, q_dim, kv_dim, h = c.n_embd, c.n_head * c.head_dim, c.n_kv_head * c.head_dim, c.mlp_hidden
    # input, 1/rms, normalized x
    norm = 4 * d + 4 + (4 * d if c.norm_learnable else 0)
    attn = norm + a * d  # the q/k/v projections' shared input in the compute dtype
    # q and k (fp32 for the norm), 1/rms per head, normalized copies if learnable
    if c.qk_norm:
        attn += 4 * (q_dim + kv_dim) * (2 if c.norm_learnable else 1) + 4 * (c.n_head + c.n_kv_head)
    # SDPA's q, k, v, output (= o_proj's input), logsumexp
    attn += a * (2 * q_dim + 2 * kv_dim) + 4 * c.n_head
    # swiglu: gate, silu(gate), up, product
    mlp = norm + a * d + a * h * (4 if c.mlp == "swiglu" else 2)
    if c.bitnet:  # each linear layer saves its own 8-bit input: q, k, v three, gate and up two
        attn += a * (2 * d + q_dim)
        mlp += a * d if c.mlp == "swiglu" else 0
    return attn + mlp


# -----------------------------------------------------------------------------
# Layers

def tanh(x):
    """tanh as 2 sigmoid(2x) - 1: on CPU torch.tanh is ~4x slower than exp (dev/LOG.md)."""
    return 2 * torch.sigmoid(2 * x) - 1


def softcap_logits(logits, cap):
    return cap * tanh(logits / cap) if cap else logits


def to_compute_dtype(x):
    """Cast once, not a bf16 copy per projection."""
    if not torch.is_autocast_enabled(x.device.type):
        return x
    return x.to(torch.get_autocast_dtype(x.device.type))


def apply_rotary(x, cos, sin):
    # x: (B, T, H, D); rotate each pair (x[i], x[i + D/2]) by its position's angle
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


def bitnet_weight(weight):
    """BitNet b1.58: W -> round(W / mean|W|) clipped to {-1, 0, 1}, times mean|W|."""
    scale = weight.abs().mean().clamp(min=1e-5)
    return (weight / scale).round().clamp(-1, 1) * scale


def bitnet_activation(x):
    """Per-token absmax 8-bit quantization of a linear layer's input."""
    scale = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (x * scale).round().clamp(-128, 127) / scale


class Linear(nn.Linear):
    """Bias-free; bitnet: quantized on the fly, straight-through gradients."""

    def __init__(self, fan_in, fan_out, bitnet=False):
        super().__init__(fan_in, fan_out, bias=False)
        self.bitnet = bitnet

    def effective_weight(self):
        if not self.bitnet:
            return self.weight
        # + (w - w), exactly 0: a straight-through gradient
        w = self.weight.detach()
        return bitnet_weight(w) + (self.weight - w)

    def forward(self, x):
        if self.bitnet:
            x_detached = x.detach()
            x = bitnet_activation(x_detached) + (x - x_detached)
        return F.linear(x, self.effective_weight())


class RMSNorm(nn.Module):
    def __init__(self, dim, learnable, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if learnable else None
        self.eps = eps

    def forward(self, x):
        # q and k arrive in bf16: a bf16 scale keeps the fused kernel
        weight = self.weight.to(x.dtype) if self.weight is not None else None
        return F.rms_norm(x, (x.size(-1),), weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        self.layer_idx, self.n_head, self.n_kv_head = layer_idx, c.n_head, c.n_kv_head
        self.head_dim = c.head_dim
        self.q_proj = Linear(c.n_embd, c.n_head * c.head_dim, c.bitnet)
        self.k_proj = Linear(c.n_embd, c.n_kv_head * c.head_dim, c.bitnet)
        self.v_proj = Linear(c.n_embd, c.n_kv_head * c.head_dim, c.bitnet)
        self.o_proj = Linear(c.n_head * c.head_dim, c.n_embd, c.bitnet)
        self.q_norm = RMSNorm(c.head_dim, c.norm_learnable, c.norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.norm_learnable, c.norm_eps) if c.qk_norm else None
        # per KV head, how much of the value embedding joins v, in (0, 3)
        has_gate = layer_idx in value_embed_layers(c)
        self.ve_gate = Linear(VE_GATE_CHANNELS, c.n_kv_head, c.bitnet) if has_gate else None

    def forward(self, x, cos, sin, kv_cache=None, value_embed=None):
        B, T, _ = x.shape
        x = to_compute_dtype(x)
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim)
        if value_embed is not None:
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))
            value_embed = value_embed.view(B, T, self.n_kv_head, self.head_dim)
            v = v + gate.unsqueeze(-1) * value_embed.to(v.dtype)
        if self.q_norm is not None:  # the norm may return fp32; SDPA wants one dtype
            q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, head_dim)
        if kv_cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            start = kv_cache.pos
            k, v = kv_cache.update(self.layer_idx, k, v)
            if T == 1:  # one new query sees the whole cache
                y = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            else:  # query i at start + i sees keys 0 .. start + i
                mask = torch.ones(T, k.size(2), dtype=torch.bool,
                                  device=x.device).tril(diagonal=start)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.swiglu = c.mlp == "swiglu"
        self.up_proj = Linear(c.n_embd, c.mlp_hidden, c.bitnet)
        self.gate_proj = Linear(c.n_embd, c.mlp_hidden, c.bitnet) if self.swiglu else None
        self.down_proj = Linear(c.mlp_hidden, c.n_embd, c.bitnet)

    def forward(self, x):
        x = to_compute_dtype(x)
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.relu(self.up_proj(x)).square())


class Block(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        self.attn_norm = RMSNorm(c.n_embd, c.norm_learnable, c.norm_eps)
        self.attn = Attention(c, layer_idx)
        self.mlp_norm = RMSNorm(c.n_embd, c.norm_learnable, c.norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, kv_cache=None, value_embed=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, kv_cache, value_embed)
        return x + self.mlp(self.mlp_norm(x))


class KVCache:
    """Keys and values of every layer for positions 0 .. pos-1, in the compute dtype."""

    def __init__(self, config, batch_size, max_len):
        if max_len > config.sequence_len:
            raise ValueError(f"KV cache of {max_len} positions exceeds "
                             f"sequence_len={config.sequence_len}")
        self.shape = (config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
        self.k = self.v = None
        self.pos = 0

    def update(self, layer_idx, k, v):
        T = k.size(2)
        if self.k is None:
            self.k = torch.zeros(self.shape, dtype=k.dtype, device=k.device)
            self.v = torch.zeros(self.shape, dtype=v.dtype, device=v.device)
        if self.pos + T > self.shape[3]:
            raise ValueError(f"KV cache full: {self.pos} + {T} positions > capacity "
                             f"{self.shape[3]}")
        self.k[layer_idx, :, :, self.pos:self.pos + T] = k
        self.v[layer_idx, :, :, self.pos:self.pos + T] = v
        return self.k[layer_idx, :, :, :self.pos + T], self.v[layer_idx, :, :, :self.pos + T]


# -----------------------------------------------------------------------------
# The loss, chunked

# logits per loss chunk; CUDA: large matmuls, 8x fewer passes over the fp32 head gradient
LOSS_CHUNK_ELEMENTS = {"cuda": 2 ** 28, "cpu": 2 ** 25}


def loss_chunk_elements(device_type):
    return LOSS_CHUNK_ELEMENTS.get(device_type, LOSS_CHUNK_ELEMENTS["cpu"])


def loss_chunk(xc, w, tc, softcap, need_grad, grad_w=None):
    """One chunk's summed cross-entropy; need_grad: also xc's and w's gradients (into grad_w),
    so the logits die with the chunk."""
    logits = (xc @ w.t()).float()
    if softcap:
        capped = tanh(logits / softcap)
        logits = softcap * capped
    valid = tc != -1
    safe_targets = tc.clamp(min=0).unsqueeze(1)
    lse = torch.logsumexp(logits, dim=-1)
    loss = ((lse - logits.gather(1, safe_targets).squeeze(1)) * valid).sum()
    if not need_grad:
        return loss, None, None
    dlogits = torch.exp(logits - lse.unsqueeze(1))
    # one expression fuses exp, onehot and masks: one pass, not three (dev/LOG.md)
    if torch.compiler.is_compiling():
        dlogits = dlogits - (torch.arange(logits.size(1),
                                          device=logits.device) == safe_targets).to(dlogits.dtype)
    else:  # eager: in place at the targets (the expression is three passes more)
        dlogits.scatter_add_(1, safe_targets, -torch.ones_like(safe_targets, dtype=dlogits.dtype))
    dlogits = dlogits * valid.unsqueeze(1)
    if softcap:
        dlogits = dlogits * (1 - capped * capped)
    dlogits = dlogits.to(xc.dtype)
    return loss, dlogits @ w, grad_w + (dlogits.t() @ xc).float()


@functools.cache
def compiled_loss_chunk():
    """loss_chunk compiled alone: unrolled, compiling takes far longer (dev/LOG.md). Dynamic
    shapes: rl.py's replies vary in length."""
    return torch.compile(loss_chunk)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy in chunks: only grad_x and grad_weight are kept; nothing is
    recomputed in backward."""

    @staticmethod
    def forward(ctx, x, weight, targets, softcap, compute_dtype, grad_enabled, compiled):
        # grad mode is off here and needs_input_grad ignores no_grad: the caller's decides
        need_grad = grad_enabled and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        logits = x.size(0) * weight.size(0)
        chunks = max(1, math.ceil(logits / loss_chunk_elements(x.device.type)))
        # equal chunks where they divide: one shape for the compiled chunk
        rows = math.ceil(x.size(0) / chunks)
        chunk_fn = compiled_loss_chunk() if compiled else loss_chunk
        loss_sum, grad_x_chunks = torch.zeros((), dtype=torch.float32, device=x.device), []
        grad_w = None
        if need_grad:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
        with torch.autocast(x.device.type, enabled=False):
            w = weight.to(compute_dtype)
            for start in range(0, x.size(0), rows):
                loss, grad_xc, grad_w = chunk_fn(x[start:start + rows].to(compute_dtype), w,
                                                 targets[start:start + rows], softcap, need_grad,
                                                 grad_w)
                loss_sum = loss_sum + loss
                if need_grad:
                    grad_x_chunks.append(grad_xc)
        grad_x = torch.cat(grad_x_chunks).to(x.dtype) if need_grad else None
        ctx.save_for_backward(grad_x, grad_w)
        return loss_sum

    @staticmethod
    def backward(ctx, grad_output):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_output, grad_w * grad_output, None, None, None, None, None


def chunked_cross_entropy(x, weight, targets, softcap, compute_dtype, grad_enabled, compiled):
    args = (x, weight, targets, softcap, compute_dtype, grad_enabled, compiled)
    # traced in a compiled model: a graph break keeps the chunk loop out of its graph
    if torch.compiler.is_compiling():
        return chunked_cross_entropy_outside_graph(*args)
    # eager: no dynamo to import (a second at each stage start)
    return ChunkedCrossEntropy.apply(*args)


# torch.compiler.disable would import dynamo with this file
@torch._disable_dynamo
def chunked_cross_entropy_outside_graph(*args):
    return ChunkedCrossEntropy.apply(*args)


# -----------------------------------------------------------------------------
# The model

class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm_f = RMSNorm(config.n_embd, config.norm_learnable, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.n_embd,
                                                                    config.vocab_size, bias=False)
        # value embeddings (modded-nanogpt): the stream need not carry token identity
        kv_dim = config.n_kv_head * config.head_dim
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(config.vocab_size, kv_dim)
                                           for i in value_embed_layers(config)})
        self.resid_lambdas = self.x0_lambdas = None  # residual scalars (modded-nanogpt, nanochat)
        if config.resid_lambdas:
            self.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
            self.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
        # rotary tables: derived, never saved
        rotary = (config.sequence_len, config.head_dim // 2)
        self.register_buffer("cos", torch.empty(rotary), persistent=False)
        self.register_buffer("sin", torch.empty(rotary), persistent=False)

    @torch.no_grad()
    def init_weights(self):
        """The init scheme; docs/model.md says why each std."""
        c = self.config
        for block in self.blocks:
            for name, module in block.named_modules():
                if isinstance(module, nn.Linear):
                    std = module.in_features ** -0.5
                    if name.endswith(("o_proj", "down_proj")):
                        std /= math.sqrt(2 * c.n_layer)
                    nn.init.normal_(module.weight, mean=0.0, std=std)
        if c.tie_embeddings:
            nn.init.normal_(self.wte.weight, mean=0.0, std=0.3 * c.n_embd ** -0.5)
        else:
            nn.init.normal_(self.wte.weight, mean=0.0, std=1.0)
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        for module in self.modules():
            if isinstance(module, RMSNorm) and module.weight is not None:
                nn.init.ones_(module.weight)
        # std 1/sqrt(n_embd), as v_proj's outputs; gates start near 1.5
        for i, table in self.value_embeds.items():
            nn.init.uniform_(table.weight, -(3 / c.n_embd) ** 0.5, (3 / c.n_embd) ** 0.5)
            nn.init.uniform_(self.blocks[int(i)].attn.ve_gate.weight, 0.0, 0.02)
        if c.resid_lambdas:  # at init: the stream plus a tenth of the embedding
            self.resid_lambdas.fill_(1.0)
            self.x0_lambdas.fill_(0.1)
        self.init_rotary()

    @torch.no_grad()
    def init_rotary(self):
        c, device = self.config, self.cos.device
        channels = torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=device)
        inv_freq = 1.0 / (c.rope_theta ** (channels / c.head_dim))
        positions = torch.arange(c.sequence_len, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def value_embed(self, layer_idx, ids):
        if str(layer_idx) not in self.value_embeds:
            return None
        return self.value_embeds[str(layer_idx)](ids)

    def mix_embedding(self, layer_idx, x, x0):
        if self.resid_lambdas is None:
            return x
        return self.resid_lambdas[layer_idx] * x + self.x0_lambdas[layer_idx] * x0

    def head_weight(self):
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, idx, targets=None, kv_cache=None, reduction="mean", last_only=False,
                predictions=False):
        """idx (B, T). With targets (-1: ignored): cross-entropy by 'mean', 'sum' or 'none'
        ((B, T); predictions: also the argmax). Without: fp32 logits (B, T or 1, vocab)."""
        B, T = idx.shape
        start = kv_cache.pos if kv_cache is not None else 0
        if start + T > self.config.sequence_len:
            raise ValueError(f"positions {start}..{start + T - 1} exceed "
                             f"sequence_len={self.config.sequence_len}")
        cos, sin = (table[None, start:start + T, None, :] for table in (self.cos, self.sin))
        x = x0 = self.wte(idx)
        for i, block in enumerate(self.blocks):
            x, value_embed = self.mix_embedding(i, x, x0), self.value_embed(i, idx)
            recompute = self.config.activation_checkpointing and torch.is_grad_enabled()
            if recompute and kv_cache is None:
                x = checkpoint(block, x, cos, sin, None, value_embed, use_reentrant=False)
            else:
                x = block(x, cos, sin, kv_cache, value_embed)
        if kv_cache is not None:
            kv_cache.pos += T
        x = self.norm_f(x)
        softcap = self.config.logit_softcap
        if targets is None:
            return softcap_logits(F.linear(x[:, -1:] if last_only else x,
                                           self.head_weight()).float(), softcap)
        x, targets = x.reshape(B * T, -1), targets.reshape(B * T)
        if reduction == "none":
            losses, argmax = self._per_token_loss(x, targets)
            return (losses.view(B, T), argmax.view(B, T)) if predictions else losses.view(B, T)
        compute_dtype = self.head_weight().dtype
        if torch.is_autocast_enabled(x.device.type):
            compute_dtype = torch.get_autocast_dtype(x.device.type)
        loss_sum = chunked_cross_entropy(x, self.head_weight(), targets, softcap, compute_dtype,
                                         torch.is_grad_enabled(), torch.compiler.is_compiling())
        return loss_sum if reduction == "sum" else loss_sum / (targets != -1).sum().clamp(min=1)

    def _per_token_loss(self, x, targets):
        """Loss and argmax only where there is a target, in chunks."""
        valid = (targets != -1).nonzero().squeeze(1)
        losses = torch.zeros(targets.shape, device=x.device)
        argmax = torch.full(targets.shape, -1, dtype=torch.long, device=x.device)
        rows = max(1, loss_chunk_elements(x.device.type) // self.config.vocab_size)
        for start in range(0, valid.numel(), rows):
            at = valid[start:start + rows]
            logits = softcap_logits(F.linear(x[at], self.head_weight()).float(),
                                    self.config.logit_softcap)
            losses[at] = F.cross_entropy(logits, targets[at], reduction="none")
            argmax[at] = logits.argmax(-1)
        return losses, argmax


class _NoInitOnMeta(torch.overrides.TorchFunctionMode):
    """Skip modules' own inits on meta (init_weights sets every value): they import
    torch._dynamo. empty_like's explicit format spares importing sympy."""

    SKIPPED = (torch.Tensor.normal_, torch.Tensor.uniform_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SKIPPED or getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        if func is torch.empty_like:
            kwargs = {"memory_format": torch.contiguous_format, **kwargs}
        return func(*args, **kwargs)


def build_model(config, device="cpu", init=True):
    """Built on meta, allocated on `device`; init=False (weights load next): rotary only."""
    with torch.device("meta"), _NoInitOnMeta():
        model = GPT(config)
    with _NoInitOnMeta():
        model.to_empty(device=device)
    model.init_weights() if init else model.init_rotary()
    return model


def check_master_weights(model):
    """Raise if any parameter is not fp32 (bf16 norms freeze)."""
    wrong = [f"{name} ({p.dtype})" for name, p in model.named_parameters()
             if p.dtype != torch.float32]
    if wrong:
        raise ValueError("parameters must stay fp32 master weights, use autocast for bf16 compute; "
                         f"not fp32: {', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}")


def score_rows(model, rows, dtype, device, predictions=False):
    """(per-token losses, targets) of rows [(ids, first scored index)], one padded forward."""
    x = torch.zeros(len(rows), max(len(ids) for ids, _ in rows) - 1, dtype=torch.long)
    y = torch.full_like(x, -1)
    for r, (ids, start) in enumerate(rows):
        x[r, :len(ids) - 1] = torch.tensor(ids[:-1])
        y[r, start - 1:len(ids) - 1] = torch.tensor(ids[start:])
    y = y.to(device)
    with autocast_context(device.type, dtype):
        return model(x.to(device), y, reduction="none", predictions=predictions), y


def autocast_context(device_type, dtype):
    """'bfloat16': bf16 matmuls, fp32 weights; 'float32': plain fp32."""
    if dtype == "bfloat16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    if dtype == "float32":
        return nullcontext()
    raise ValueError(f"dtype={dtype!r} is not allowed: choose bfloat16 or float32")


# -----------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description="Print a preset's config, exact parameter count, "
                                     "FLOPs and memory.")
    add_model_args(parser)
    parser.add_argument("--micro_batch", type=int, default=8, help="sequences per device for the "
                        "memory estimate (default: %(default)s)")
    parser.add_argument("--optimizer", default="muon", choices=["adam8bit", "adamw", "muon"],
                        help="optimizer whose state the estimate counts (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="compute dtype for the activation estimate (default: %(default)s)")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"],
                        help="device type for the estimate (default: %(default)s)")
    args = parse_args(parser, argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    print(f"preset: {args.preset}")
    for key, value in asdict(config).items():
        print(f"  {key}: {value}")
    b = param_breakdown(config)
    print(f"params: {b['total']}")
    for key in ("embeddings", "value_embeds", "attention", "mlp", "norms", "head", "scalars"):
        print(f"  {key}: {b[key]:,} ({100 * b[key] / b['total']:.1f}%)")
    fpt = flops_per_token(config)
    print(f"FLOPs/token (train, T={config.sequence_len}): {fpt:.4e} (6 x matmul params + 12 x "
          "layers x heads x head_dim x T)")
    mem = memory_estimate(config, args.micro_batch, optimizer=args.optimizer,
                          bf16=args.dtype == "bfloat16", device_type=args.device)
    print(f"training memory per {args.device} device, micro-batch {args.micro_batch} x "
          f"{config.sequence_len}, {args.optimizer}, {args.dtype} compute, activation "
          f"checkpointing {'on' if config.activation_checkpointing else 'off'}:")
    for key in ("weights", "gradients", "optimizer", "activations", "transient", "total"):
        print(f"  {key}: {mem[key] / 2**30:.2f} GiB")


if __name__ == "__main__":
    sys.exit(main())
