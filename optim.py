"""Optimizers and schedules: parameter groups and lrs, Muon with Polar Express and NorMuon, and
the lr schedules. Not a stage. To see a schedule:

    python optim.py --steps 1000 --schedule wsd --warmdown_frac 0.2    # lr, weight decay, momentum
"""
import argparse
import math
import sys

import torch
import torch.distributed as dist

from distributed import device_name, is_dtensor, local, matmul_dtype, precision

# -----------------------------------------------------------------------------
# Optimizers. Base lrs for width 768 and 2^19-token batches (nanochat's); AdamW's scale with
# 1/sqrt(width/768) and (batch/2^19)^(1/8), measured (dev/LOG.md). Muon's lr is not scaled.

REF_WIDTH, REF_BATCH, BATCH_EXPONENT = 768, 2 ** 19, 1 / 8

# torch.optim imports torch._dynamo (a second) at an optimizer's first add_param_group and step;
# nothing here compiles them. torch._disable_dynamo's lazy wrapper calls what this attribute holds
for method in (torch.optim.Optimizer.add_param_group, torch.optim.Optimizer.state_dict,
               torch.optim.Optimizer.load_state_dict, torch.optim.Optimizer.zero_grad):
    if hasattr(method, "__wrapped__"):
        setattr(method.__wrapped__, "__dynamo_disable", method.__wrapped__)


class AdamW(torch.optim.AdamW):
    """torch's AdamW without the step's wrapper, which imports torch._dynamo."""

    @torch.no_grad()
    def step(self, closure=None):
        return getattr(torch.optim.AdamW.step, "__wrapped__", torch.optim.AdamW.step)(self, closure)


def param_groups(model):
    """Parameters by role. A tied embedding is the head: its gradient is mostly the output's."""
    groups = {"matrix": [], "embedding": [], "value_embedding": [], "head": [], "resid_lambdas": [],
              "x0_lambdas": [],
              "scalar": []}
    tied = model.config.tie_embeddings
    for name, p in model.named_parameters():
        if name in ("resid_lambdas", "x0_lambdas"):
            groups[name].append(p)
        elif name.startswith("blocks.") and p.ndim == 2:
            groups["matrix"].append(p)
        elif name.startswith("wte."):
            groups["head" if tied else "embedding"].append(p)
        elif name.startswith("value_embeds."):
            groups["value_embedding"].append(p)
        elif name.startswith("lm_head."):
            groups["head"].append(p)
        else:
            groups["scalar"].append(p)
    return {k: v for k, v in groups.items() if v}


def build_optimizers(model, args, width, batch_tokens, device, lr_scale=1.0):
    """Muon for the block matrices and AdamW for the rest, or AdamW everywhere; lrs times
    lr_scale. Groups carry name, base_lr and wd_on."""
    width_factor = (width / REF_WIDTH) ** -0.5
    batch_factor = (batch_tokens / REF_BATCH) ** BATCH_EXPONENT
    # AdamW on the block matrices keeps the square-root rule: 1/8 cost bpb there (dev/LOG.md)
    sqrt_factor = (batch_tokens / REF_BATCH) ** 0.5
    lrs = {"matrix": args.matrix_lr * (1 if args.optimizer == "muon"
                                       else width_factor * sqrt_factor),
           "embedding": args.embedding_lr * width_factor * batch_factor,
           "head": args.head_lr * width_factor * batch_factor,
           "scalar": args.scalar_lr * width_factor * batch_factor,
           # nanochat's: half the embedding's
           "value_embedding": args.embedding_lr * width_factor * batch_factor / 2,
           # not scaled: scaled by the batch rule, one seed in three diverged (dev/LOG.md)
           "resid_lambdas": 0.005, "x0_lambdas": 0.5}
    lrs = {name: lr * lr_scale for name, lr in lrs.items()}
    groups = param_groups(model)
    adam_groups = [{"params": ps, "name": k, "base_lr": lrs[k], "lr": lrs[k],
                    "wd_on": k == "matrix",
                    # nanochat's, for the x0 mix
                    **({"betas": (0.96, 0.95)} if k == "x0_lambdas" else {})}
                   for k, ps in groups.items() if k != "matrix" or args.optimizer == "adamw"]
    if args.adam8bit:
        try:
            import bitsandbytes
        except ImportError as e:
            raise ImportError("--adam8bit needs bitsandbytes: `pip install bitsandbytes` (CUDA "
                             "only), or drop the flag to use torch's AdamW") from e
        adam = bitsandbytes.optim.AdamW8bit(adam_groups, betas=(0.8, 0.95), eps=1e-10,
                                            weight_decay=0.0)
    else:
        # fused on CPU too: faster than foreach; takes DTensors (dev/LOG.md)
        adam = AdamW(adam_groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0, fused=True)
    optimizers = [adam]
    if args.optimizer == "muon":
        matrix = {"params": groups["matrix"], "name": "matrix", "base_lr": lrs["matrix"],
                  "lr": lrs["matrix"], "wd_on": True}
        optimizers.append(Muon([matrix], ns_dtype=matmul_dtype(device, width)))
    return optimizers


def precision_line(args, device, optimizers, width):
    """What runs in which dtype, and why. Newton-Schulz takes the device's choice whatever
    --dtype says: it needs speed only."""
    muon = [g["ns_dtype"] for opt in optimizers if isinstance(opt, Muon) for g in opt.param_groups]
    chosen, why = precision(device, width)
    how = why if args.dtype == chosen else (f"given or inherited; the choice here would be "
                                            f"{chosen}, {why}")
    return (f"precision: fp32 weights, compute {args.dtype}" + (f", Muon Newton-Schulz {muon[0]}"
                                                                if muon else "")
            + f" ({how}) on {device_name(device)}")


# Polar Express (Amsel et al. 2025, as nanochat): a quintic per step, each best for what the
# steps before leave; later steps reuse the last
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))


def quintic_coefficients(steps):
    return [POLAR_EXPRESS[min(step, len(POLAR_EXPRESS) - 1)] for step in range(steps)]


def newton_schulz(stack, steps, dtype):
    """Approximately orthogonalize a stack of matrices (rows <= columns) in `dtype`; wide ones in
    fp32 or fp64 by the Gram form (fewer FLOPs)."""
    x = stack.to(getattr(torch, dtype))  # may be `stack` itself: in place from here
    # spectral norm < Frobenius norm: the basin
    x.div_(x.norm(dim=(-2, -1), keepdim=True).mul_(1.02).clamp_(min=1e-7))
    rows, columns = x.shape[-2:]
    gram_flops = 4 * rows * rows * columns + (8 * steps - 6) * rows ** 3
    direct_flops = steps * (4 * rows * rows * columns + 2 * rows ** 3)
    if x.dtype in (torch.float32, torch.float64) and gram_flops < direct_flops:
        return newton_schulz_gram(x, steps)
    for a, b, c in quintic_coefficients(steps):
        gram = x @ x.mT  # rows x rows: the smaller one
        # a x + (b G + c G^2) x
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def newton_schulz_gram(x, steps):
    """newton_schulz for wide x: X_k = Q X_0, iterating only m x m matrices."""
    gram, product = x @ x.mT, None
    for step, (a, b, c) in enumerate(quintic_coefficients(steps)):
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        product = poly if product is None else poly @ product
        if step + 1 < steps:
            gram = poly @ gram @ poly
    return product @ x


def whole(shard, param):
    """A sharded update all-gathered whole."""
    if not is_dtensor(param):
        return shard
    return type(param).from_local(shard, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride()).full_tensor()


def shard_of(matrix, param):
    """This rank's rows of a whole matrix, sharded as `param` (no communication)."""
    if not is_dtensor(param):
        return matrix
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(matrix, param.device_mesh, param.placements,
                             src_data_rank=None).to_local()


class Muon(torch.optim.Optimizer):
    """Muon for 2D weights: momentum, orthogonalized in ns_dtype, NorMuon's per-neuron
    normalization, scaled by sqrt(max(1, rows/cols)), decoupled weight decay; one stack per
    shape. FSDP: rank i orthogonalizes a round's i-th matrix and broadcasts it. DDP: each rank
    its share, then an all-gather."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, ns_steps=5,
                 ns_dtype="bfloat16", neuron_beta2=0.95, divide_work=True):
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov,
                                  "weight_decay": weight_decay,
                                  "ns_steps": ns_steps, "ns_dtype": ns_dtype,
                                  "neuron_beta2": neuron_beta2})
        self.divide_work = divide_work

    @torch.no_grad()
    # closure: dcp initializes state with step(closure=None)
    def step(self, closure=None):
        for group in self.param_groups:
            # (rows <= columns) -> parameters of that shape or its transpose
            by_shape = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_shape.setdefault((min(p.shape), max(p.shape)), []).append(p)
            for same_shape in by_shape.values():
                sharded = is_dtensor(same_shape[0])  # rounds of one matrix per rank
                size = dist.get_world_size() if sharded else len(same_shape)
                for start in range(0, len(same_shape), size):
                    self.update(group, same_shape[start:start + size], sharded)

    def update(self, group, params, sharded):
        """Momentum, Newton-Schulz and the step for matrices of one shape, up to a transpose."""
        for p in params:
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        buffers = [local(self.state[p]["momentum_buffer"]) for p in params]
        grads = [local(p.grad) for p in params]
        torch._foreach_lerp_(buffers, grads, 1 - group["momentum"])
        updates = torch._foreach_lerp(grads, buffers,
                                      group["momentum"]) if group["nesterov"] else buffers
        updates = [whole(u, p) for u, p in zip(updates, params, strict=True)]
        talls, shape = [p.size(0) > p.size(1) for p in params], min(params[0].shape,
                                                                    params[0].shape[::-1])
        share = 0  # DDP: matrices per rank
        if not sharded and self.divide_work and dist.is_initialized() and dist.get_world_size() > 1:
            share = math.ceil(len(params) / dist.get_world_size())
            mine = range(dist.get_rank() * share, min(len(params), (dist.get_rank() + 1) * share))
        else:
            mine = [i for i in ([dist.get_rank()] if sharded else range(len(params)))
                    if i < len(params)]
        wide = torch.empty((len(mine), *shape), device=updates[0].device,
                           dtype=getattr(torch, group["ns_dtype"]))
        done = {}
        # sharded, a round with fewer matrices than ranks leaves some rank none
        if mine:
            torch._foreach_copy_([w.mT if talls[i] else w for w, i in zip(wide, mine, strict=True)],
                                 [updates[i] for i in mine])  # stacked and cast in one pass
            done = dict(zip(mine, newton_schulz(wide, group["ns_steps"],
                                                group["ns_dtype"]).unbind(0), strict=True))
        for i in range(len(params)) if sharded else ():
            done[i] = done.get(i, torch.empty(shape, device=wide.device, dtype=wide.dtype))
            dist.broadcast(done[i], src=i)
        # every rank's share, padded (the last rank's may be short or empty)
        if share:
            padded = torch.zeros((share, *shape), device=wide.device, dtype=wide.dtype)
            padded[:len(mine)] = torch.stack([done[i] for i in mine]) if mine else padded[:0]
            gathered = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, padded)
            done = dict(enumerate(torch.cat(gathered)[:len(params)].unbind(0)))
        fulls = [self.neuron_normalized(done[i].mT if talls[i] else done[i], p, group) for i,
                 p in enumerate(params)]
        shards = [shard_of(full, p) for full, p in zip(fulls, params, strict=True)]
        rows, columns = params[0].shape
        params = [local(p) for p in params]
        torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        for tall in (False, True):
            chosen = [i for i, t in enumerate(talls) if t == tall]
            if chosen:
                scale = (max(rows, columns) / min(rows, columns)) ** 0.5 if tall else 1
                torch._foreach_add_([params[i] for i in chosen], [shards[i] for i in chosen],
                                    alpha=-group["lr"] * scale)

    def neuron_normalized(self, update, param, group):
        """NorMuon (Li et al. 2025): each neuron's step divided by its running RMS, then rescaled
        to the update's old norm."""
        reduce = -1 if update.size(0) >= update.size(1) else -2
        precise = update.to(torch.promote_types(update.dtype, torch.float32))
        mean_square = precise.square().mean(dim=reduce, keepdim=True)
        state = self.state[param]
        if "neuron_second_moment" not in state:
            state["neuron_second_moment"] = torch.zeros_like(mean_square)
        second_moment = state["neuron_second_moment"]
        second_moment.lerp_(mean_square, 1 - group["neuron_beta2"])
        scale = second_moment.clamp(min=1e-10).rsqrt()
        scaled = (mean_square * scale.square()).sum().clamp(min=1e-20)
        norm_ratio = (mean_square.sum() / scaled).sqrt()
        return (precise * (scale * norm_ratio)).to(update.dtype)


# -----------------------------------------------------------------------------
# Schedules: pure functions of (step, args), so a resume needs no schedule state

def decay(progress, start, end, shape, warmdown_frac):
    """From `start` to `end` as progress goes 0 -> 1."""
    progress = min(max(progress, 0.0), 1.0)
    if shape == "cosine":
        return end + (start - end) * 0.5 * (1 + math.cos(math.pi * progress))
    if shape == "linear":
        return start + (end - start) * progress
    if shape == "wsd":  # constant, then a linear warmdown over the last warmdown_frac
        flat = 1 - warmdown_frac
        if progress <= flat:
            return start
        return start + (end - start) * (progress - flat) / warmdown_frac
    return start  # constant


def lr_multiplier(step, total, args):
    """Warmup, then a decay; a two-stage schedule restarts the decay at the boundary."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    boundary = args.stage2_step
    if boundary and step >= boundary:
        return decay((step - boundary) / max(1, total - boundary), args.stage2_lr_frac,
                     args.min_lr_frac,
                     args.schedule, args.warmdown_frac)
    end = boundary or total
    return decay((step - args.warmup_steps) / max(1, end - args.warmup_steps), 1.0,
                 args.stage1_end_frac if boundary else args.min_lr_frac, args.schedule,
                 args.warmdown_frac)


def weight_decay_at(step, args):
    if args.stage2_step and step >= args.stage2_step:
        return args.stage2_weight_decay
    return args.weight_decay


def muon_momentum(step, args):
    """0.85 to 0.95 over --muon_momentum_warmup steps (nanochat's; dev/LOG.md)."""
    warmup = args.muon_momentum_warmup
    return 0.95 if step >= warmup else 0.85 + 0.10 * step / warmup


def apply_schedule(optimizers, step, total, args, scale=1.0):
    """The step's lrs (the schedule's times scale), weight decay and Muon momentum. Returns (lr
    multiplier, weight decay)."""
    multiplier = lr_multiplier(step, total, args) * scale
    wd = weight_decay_at(step, args)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * multiplier
            group["weight_decay"] = wd if group["wd_on"] else 0.0
            if isinstance(opt, Muon):
                group["momentum"] = muon_momentum(step, args)
    return multiplier, wd


def add_schedule_args(parser):
    g = parser.add_argument_group("optimization")
    g.add_argument("--optimizer", default="muon", choices=["muon", "adamw"],
                   help="muon: Muon for block matrices + AdamW for the rest; adamw: AdamW "
                        "everywhere (default: %(default)s)")
    g.add_argument("--adam8bit", action="store_true", help="bitsandbytes AdamW8bit instead of "
                   "AdamW (less optimizer memory)")
    g.add_argument("--matrix_lr", type=float, default=None, help="block matrices, at width 768 and "
                   "batch 2^19 tokens (default: 0.02 with muon, 0.003 with adamw)")
    g.add_argument("--embedding_lr", type=float, default=0.2, help="token embedding, same "
                   "reference (default: %(default)s)")
    g.add_argument("--head_lr", type=float, default=0.004, help="output head, same reference "
                   "(default: %(default)s)")
    g.add_argument("--scalar_lr", type=float, default=0.04, help="norms and other 1D parameters, "
                   "same reference (default: %(default)s)")
    g.add_argument("--muon_momentum_warmup", type=int, default=300, help="Muon's momentum rises "
                   "from 0.85 to 0.95 over this many steps; 0 = 0.95 throughout (default: "
                   "%(default)s)")
    g.add_argument("--weight_decay", type=float, default=0.0, help="decoupled weight decay of the "
                   "block matrices (default: %(default)s)")
    g.add_argument("--grad_clip", type=float, default=1.0, help="clip the global gradient norm; 0 "
                   "= off (default: %(default)s)")
    g.add_argument("--schedule", default="wsd", choices=["cosine", "linear", "wsd", "constant"],
                   help="decay shape after warmup (default: %(default)s)")
    g.add_argument("--warmup_steps", type=int, default=0, help="linear warmup steps (default: "
                   "%(default)s)")
    g.add_argument("--warmdown_frac", type=float, default=0.2, help="wsd: share of the segment "
                   "spent decaying (default: %(default)s)")
    g.add_argument("--min_lr_frac", type=float, default=0.0, help="final lr as a fraction of the "
                   "peak (default: %(default)s)")
    g.add_argument("--stage2_step", type=int, default=0, help="two-stage schedule: step where the "
                   "decay restarts and weight decay changes; 0 = one stage (default: %(default)s)")
    g.add_argument("--stage1_end_frac", type=float, default=0.667, help="two-stage: lr fraction "
                   "reached at the boundary (default: %(default)s)")
    g.add_argument("--stage2_lr_frac", type=float, default=0.667, help="two-stage: lr fraction the "
                   "second stage starts from (default: %(default)s)")
    g.add_argument("--stage2_weight_decay", type=float, default=0.0, help=
                   "two-stage: weight decay from the boundary on (default: %(default)s)")


def main(argv=None):
    parser = argparse.ArgumentParser(description="a schedule: the lr multiplier, the weight decay "
                                     "and Muon's momentum at evenly spaced steps")
    parser.add_argument("--steps", type=int, default=1000, help="the stage's steps (default: "
                        "%(default)s)")
    parser.add_argument("--points", type=int, default=11, help="how many steps to show (default: "
                        "%(default)s)")
    add_schedule_args(parser)
    args = parser.parse_args(argv)
    for step in sorted({round(i * (args.steps - 1) / max(
            1, args.points - 1)) for i in range(args.points)}):
        print(f"step {step + 1}: lr x{lr_multiplier(step, args.steps, args):.4f}, weight decay "
              f"{weight_decay_at(step, args):g}, Muon momentum {muon_momentum(step, args):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
