"""Generation, the one path: chat.py's replies (decode_step), and decode() for rl.py's
rollouts, chat_eval.py's answers and the stages' samples.

decode() prefills the prompts in one forward, then decodes N replies to each, all rows in one
forward per step, each at its own position (a greedy row equals its prompt decoded alone) with
its own calculator; the cache is compacted when half the prompts have ended. Compiled on CUDA,
eager on the CPU and for few samples, where compiling costs more (dev/LOG.md).

The calculator, the chat model's tool: after <|python_start|>expr<|python_end|> generation
inserts <|output_start|>calculate(expr)<|output_end|> (SFT teaches it from GSM8K's
<<expr=result>>). Exact arithmetic on the syntax tree, never eval(): numbers, + - * / // % **,
unary + -, parentheses; bounded (MAX_*), so a hostile expression costs microseconds.

    python decode.py --calculate "12/60*50"            # 10
"""
import argparse
import ast
import functools
import math
import operator
import sys
import time
from fractions import Fraction

import torch
import torch.nn.functional as F

from distributed import is_sharded
from model import (
    VE_GATE_CHANNELS,
    KVCache,
    autocast_context,
    bitnet_activation,
    build_model,
    softcap_logits,
)


def decode_weights(model, dtype="float32"):
    """An inference copy of the weights in the compute dtype: matrices as (in, out), q|k|v
    stacked, norm scales (None: weightless), rotary tables as (cos, cos) and (sin, -sin).
    BitNet's weights are quantized once, here."""
    compute = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    t = lambda linear: linear.effective_weight().detach().t().to(compute).contiguous()
    scale = lambda norm: None if norm is None or norm.weight is None else norm.weight.detach()
    blocks = []
    with torch.no_grad():
        for b in model.blocks:
            a, m = b.attn, b.mlp
            qkv = torch.cat([t(a.q_proj), t(a.k_proj), t(a.v_proj)], 1)
            blocks.append((qkv, t(a.o_proj), t(m.up_proj),
                           None if m.gate_proj is None else t(m.gate_proj),
                           t(m.down_proj), scale(b.attn_norm), scale(b.mlp_norm), scale(a.q_norm),
                           scale(a.k_norm),
                           None if a.ve_gate is None else t(a.ve_gate)))
        head = model.head_weight().detach().t().to(compute).contiguous()
    return {"blocks": blocks, "head": head, "norm_f": scale(model.norm_f), "dtype": compute,
            "cos": torch.cat([model.cos, model.cos], -1), "sin": torch.cat([model.sin, -model.sin],
                                                                           -1)}


def attend(q, i, prompt_k, prompt_v, reply_k, reply_v, valid, width):
    """Layer i's attention for q (N, H, D), one token per row, over decode_step's cache. valid
    None (eager, no prompt part): one fused 4-D SDPA (5-D takes the slow math path)."""
    N, H, D = q.shape
    Q, K, P = prompt_k.size(1), prompt_k.size(2), prompt_k.size(3)
    S, G = N // Q, H // K
    if valid is None:
        k, v = (r[i, :, :, :, :width].transpose(1, 2).reshape(N, K, width, D)
                for r in (reply_k, reply_v))
        return F.scaled_dot_product_attention(q.view(N, H, 1, D), k, v, enable_gqa=True)
    q = q.view(Q, S, K, G, D).transpose(1, 2)  # (prompt, kv head, sample, group head, D)
    to_replies = q @ reply_k[i, :, :, :, :width].transpose(-2, -1)
    scores = torch.cat([q.reshape(Q, K, S * G, D) @ prompt_k[i].transpose(-2, -1),
                        to_replies.view(Q, K, S * G, width)], -1)
    p = (scores.float() * D ** -0.5).masked_fill(~valid, float("-inf"))
    p = p.softmax(-1).to(reply_v.dtype)
    from_replies = p[..., P:].reshape(Q, K, S, G, width) @ reply_v[i, :, :, :, :width]
    y = (p[..., :P] @ prompt_v[i]).view(Q, K, S, G, D) + from_replies
    return y.transpose(1, 2)


def decode_step(model, weights, token, pos, step, prompt_k, prompt_v, prompt_valid, reply_k,
                reply_v, width):
    """fp32 logits (N, vocab) of token (N,) at pos (N,), rows grouped by prompt. Cache: prompt_k,
    prompt_v (layer, prompt, kv head, slot, dim) once per prompt, prompt_valid (prompt, 1, 1,
    slot); reply_k, reply_v (layer, prompt, kv head, sample, slot, dim), written at slot `step`
    (an int, or a (1,) tensor compiled). Few, large ops: a small model's CPU step is per-op
    overhead."""
    c, eps, dtype = model.config, model.config.norm_eps, weights["dtype"]
    H, K, D, N, Q = c.n_head, c.n_kv_head, c.head_dim, token.size(0), prompt_k.size(1)
    S = N // Q
    quantize = bitnet_activation if c.bitnet else (lambda x: x)

    def norm(x, w):  # rms_norm in fp32
        x = x * (x * x).sum(-1, keepdim=True).mul_(1 / x.size(-1)).add_(eps).rsqrt_()
        return x if w is None else x * w

    def mm(x, w):  # in the compute dtype, fp32 out
        return (quantize(x).to(dtype) @ w).float()
    # no casts: each is an op
    if dtype == torch.float32 and not c.bitnet:
        mm = torch.matmul

    cos, sin = weights["cos"][pos].view(N, 1, D), weights["sin"][pos].view(N, 1, D)
    valid = None
    if prompt_k.size(3) > 0 or not isinstance(step, int):  # padding, or compiled slots past step
        upto = (torch.arange(width, device=token.device) <= step).expand(Q, 1, 1, width)
        valid = torch.cat([prompt_valid, upto], -1)
    x = x0 = model.wte(token)
    for i, (wqkv, wo, wup, wgate, wdown, n_attn, n_mlp, n_q, n_k, w_ve) in enumerate(
            weights["blocks"]):
        x = model.mix_embedding(i, x, x0)
        h = norm(x, n_attn)
        qkv = mm(h, wqkv)
        q_k, v = qkv[:, :(H + K) * D].view(N, H + K, D), qkv[:, (H + K) * D:].view(N, K, D)
        if w_ve is not None:  # value embedding, gated per KV head
            gate = 3 * torch.sigmoid(mm(h[:, :VE_GATE_CHANNELS], w_ve))
            v = v + model.value_embed(i, token).view(N, K, D) * gate.view(N, K, 1)
        if c.qk_norm and n_q is None:  # weightless: q and k in one norm
            q_k = norm(q_k, None)
        elif c.qk_norm:
            q_k = torch.cat([norm(q_k[:, :H], n_q), norm(q_k[:, H:], n_k)], 1)
        # apply_rotary as x * (cos, cos) + (x2, x1) * (sin, -sin): the same bits
        swapped = torch.cat([q_k[..., D // 2:], q_k[..., :D // 2]], -1)
        q_k = (q_k * cos + swapped * sin).to(reply_k.dtype)
        # -> (prompt, kv head, sample, ...): a prompt's rows side by side per head
        new_k = q_k[:, H:].view(Q, S, K, 1, D).transpose(1, 2)
        new_v = v.to(reply_v.dtype).view(Q, S, K, 1, D)
        if isinstance(step, int):  # eager: a slice copy (index_copy_ costs more on CPU)
            reply_k[i, :, :, :, step:step + 1] = new_k
            reply_v[i, :, :, :, step:step + 1] = new_v.transpose(1, 2)
        else:  # compiled: a tensor slot, so the graph is not specialized on it
            reply_k[i].index_copy_(3, step, new_k)
            reply_v[i].index_copy_(3, step, new_v.transpose(1, 2))
        y = attend(q_k[:, :H], i, prompt_k, prompt_v, reply_k, reply_v, valid, width)
        x = x + mm(y.reshape(N, H * D), wo)
        h = norm(x, n_mlp)
        h = F.silu(mm(h, wgate)) * mm(h, wup) if wgate is not None else \
            F.relu_(mm(h, wup)).square_()
        x = x + mm(h, wdown)
    return softcap_logits(mm(norm(x, weights["norm_f"]), weights["head"]), c.logit_softcap)


@torch.no_grad()
def last_logits(model, rows, pad_id, dtype, kv_cache=None):
    """fp32 logits (len(rows), vocab) at each row's last token: one forward, right-padded with
    pad_id; a hook on the final norm keeps each row's last position for the head. kv_cache: where
    keys and values go."""
    device = model.cos.device
    if len(rows) == 1:
        with autocast_context(device.type, dtype):
            return model(torch.tensor(rows, device=device), kv_cache=kv_cache, last_only=True)[:,
                                                                                               -1]
    x = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    for r, ids in enumerate(rows):
        x[r, :len(ids)] = torch.tensor(ids)
    last = torch.tensor([len(ids) - 1 for ids in rows], device=device)
    hook = model.norm_f.register_forward_hook(lambda _, __, out: out[torch.arange(
            len(rows), device=device), last,
                                                                     None])
    try:
        with autocast_context(device.type, dtype):
            return model(x.to(device), kv_cache=kv_cache, last_only=True)[:, -1]
    finally:
        hook.remove()


def sample_rows(logits, temperature, top_k, generator):
    """Next ids (B,): temperature 0 is greedy, else a draw over the top_k likeliest (None or 0:
    all), cut first (a draw over the whole vocabulary costs like a step)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    if top_k and top_k < logits.size(-1):
        values, indices = torch.topk(logits, top_k, dim=-1, sorted=False)
        drawn = torch.multinomial(torch.softmax(values / temperature, dim=-1), 1,
                                  generator=generator)
        return indices.gather(-1, drawn).view(-1)
    return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1,
                             generator=generator).view(-1)


@functools.cache
def compiled_step():
    """decode_step compiled once per process; the batch turns dynamic after its first
    change."""
    return torch.compile(decode_step, fullgraph=True)


def plain_copy(model):
    """A sharded model gathered into a plain copy; all ranks call. Outside inference mode, where
    FSDP2's state_dict leaves tensors the next checkpoint cannot save."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    with torch.inference_mode(False), torch.no_grad():
        plain = build_model(model.config, model.cos.device, init=False)
        options = StateDictOptions(full_state_dict=True)
        plain.load_state_dict(get_model_state_dict(model, options=options))
    return plain


def check_decode(prompts, budgets, samples, tools, sequence_len):
    if not prompts or len(budgets) != len(prompts) or samples < 1:
        raise ValueError("decode() needs at least one prompt, one max_new_tokens per prompt and "
                         "samples >= 1")
    for p, budget in zip(prompts, budgets):
        if not p or budget < 1 or len(p) + budget > sequence_len:
            raise ValueError(f"a prompt of {len(p)} tokens with max_new_tokens {budget}: each "
                             "prompt needs at least one token, max_new_tokens >= 1, and both "
                             f"together at most sequence_len={sequence_len}; crop the prompt or "
                             "lower max_new_tokens")
    n = len(prompts) * samples
    if tools is not None and len(tools) != n:
        raise ValueError(f"tools: {len(tools)} given for {n} rows; pass one ToolUse per row, or "
                         "None")


def prefill(model, prompts, samples, reply_width, dtype, compute, compiled):
    """The prompts in one forward: last logits, a row per sample, and decode_step's cache."""
    device = model.cos.device
    cache = KVCache(model.config, len(prompts), max(map(len, prompts)))
    logits = last_logits(model, prompts, 0, dtype, cache)
    keys, values = cache.k, cache.v  # (layer, prompt, kv head, slot, dim)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    prompt_width = keys.size(3)
    if compiled:  # widths rounded up to 64: few recompilations
        prompt_width, reply_width = -(-prompt_width // 64) * 64, -(-reply_width // 64) * 64
    shape = keys.shape[:3] + (prompt_width,) + keys.shape[4:]
    prompt_k, prompt_v = keys.new_zeros(shape, dtype=compute), keys.new_zeros(shape, dtype=compute)
    prompt_k[:, :, :, :keys.size(3)], prompt_v[:, :, :, :keys.size(3)] = keys, values
    prompt_valid = torch.arange(prompt_width, device=device) < lengths.view(-1, 1)
    shape = prompt_k.shape[:3] + (samples, reply_width) + prompt_k.shape[4:]
    # the compiled step reads every slot, masked, and 0 x NaN is NaN: zeros
    new = prompt_k.new_zeros if compiled else prompt_k.new_empty
    cache = prompt_k, prompt_v, prompt_valid.view(-1, 1, 1, prompt_width), new(shape), new(shape)
    return logits.repeat_interleave(samples, 0), cache, reply_width


@torch.inference_mode()
def decode(model, prompts, max_new_tokens, samples=1, temperature=0.0, top_k=None, seed=None,
           dtype="float32", tools=None, stop=(), compiled="auto", weights=None):
    """(tokens, sampled) for len(prompts) * samples rows: each row's new tokens, through a stop
    token it sampled, at most max_new_tokens (an int or one per prompt; tool output counts), and
    per token whether the model sampled it (False: the calculator's). tools: None or a ToolUse per
    row. seed: the generator's (None: random). compiled: "auto" = on CUDA. weights:
    decode_weights(), reusable."""
    model = plain_copy(model) if is_sharded(model) else model
    device, c = model.cos.device, model.config
    budgets = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else \
        [max_new_tokens] * len(prompts)
    check_decode(prompts, budgets, samples, tools, c.sequence_len)
    n = len(prompts) * samples
    compiled = device.type == "cuda" if compiled == "auto" else compiled
    weights = weights if weights is not None else decode_weights(model, dtype)
    step_fn = compiled_step() if compiled else decode_step
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else generator.seed())
    stop = set(stop)
    logits, cache, reply_width = prefill(model, prompts, samples, max(budgets), dtype,
                                         weights["dtype"], compiled)
    prompt_k, prompt_v, prompt_valid, reply_k, reply_v = cache

    tokens, sampled, forced = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
    done = [False] * n
    live = list(range(len(prompts)))  # the prompts in the cache, in order
    for step in range(max(budgets)):
        drawn = sample_rows(logits, temperature, top_k, generator).tolist()
        for j, r in enumerate(r for q in live for r in range(q * samples, (q + 1) * samples)):
            if done[r]:  # ended: its draws are dropped
                continue
            own = not forced[r]
            token = drawn[j] if own else forced[r].pop(0)
            if own and tools is not None:
                forced[r] += tools[r](token)
            tokens[r].append(token)
            sampled[r].append(own)
            done[r] = (own and token in stop) or len(tokens[r]) >= budgets[r // samples]
        running = [j for j, q in enumerate(live) if not all(done[q * samples:(q + 1) * samples])]
        if not running:
            break
        if len(running) <= len(live) // 2:  # half have ended: compact
            keep = torch.tensor(running, device=device)
            prompt_k, prompt_v, prompt_valid = prompt_k[:, keep], prompt_v[:, keep], \
                prompt_valid[keep]
            reply_k, reply_v = reply_k[:, keep], reply_v[:, keep]
            live = [live[j] for j in running]
        rows = [r for q in live for r in range(q * samples, (q + 1) * samples)]
        # an ended row repeats its last token (dropped); its position stays in the rotary table
        feed = torch.tensor([tokens[r][-1] for r in rows], device=device)
        pos = torch.tensor([min(len(prompts[r // samples]) + step, c.sequence_len - 1)
                            for r in rows], device=device)
        width = reply_width if compiled else step + 1
        at = torch.tensor([step], device=device) if compiled else step
        logits = step_fn(model, weights, feed, pos, at, prompt_k, prompt_v, prompt_valid,
                         reply_k, reply_v, width)
    return tokens, sampled


# -----------------------------------------------------------------------------
# The calculator: the chat model's tool, exact arithmetic on the syntax tree


MAX_CHARS = 200  # GSM8K's longest annotation is under 100 characters
# ast.parse recurses, so deep nesting is refused before parsing too
MAX_DEPTH = 20
MAX_DIGITS = 30  # of every numerator and denominator
MAX_EXPONENT = 100
MAX_SECONDS = 0.1
DIGITS_LIMIT = 10 ** MAX_DIGITS


class CalculatorError(ValueError):
    """An expression refused or not evaluable."""


def _check(value):
    if abs(value.numerator) >= DIGITS_LIMIT or value.denominator >= DIGITS_LIMIT:
        raise CalculatorError(f"a value has more than {MAX_DIGITS} digits")
    return value


def _power(base, exponent):
    if exponent.denominator != 1:
        raise CalculatorError("only whole-number exponents are allowed")
    e = int(exponent)
    if abs(e) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {e} is larger than {MAX_EXPONENT}")
    if base == 0 and e < 0:
        raise CalculatorError("division by zero")
    # |e| * digits(base) bounds the result's digits: refused without work
    size = max(len(str(abs(base.numerator))), len(str(base.denominator)))
    if base not in (0, 1, -1) and abs(e) * (size - 1) > MAX_DIGITS:
        raise CalculatorError(f"a value has more than {MAX_DIGITS} digits")
    return base ** e


OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Pow: _power,
             ast.Div: operator.truediv, ast.FloorDiv: lambda a, b: Fraction(a // b),
             ast.Mod: operator.mod}


def _binary(op, a, b):
    if type(op) not in (ast.Add, ast.Sub, ast.Mult, ast.Pow) and b == 0:
        raise CalculatorError("division by zero")
    if type(op) not in OPERATORS:
        raise CalculatorError(f"operator {type(op).__name__} is not allowed: only + - * / // % **")
    return OPERATORS[type(op)](a, b)


def _walk(node, depth, deadline):
    if depth > MAX_DEPTH:
        raise CalculatorError(f"nesting deeper than {MAX_DEPTH}")
    if time.perf_counter() > deadline:
        raise CalculatorError(f"took longer than {MAX_SECONDS} s")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if type(node.value) is float:
            if not math.isfinite(node.value):
                raise CalculatorError("a number is too large")
            # the decimal as written: 0.1 is 1/10, not a binary float
            return _check(Fraction(repr(node.value)))
        return _check(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _walk(node.operand, depth + 1, deadline)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        a, b = _walk(node.left, depth + 1, deadline), _walk(node.right, depth + 1, deadline)
        return _check(_binary(node.op, a, b))
    raise CalculatorError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % ** "
                          "and parentheses")


def calculate(expr):
    """The value as text: "10", else up to 10 significant digits. Commas are dropped first:
    GSM8K writes 1,000."""
    if not isinstance(expr, str):
        raise CalculatorError(f"an expression is a string, got {type(expr).__name__}")
    if len(expr) > MAX_CHARS:
        raise CalculatorError(f"expression of {len(expr)} characters: at most {MAX_CHARS}")
    expr = expr.replace(",", "").strip()
    depth = 0
    # refuse deep nesting without recursing into it
    for ch in expr:
        depth += (ch == "(") - (ch == ")")
        if depth > MAX_DEPTH:
            raise CalculatorError(f"nesting deeper than {MAX_DEPTH}")
    # 1_000 is not arithmetic anyone writes; and no dunder reaches the parser
    if "_" in expr:
        raise CalculatorError("'_' is not allowed")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not an arithmetic expression ({type(e).__name__})") from None
    value = _walk(tree.body, 0, time.perf_counter() + MAX_SECONDS)
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.10g}"
    return text if "e" not in text else str(float(value))


class ToolUse:
    """Follows generated tokens; after <|python_end|> returns the tokens to feed next,
    <|output_start|>result<|output_end|> (none if refused). `calls` records (expression, result
    or why refused)."""

    def __init__(self, tokenizer):
        sid = tokenizer.special_id
        self.tokenizer, self.calls, self.expr = tokenizer, [], None
        self.start, self.end = sid("<|python_start|>"), sid("<|python_end|>")
        self.output = sid("<|output_start|>"), sid("<|output_end|>")

    def __call__(self, token):
        if token == self.start:
            self.expr = []
        elif self.expr is not None and token != self.end:
            self.expr.append(token)
        elif self.expr is not None:
            text, self.expr = self.tokenizer.decode(self.expr), None
            try:
                result = calculate(text)
            except CalculatorError as e:
                self.calls.append((text, f"refused: {e}"))
                return []
            self.calls.append((text, result))
            return [self.output[0], *self.tokenizer.encode(result), self.output[1]]
        return []


def reply_text(tokenizer, ids):
    """Generated text without tool calls and outputs, as answers are scored."""
    sid = tokenizer.special_id
    opens = {sid("<|python_start|>"): sid("<|python_end|>"),
             sid("<|output_start|>"): sid("<|output_end|>")}
    kept, closing = [], None
    for token in ids:
        if closing is not None:
            closing = None if token == closing else closing
        elif token in opens:
            closing = opens[token]
        else:
            kept.append(token)
    return tokenizer.decode(kept)


def main(argv=None):
    parser = argparse.ArgumentParser(description="the calculator: what it answers to EXPR")
    parser.add_argument("--calculate", metavar="EXPR", required=True,
                        help="an expression, e.g. '12/60*50'")
    args = parser.parse_args(argv)
    try:
        print(calculate(args.calculate))
    except CalculatorError as e:
        parser.exit(2, f"decode.py --calculate: error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
