"""Optimizers and their schedules: parameter groups and the learning-rate rule (build_optimizers), Muon with Polar
Express's Newton-Schulz and NorMuon (Muon, newton_schulz), what runs in which dtype (precision_line), and the
schedules, a pure function of (step, args): the lr multiplier, the weight decay and Muon's momentum at each step
(apply_schedule, add_schedule_args).

Not a stage: import it (`import optim`). One command line, a schedule as the training stages apply it:

    python optim.py --steps 1000 --schedule wsd --warmdown_frac 0.2    # lr multiplier, weight decay, Muon momentum
"""
import argparse
import math
import sys

import torch
import torch.distributed as dist

from common import device_name, matmul_dtype, precision
from distributed import is_dtensor, local

# -----------------------------------------------------------------------------
# Optimizers. The rule: base learning rates are set for a width of 768 and a batch of 2^19 tokens (nanochat's
# reference point). AdamW groups scale with 1/sqrt(width/768) (wider models need smaller steps per coordinate) and
# with (batch/2^19)^(1/8). The square-root rule nanochat uses (the gradient's noise falls with sqrt(batch)) starved the
# embedding and the head at CPU batches: at 2^11 tokens (nanochat's tiny CPU shape, realtext, 300 steps) 8x its lrs
# took val bpb from 2.127 to 1.854 (dev/LOG.md: model quality). The exponent 1/8 keeps nanochat's tuned lrs at 2^19 and
# gives that measured optimum at 2^11. Muon's update is orthogonalized, so its size depends on neither the width nor
# the gradient's noise: its lr is not scaled (at 2^11 tokens, scaling it by sqrt(batch) cost 0.016 bpb; on the demo
# world at 4K-token batches it left val bpb at 1.00 after 80 steps instead of 0.66).

REF_WIDTH, REF_BATCH, BATCH_EXPONENT = 768, 2 ** 19, 1 / 8

# torch.optim imports torch._dynamo (1.1 s of CPU, 2-core Xeon) at an optimizer's first add_param_group and step, to
# keep those methods out of compiled graphs; nothing here calls them in one, so an eager stage starts without it
for method in (torch.optim.Optimizer.add_param_group, torch.optim.Optimizer.state_dict,
               torch.optim.Optimizer.load_state_dict, torch.optim.Optimizer.zero_grad):
    if hasattr(method, "__wrapped__"):  # torch._disable_dynamo's lazy wrapper: it calls what this attribute holds
        setattr(method.__wrapped__, "__dynamo_disable", method.__wrapped__)


class AdamW(torch.optim.AdamW):
    """torch's AdamW, its step under no_grad without torch's wrapper, whose `import torch._dynamo` is the above's."""

    @torch.no_grad()
    def step(self, closure=None):
        return getattr(torch.optim.AdamW.step, "__wrapped__", torch.optim.AdamW.step)(self, closure)


def param_groups(model):
    """Split parameters by role: 'matrix' (2D weights inside the blocks), 'embedding', 'value_embedding', 'head',
    'resid_lambdas', 'x0_lambdas', 'scalar' (norms and any other 1D parameter). A tied embedding (tie_embeddings:
    the head reuses wte) is in 'head': its gradient is mostly the output's (every position scores the whole
    vocabulary against it, while an input row gets gradient only where its token occurs), and at the embedding's
    lr (50x the head's) AdamW moves every coordinate of every logit's weights by that lr each step."""
    groups = {"matrix": [], "embedding": [], "value_embedding": [], "head": [], "resid_lambdas": [], "x0_lambdas": [],
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
    """Muon for the block matrices and AdamW for the rest (args.optimizer == 'muon'), or AdamW everywhere ('adamw');
    args.adam8bit swaps AdamW for bitsandbytes' AdamW8bit. Every lr is multiplied by lr_scale (a chat stage's
    fraction of its parent's). Returns a list of optimizers; every param group carries 'name' and 'base_lr' (the lr
    at multiplier 1) and 'wd_on' (whether weight decay applies)."""
    width_factor, batch_factor = (width / REF_WIDTH) ** -0.5, (batch_tokens / REF_BATCH) ** BATCH_EXPONENT
    # AdamW on the block matrices keeps the square-root rule: at 2^11 tokens, 8x its lr cost 0.036 bpb (1.899 -> 1.935)
    sqrt_factor = (batch_tokens / REF_BATCH) ** 0.5
    lrs = {"matrix": args.matrix_lr * (1 if args.optimizer == "muon" else width_factor * sqrt_factor),
           "embedding": args.embedding_lr * width_factor * batch_factor,
           "head": args.head_lr * width_factor * batch_factor,
           "scalar": args.scalar_lr * width_factor * batch_factor,
           "value_embedding": args.embedding_lr * width_factor * batch_factor / 2,  # nanochat's: half the embedding's
           # nanochat's, not scaled: scaled by the batch rule (5.8x at 2^11 tokens) one seed in three diverged to
           # +0.03 bpb; unscaled, the three agreed within 0.004
           "resid_lambdas": 0.005, "x0_lambdas": 0.5}
    lrs = {name: lr * lr_scale for name, lr in lrs.items()}
    groups = param_groups(model)
    adam_groups = [{"params": ps, "name": k, "base_lr": lrs[k], "lr": lrs[k], "wd_on": k == "matrix",
                    **({"betas": (0.96, 0.95)} if k == "x0_lambdas" else {})}  # nanochat's, for the x0 mix
                   for k, ps in groups.items() if k != "matrix" or args.optimizer == "adamw"]
    if args.adam8bit:
        try:
            import bitsandbytes
        except ImportError as e:
            raise ImportError("--adam8bit needs bitsandbytes: `pip install bitsandbytes` (CUDA only), or drop the "
                             "flag to use torch's AdamW") from e
        adam = bitsandbytes.optim.AdamW8bit(adam_groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
    else:
        # fused on CPU too: the tiny preset's AdamW step at vocab 8192 took 8.1 ms, against 41.9 foreach and 25.7 one
        # tensor at a time (torch's CPU default), on a 2-core Xeon; it takes FSDP2's DTensors (dev/LOG.md)
        adam = AdamW(adam_groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0, fused=True)
    optimizers = [adam]
    if args.optimizer == "muon":
        optimizers.append(Muon([{"params": groups["matrix"], "name": "matrix", "base_lr": lrs["matrix"],
                                 "lr": lrs["matrix"], "wd_on": True}], ns_dtype=matmul_dtype(device, width)))
    return optimizers


def precision_line(args, device, optimizers, width):
    """What runs in which dtype, and why: printed before step 1. Muon's Newton-Schulz takes the device's choice
    (common.precision) whatever --dtype says: --dtype is the model's numerics, the optimizer's matmuls need only speed."""
    muon = [g["ns_dtype"] for opt in optimizers if isinstance(opt, Muon) for g in opt.param_groups]
    chosen, why = precision(device, width)
    how = why if args.dtype == chosen else f"given or inherited; the choice here would be {chosen}, {why}"
    return (f"precision: fp32 weights, compute {args.dtype}" + (f", Muon Newton-Schulz {muon[0]}" if muon else "")
            + f" ({how}) on {device_name(device)}")


# Polar Express (Amsel et al. 2025; the coefficients modded-nanogpt and nanochat use): a different quintic a x + b x^3
# + c x^5 at each step, each the best for the singular values the steps before can leave, with a 2% safety margin
# (the input is divided by 1.02 x its Frobenius norm). 5 steps; a 6th and later reuse the last.
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))


def quintic_coefficients(steps):
    return [POLAR_EXPRESS[min(step, len(POLAR_EXPRESS) - 1)] for step in range(steps)]


def newton_schulz(stack, steps, dtype):
    """Approximately orthogonalize a stack of same-shape matrices, rows <= columns (U S V^T -> U S' V^T with S' ~ 1),
    all at once, with matmuls in `dtype`: X <- a X + (b G + c G^2) X, G = X X^T, with Polar Express's (a, b, c) at each
    step (torch.optim.Muon's iteration uses one fixed triple). torch.optim.Muon always casts to bf16, which a CPU
    without native bf16 emulates (an AVX2-only EPYC: 70% of the step). Wide matrices (columns > 1.5 x rows, an MLP's)
    take the same iteration in its Gram form (newton_schulz_gram): fewer FLOPs, the same result up to rounding. Only in
    fp32 or fp64: in bf16 the Gram matrix loses the small singular values (error 0.37 against an fp64 iteration where
    the singular values fall to 0.01 of the largest; torch's form: 0.03)."""
    x = stack.to(getattr(torch, dtype))  # in place from here on: `stack` itself when it is in `dtype` already
    x.div_(x.norm(dim=(-2, -1), keepdim=True).mul_(1.02).clamp_(min=1e-7))  # spectral norm < Frobenius norm: the basin
    rows, columns = x.shape[-2:]
    gram_flops = 4 * rows * rows * columns + (8 * steps - 6) * rows ** 3  # each form's, as newton_schulz_gram counts
    direct_flops = steps * (4 * rows * rows * columns + 2 * rows ** 3)
    if x.dtype in (torch.float32, torch.float64) and gram_flops < direct_flops:
        return newton_schulz_gram(x, steps)
    for a, b, c in quintic_coefficients(steps):
        gram = x @ x.mT  # rows x rows: the smaller Gram matrix
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b G + c G^2) x
    return x


def newton_schulz_gram(x, steps):
    """newton_schulz's iteration for normalized wide x (m rows, n columns): every step multiplies X on the left by
    P = p(G) = aI + bG + cG^2, so X_k = Q X_0 with Q = P_k ... P_1, and G_k+1 = P G_k P (P commutes with G_k). Only the
    m x m matrices G, P, Q are iterated; X is touched twice. FLOPs 4m^2n + (8 steps - 6) m^3 against steps x (4m^2n +
    2m^3): 44% fewer for the tiny MLP's 256 x 1024 (fp32: 84 -> 46 ms). In fp32 it stays within 1.1e-3 of an fp64
    iteration even where the singular values span 1e-4 (tested; 1.3e-4 with the fixed quintic of before), 200x below
    bf16's rounding of the direct form there (0.26)."""
    gram, product = x @ x.mT, None
    for step, (a, b, c) in enumerate(quintic_coefficients(steps)):
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        product = poly if product is None else poly @ product
        if step + 1 < steps:  # the last step's Gram matrix is never used
            gram = poly @ gram @ poly
    return product @ x


def whole(shard, param):
    """The whole matrix of a sharded parameter's update from each rank's shard (an all-gather); else the update."""
    if not is_dtensor(param):
        return shard
    return type(param).from_local(shard, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride()).full_tensor()


def shard_of(matrix, param):
    """This rank's rows of a whole matrix that every rank holds, laid out as `param` is sharded (no communication)."""
    if not is_dtensor(param):
        return matrix
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(matrix, param.device_mesh, param.placements, src_data_rank=None).to_local()


class Muon(torch.optim.Optimizer):
    """Muon for 2D weights: momentum (Nesterov by default; the schedule sets it, muon_momentum), the update
    orthogonalized by newton_schulz (Polar Express) in ns_dtype, then NorMuon's per-neuron normalization
    (neuron_normalized), scaled by sqrt(max(1, rows/cols)) (Keller's shape scaling, torch.optim.Muon's "original"),
    decoupled weight decay lr x wd. Tested against the rule written out in fp64 (tests/test_train.py).
    Matrices of one shape up to a transpose (an MLP's up and down projections) are orthogonalized as one stack: one
    batched matmul instead of one per matrix halves the bf16 Muon step at the tiny shape (107 -> ~55 ms; compiling
    it measured no faster). FSDP-sharded parameters: the momentum is updated on each rank's shard; Newton-Schulz needs
    whole matrices, so the updates go in rounds of one matrix per rank: each is all-gathered, rank i orthogonalizes
    the round's i-th and broadcasts it, and every rank keeps its rows of each. The compute is divided by the ranks;
    at most `world size` whole matrices are in memory at once. Under DDP (whole parameters, the same gradients on
    every rank) each rank orthogonalizes its contiguous share of a shape's stack and an all-gather gives every rank
    all of them, instead of every rank computing every matrix (divide_work=False: the old way, for comparison)."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, ns_steps=5,
                 ns_dtype="bfloat16", neuron_beta2=0.95, divide_work=True):
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov, "weight_decay": weight_decay,
                                  "ns_steps": ns_steps, "ns_dtype": ns_dtype, "neuron_beta2": neuron_beta2})
        self.divide_work = divide_work

    @torch.no_grad()
    def step(self, closure=None):  # closure: torch.distributed.checkpoint initializes state with step(closure=None)
        for group in self.param_groups:
            by_shape = {}  # (rows, columns) with rows <= columns -> the parameters of that shape or its transpose
            for p in group["params"]:
                if p.grad is not None:
                    by_shape.setdefault((min(p.shape), max(p.shape)), []).append(p)
            for same_shape in by_shape.values():
                sharded = is_dtensor(same_shape[0])  # then in rounds of one matrix per rank
                size = dist.get_world_size() if sharded else len(same_shape)
                for start in range(0, len(same_shape), size):
                    self.update(group, same_shape[start:start + size], sharded)

    def update(self, group, params, sharded):
        """Momentum, Newton-Schulz and the step for matrices of one shape up to a transpose. Sharded: rank i
        orthogonalizes params[i] and broadcasts it; every rank keeps its rows of each."""
        for p in params:
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)  # a DTensor shard for a sharded p
        buffers = [local(self.state[p]["momentum_buffer"]) for p in params]
        grads = [local(p.grad) for p in params]
        torch._foreach_lerp_(buffers, grads, 1 - group["momentum"])
        updates = torch._foreach_lerp(grads, buffers, group["momentum"]) if group["nesterov"] else buffers
        updates = [whole(u, p) for u, p in zip(updates, params, strict=True)]  # all-gathered when sharded
        talls, shape = [p.size(0) > p.size(1) for p in params], min(params[0].shape, params[0].shape[::-1])
        share = 0  # under DDP: matrices per rank, each rank the next `share` of the stack
        if not sharded and self.divide_work and dist.is_initialized() and dist.get_world_size() > 1:
            share = math.ceil(len(params) / dist.get_world_size())
            mine = range(dist.get_rank() * share, min(len(params), (dist.get_rank() + 1) * share))
        else:
            mine = [i for i in ([dist.get_rank()] if sharded else range(len(params))) if i < len(params)]
        wide = torch.empty((len(mine), *shape), device=updates[0].device, dtype=getattr(torch, group["ns_dtype"]))
        done = {}
        if mine:  # sharded, a round with fewer matrices than ranks (one value-embedding gate) leaves some rank none
            torch._foreach_copy_([w.mT if talls[i] else w for w, i in zip(wide, mine, strict=True)],
                                 [updates[i] for i in mine])  # stacked and cast in one pass
            done = dict(zip(mine, newton_schulz(wide, group["ns_steps"], group["ns_dtype"]).unbind(0), strict=True))
        for i in range(len(params)) if sharded else ():  # each result from the rank that computed it
            done[i] = done.get(i, torch.empty(shape, device=wide.device, dtype=wide.dtype))
            dist.broadcast(done[i], src=i)
        if share:  # every rank's share, padded to `share` matrices (the last rank's may be short or empty)
            padded = torch.zeros((share, *shape), device=wide.device, dtype=wide.dtype)
            padded[:len(mine)] = torch.stack([done[i] for i in mine]) if mine else padded[:0]
            gathered = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, padded)
            done = dict(enumerate(torch.cat(gathered)[:len(params)].unbind(0)))
        fulls = [self.neuron_normalized(done[i].mT if talls[i] else done[i], p, group) for i, p in enumerate(params)]
        shards = [shard_of(full, p) for full, p in zip(fulls, params, strict=True)]
        rows, columns = params[0].shape  # the first's: the others are the same or its transpose
        params = [local(p) for p in params]
        torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        for tall in (False, True):  # shape scale sqrt(max(1, rows/cols)), folded into the step as torch does
            chosen = [i for i, t in enumerate(talls) if t == tall]
            if chosen:
                scale = (max(rows, columns) / min(rows, columns)) ** 0.5 if tall else 1
                torch._foreach_add_([params[i] for i in chosen], [shards[i] for i in chosen],
                                    alpha=-group["lr"] * scale)

    def neuron_normalized(self, update, param, group):
        """NorMuon (Li et al. 2025), on the whole orthogonalized update in the parameter's orientation: each neuron's
        step (a row of a tall or square matrix, a column of a wide one: the longer side) is divided by the root of
        the running mean (beta2) of its mean square, then the whole is rescaled to the norm it had. Orthogonalization
        leaves neurons' step sizes uneven; this evens them out and keeps the update's size. The state is that running
        mean, one number per neuron, the same on every rank (every rank sees every whole update)."""
        reduce = -1 if update.size(0) >= update.size(1) else -2
        precise = update.to(torch.promote_types(update.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
        mean_square = precise.square().mean(dim=reduce, keepdim=True)
        state = self.state[param]
        if "neuron_second_moment" not in state:
            state["neuron_second_moment"] = torch.zeros_like(mean_square)
        second_moment = state["neuron_second_moment"]
        second_moment.lerp_(mean_square, 1 - group["neuron_beta2"])
        scale = second_moment.clamp(min=1e-10).rsqrt()
        norm_ratio = (mean_square.sum() / (mean_square * scale.square()).sum().clamp(min=1e-20)).sqrt()
        return (precise * (scale * norm_ratio)).to(update.dtype)


# -----------------------------------------------------------------------------
# Schedules: the learning-rate multiplier and the weight decay at each step, a pure function of (step, args), so a
# resumed run needs no schedule state beyond the step.

def decay(progress, start, end, shape, warmdown_frac):
    """Multiplier going from `start` to `end` as progress goes 0 -> 1."""
    progress = min(max(progress, 0.0), 1.0)
    if shape == "cosine":
        return end + (start - end) * 0.5 * (1 + math.cos(math.pi * progress))
    if shape == "linear":
        return start + (end - start) * progress
    if shape == "wsd":  # constant, then a linear warmdown over the last warmdown_frac
        flat = 1 - warmdown_frac
        return start if progress <= flat else start + (end - start) * (progress - flat) / warmdown_frac
    return start  # constant


def lr_multiplier(step, total, args):
    """Warmup, then one decay segment; with a stage boundary (a two-stage schedule) a second segment that
    restarts the decay at the boundary."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    boundary = args.stage2_step
    if boundary and step >= boundary:
        return decay((step - boundary) / max(1, total - boundary), args.stage2_lr_frac, args.min_lr_frac,
                     args.schedule, args.warmdown_frac)
    end = boundary or total
    return decay((step - args.warmup_steps) / max(1, end - args.warmup_steps), 1.0,
                 args.stage1_end_frac if boundary else args.min_lr_frac, args.schedule, args.warmdown_frac)


def weight_decay_at(step, args):
    return args.stage2_weight_decay if args.stage2_step and step >= args.stage2_step else args.weight_decay


def muon_momentum(step, args):
    """Muon's momentum: 0.85 rising linearly to 0.95 over the first --muon_momentum_warmup steps (nanochat's; at the
    tiny CPU shape, 3 seeds each: val bpb 1.8247 -> 1.8113 alone, 1.8169 -> 1.8063 with NorMuon)."""
    return 0.95 if step >= args.muon_momentum_warmup else 0.85 + 0.10 * step / args.muon_momentum_warmup


def apply_schedule(optimizers, step, total, args):
    multiplier, wd = lr_multiplier(step, total, args), weight_decay_at(step, args)
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
                   help="muon: Muon for block matrices + AdamW for the rest; adamw: AdamW everywhere (default: "
                        "%(default)s)")
    g.add_argument("--adam8bit", action="store_true", help="bitsandbytes AdamW8bit instead of AdamW (less optimizer memory)")
    g.add_argument("--matrix_lr", type=float, default=None, help="block matrices, at width 768 and batch 2^19 tokens "
                   "(default: 0.02 with muon, 0.003 with adamw)")
    g.add_argument("--embedding_lr", type=float, default=0.2, help="token embedding, same reference (default: "
                   "%(default)s)")
    g.add_argument("--head_lr", type=float, default=0.004, help="output head, same reference (default: %(default)s)")
    g.add_argument("--scalar_lr", type=float, default=0.04, help="norms and other 1D parameters, same reference "
                   "(default: %(default)s)")
    g.add_argument("--muon_momentum_warmup", type=int, default=300, help="Muon's momentum rises from 0.85 to 0.95 "
                   "over this many steps of the stage; 0 = 0.95 throughout (default: %(default)s)")
    g.add_argument("--weight_decay", type=float, default=0.0, help="decoupled weight decay of the block matrices "
                   "(default: %(default)s)")
    g.add_argument("--grad_clip", type=float, default=1.0, help="clip the global gradient norm; 0 = off (default: "
                   "%(default)s)")
    g.add_argument("--schedule", default="wsd", choices=["cosine", "linear", "wsd", "constant"],
                   help="decay shape after warmup (default: %(default)s)")
    g.add_argument("--warmup_steps", type=int, default=0, help="linear warmup steps (default: %(default)s)")
    g.add_argument("--warmdown_frac", type=float, default=0.2, help="wsd: share of the segment spent decaying "
                   "(default: %(default)s)")
    g.add_argument("--min_lr_frac", type=float, default=0.0, help="final lr as a fraction of the peak (default: "
                   "%(default)s)")
    g.add_argument("--stage2_step", type=int, default=0, help="two-stage schedule: step where the decay "
                   "restarts and weight decay changes; 0 = one stage (default: %(default)s)")
    g.add_argument("--stage1_end_frac", type=float, default=0.667, help="two-stage: lr fraction reached at the "
                   "boundary (default: %(default)s)")
    g.add_argument("--stage2_lr_frac", type=float, default=0.667, help="two-stage: lr fraction the second stage "
                   "starts from (default: %(default)s)")
    g.add_argument("--stage2_weight_decay", type=float, default=0.0, help="two-stage: weight decay from the boundary "
                   "on (default: %(default)s)")


def main(argv=None):
    parser = argparse.ArgumentParser(description="a schedule as the training stages apply it: the lr multiplier, the "
                                     "weight decay and Muon's momentum at evenly spaced steps")
    parser.add_argument("--steps", type=int, default=1000, help="the stage's steps (default: %(default)s)")
    parser.add_argument("--points", type=int, default=11, help="how many steps to show (default: %(default)s)")
    add_schedule_args(parser)
    args = parser.parse_args(argv)
    for step in sorted({round(i * (args.steps - 1) / max(1, args.points - 1)) for i in range(args.points)}):
        print(f"step {step + 1}: lr x{lr_multiplier(step, args.steps, args):.4f}, weight decay "
              f"{weight_decay_at(step, args):g}, Muon momentum {muon_momentum(step, args):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
