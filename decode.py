"""Generation, the one path: chat.py's replies (decode_step on its conversation's cache), and
decode() for rl.py's rollouts, chat_eval.py's answers, core_eval.py's and chat_stage.py's samples.

decode() prefills the prompts in one forward and decodes N replies to each, every row in one forward
per step at its own position (a greedy row equals its prompt decoded alone), each with its own
calculator; the cache is compacted when half the prompts have ended. Compiled on CUDA, eager on the
CPU and for the stages' few samples, where a first compilation costs more (dev/LOG.md).
docs/model.md (generation) says how it works. Run alone it checks greedy rows decoded together
against each prompt alone on a random-init model, and times both.

    python decode.py                              # tiny, 8 prompts of 5 to 60 tokens, 32 new each
    python decode.py --preset d12 --prompts 64 --dtype bfloat16 --device cuda

The calculator, the chat model's tool: the model writes <|python_start|>expr<|python_end|>; the
generation inserts <|output_start|>calculate(expr)<|output_end|>, as SFT teaches GSM8K's
<<expr=result>>. Arithmetic on the syntax tree, never eval(): numbers, + - * / // % ** and unary
+ -, parentheses; anything else is refused. Exact (fractions) and bounded, so a hostile expression
costs microseconds: MAX_CHARS, MAX_DEPTH, MAX_DIGITS per number, MAX_EXPONENT, MAX_SECONDS.

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
    config_from_preset,
    softcap_logits,
)


def decode_weights(model, dtype="float32"):
    """An inference-only copy of the step's weights, in the compute dtype: per block (q|k|v stacked,
    o, up, gate or None, down, value-embedding gate or None) transposed to (in, out), the head's
    likewise, the norms' scales (None when weightless), the rotary tables as (cos, cos) and (sin,
    -sin). BitNet's weights are quantized once, here."""
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
    """Layer i's attention output for q (N, H, D), one token per row, over the cache (decode_step's
    layout); valid None: no prompt part, eager (chat.py's conversation), every slot up to `step`
    attended in one fused SDPA (4-D: a 5-D query takes its slow math path)."""
    N, H, D = q.shape
    Q, K, P = prompt_k.size(1), prompt_k.size(2), prompt_k.size(3)
    S, G = N // Q, H // K
    if valid is None:
        k, v = (r[i, :, :, :, :width].transpose(1, 2).reshape(N, K, width, D)
                for r in (reply_k, reply_v))
        return F.scaled_dot_product_attention(q.view(N, H, 1, D), k, v, enable_gqa=True)
    q = q.view(Q, S, K, G, D).transpose(1, 2)  # (prompt, kv head, sample, query head of group, D)
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
    """fp32 logits (N, vocab) of token (N,) at pos (N,), rows grouped by prompt (N = prompts x
    samples). The cache: the prompts' keys and values once per prompt, prompt_k, prompt_v (layer,
    prompt, kv head, slot, head dim), prompt_valid (prompt, 1, 1, slot) marking each one's slots;
    the rows' new tokens, reply_k, reply_v (layer, prompt, kv head, sample, slot, head dim), each
    row writing at slot `step` (an int, or a (1,) tensor compiled) and attending over 0 .. step of
    width. The forward in fewer, larger ops, as a small model's CPU step is per-op overhead."""
    c, eps, dtype = model.config, model.config.norm_eps, weights["dtype"]
    H, K, D, N, Q = c.n_head, c.n_kv_head, c.head_dim, token.size(0), prompt_k.size(1)
    S = N // Q
    quantize = bitnet_activation if c.bitnet else (lambda x: x)

    def norm(x, w):  # rms_norm in 4 small ops, in fp32
        x = x * (x * x).sum(-1, keepdim=True).mul_(1 / x.size(-1)).add_(eps).rsqrt_()
        return x if w is None else x * w

    def mm(x, w):  # x @ w in the compute dtype, fp32 out
        return (quantize(x).to(dtype) @ w).float()
    # no casts: each is an op, and a small model's step is its ops
    if dtype == torch.float32 and not c.bitnet:
        mm = torch.matmul

    cos, sin = weights["cos"][pos].view(N, 1, D), weights["sin"][pos].view(N, 1, D)
    valid = None
    if prompt_k.size(3) > 0 or not isinstance(step, int):  # padding, or (compiled) slots past step
        upto = (torch.arange(width, device=token.device) <= step).expand(Q, 1, 1, width)
        valid = torch.cat([prompt_valid, upto], -1)
    x = x0 = model.wte(token)
    for i, (wqkv, wo, wup, wgate, wdown, n_attn, n_mlp, n_q, n_k, w_ve) in enumerate(
            weights["blocks"]):
        x = model.mix_embedding(i, x, x0)
        h = norm(x, n_attn)
        qkv = mm(h, wqkv)
        q_k, v = qkv[:, :(H + K) * D].view(N, H + K, D), qkv[:, (H + K) * D:].view(N, K, D)
        if w_ve is not None:  # the value embedding, gated per KV head, joins the values
            gate = 3 * torch.sigmoid(mm(h[:, :VE_GATE_CHANNELS], w_ve))
            v = v + model.value_embed(i, token).view(N, K, D) * gate.view(N, K, 1)
        if c.qk_norm and n_q is None:  # weightless: one norm over q and k rows together
            q_k = norm(q_k, None)
        elif c.qk_norm:
            q_k = torch.cat([norm(q_k[:, :H], n_q), norm(q_k[:, H:], n_k)], 1)
        # apply_rotary's (x1 cos + x2 sin, x2 cos - x1 sin) as x * (cos, cos) + (x2, x1) * (sin,
        # -sin): the same bits
        swapped = torch.cat([q_k[..., D // 2:], q_k[..., :D // 2]], -1)
        q_k = (q_k * cos + swapped * sin).to(reply_k.dtype)
        # (prompt, sample, kv head, ...) -> (prompt, kv head, sample, ...): a prompt's rows side by
        # side per head
        new_k = q_k[:, H:].view(Q, S, K, 1, D).transpose(1, 2)
        new_v = v.to(reply_v.dtype).view(Q, S, K, 1, D)
        if isinstance(step, int):  # eager: a plain slice copy (index_copy_ cost 10x more on CPU)
            reply_k[i, :, :, :, step:step + 1] = new_k
            reply_v[i, :, :, :, step:step + 1] = new_v.transpose(1, 2)
        else:  # compiled: the slot is a tensor, so the graph is not specialized on it
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
    """fp32 logits (len(rows), vocab) at each row's last token. Several rows: one forward over them
    right-padded with pad_id, as nanochat batches them, and a hook on the final norm keeps each
    row's last real position, so the head runs on one position per row. kv_cache: where the forward
    leaves its keys and values."""
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
    """Next ids (B,) from logits (B, vocab): temperature 0 is greedy; else a draw from
    softmax(logits / temperature) over the top_k likeliest (None or 0: all), taken first: a draw
    over the whole vocabulary costs like a step."""
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
    """decode_step under torch.compile, made once per process: its shapes are fixed but the batch
    (the whole cache is attended, masked), and torch.compile marks the batch dimension dynamic after
    its first change."""
    return torch.compile(decode_step, fullgraph=True)


def plain_copy(model):
    """A sharded (FSDP) model gathered into a plain copy: a collective, so all ranks call. Outside
    inference mode: FSDP2's state_dict made there leaves its parameters inference tensors, which the
    next checkpoint cannot save."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    with torch.inference_mode(False), torch.no_grad():
        plain = build_model(model.config, model.cos.device, init=False)  # every weight loaded next
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
    """The prompts in one forward: each prompt's last logits, one row per sample, and decode_step's
    cache (prompt_k, prompt_v, prompt_valid, reply_k, reply_v)."""
    device = model.cos.device
    cache = KVCache(model.config, len(prompts), max(map(len, prompts)))
    logits = last_logits(model, prompts, 0, dtype, cache)
    keys, values = cache.k, cache.v  # (layer, prompt, kv head, slot, dim)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    prompt_width = keys.size(3)
    if compiled:  # the compiled step attends whole caches: a few lengths, so few recompilations
        prompt_width, reply_width = -(-prompt_width // 64) * 64, -(-reply_width // 64) * 64
    shape = keys.shape[:3] + (prompt_width,) + keys.shape[4:]
    prompt_k, prompt_v = keys.new_zeros(shape, dtype=compute), keys.new_zeros(shape, dtype=compute)
    prompt_k[:, :, :, :keys.size(3)], prompt_v[:, :, :, :keys.size(3)] = keys, values
    prompt_valid = torch.arange(prompt_width, device=device) < lengths.view(-1, 1)
    shape = prompt_k.shape[:3] + (samples, reply_width) + prompt_k.shape[4:]
    # eager reads only the slots written so far; the compiled step reads them all, masked, and
    # 0 x NaN is NaN
    new = prompt_k.new_zeros if compiled else prompt_k.new_empty
    cache = prompt_k, prompt_v, prompt_valid.view(-1, 1, 1, prompt_width), new(shape), new(shape)
    return logits.repeat_interleave(samples, 0), cache, reply_width


@torch.inference_mode()
def decode(model, prompts, max_new_tokens, samples=1, temperature=0.0, top_k=None, seed=None,
           dtype="float32", tools=None, stop=(), compiled="auto", weights=None):
    """(tokens, sampled) per row, len(prompts) * samples rows, prompt by prompt: each row's new
    tokens, up to and with the stop token it sampled (a token in `stop`), at most max_new_tokens (an
    int, or one per prompt; the calculator's output counts), and per token whether the model sampled
    it (True) or the calculator's output was fed (False). tools: None, or one ToolUse per row.
    temperature 0 is greedy; draws come from one torch.Generator seeded with `seed` (None: random).
    compiled: "auto" (on CUDA), True or False. weights: decode_weights(), reused across calls."""
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
    live = list(range(len(prompts)))  # the prompts in the cache, in its order; their rows too
    for step in range(max(budgets)):
        drawn = sample_rows(logits, temperature, top_k, generator).tolist()
        for j, r in enumerate(r for q in live for r in range(q * samples, (q + 1) * samples)):
            if done[r]:  # ended, its prompt's other rows not yet: its draws are dropped
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
        if len(running) <= len(live) // 2:  # half the prompts have ended: keep the others only
            keep = torch.tensor(running, device=device)
            prompt_k, prompt_v, prompt_valid = prompt_k[:, keep], prompt_v[:, keep], \
                prompt_valid[keep]
            reply_k, reply_v = reply_k[:, keep], reply_v[:, keep]
            live = [live[j] for j in running]
        rows = [r for q in live for r in range(q * samples, (q + 1) * samples)]
        # every row feeds its last token at reply slot `step` (an ended row repeats its last one:
        # its results are dropped, and its position stays inside the rotary table)
        feed = torch.tensor([tokens[r][-1] for r in rows], device=device)
        pos = torch.tensor([min(len(prompts[r // samples]) + step, c.sequence_len - 1)
                            for r in rows], device=device)
        width = reply_width if compiled else step + 1  # eager: the filled reply slots only
        at = torch.tensor([step], device=device) if compiled else step
        logits = step_fn(model, weights, feed, pos, at, prompt_k, prompt_v, prompt_valid,
                         reply_k, reply_v, width)
    return tokens, sampled


# -----------------------------------------------------------------------------
# The calculator: the chat model's tool, exact arithmetic on the syntax tree


MAX_CHARS = 200  # GSM8K's longest annotation is under 100 characters
# syntax-tree levels; ast.parse itself recurses, so deep nesting is refused before parsing too
MAX_DEPTH = 20
MAX_DIGITS = 30  # numerator and denominator of every value, in decimal digits
MAX_EXPONENT = 100
MAX_SECONDS = 0.1
DIGITS_LIMIT = 10 ** MAX_DIGITS


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


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
    # digits of the result before computing it: |e| * digits(base) bounds them, so 9**100 is refused
    # without work
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
    """The value of an arithmetic expression as text: an integer ("10"), else a decimal of at most
    10 significant digits ("0.2", "3.333333333"). GSM8K writes thousands with commas (1,000), so
    commas are dropped first."""
    if not isinstance(expr, str):
        raise CalculatorError(f"an expression is a string, got {type(expr).__name__}")
    if len(expr) > MAX_CHARS:
        raise CalculatorError(f"expression of {len(expr)} characters: at most {MAX_CHARS}")
    expr = expr.replace(",", "").strip()
    depth = 0
    # parentheses nest before ast.parse sees them: refuse deep nesting without recursing into it
    for ch in expr:
        depth += (ch == "(") - (ch == ")")
        if depth > MAX_DEPTH:
            raise CalculatorError(f"nesting deeper than {MAX_DEPTH}")
    # 1_000 is a Python literal, not arithmetic anyone writes; and no dunder reaches the parser
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
    """Follows the tokens a chat model generates; after a tool call's <|python_end|>, returns the
    tokens generation must feed next: <|output_start|>result<|output_end|> (none when the calculator
    refuses the expression, so the model goes on without a result). `calls` records (expression,
    result or why it was refused)."""

    def __init__(self, tokenizer):
        sid = tokenizer.special_id
        # expr: the call's tokens so far, None outside one
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
    """The text of generated ids with the tool calls and their outputs left out: what an answer is
    scored on."""
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
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model preset, random weights (default: "
                        "%(default)s)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts decoded together (default: "
                        "%(default)s)")
    parser.add_argument("--max_new_tokens", type=int, default=32, help="greedy tokens per prompt "
                        "(default: %(default)s)")
    parser.add_argument("--compared", type=int, default=4, help="prompts also decoded alone, one "
                        "row each, the rest of the check's time (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help=
                        "compute dtype (default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help=
                        "device (default: %(default)s)")
    parser.add_argument("--calculate", metavar="EXPR", default=None, help="only the calculator: "
                        "print what it answers to EXPR, e.g. '12/60*50' (default: the check)")
    args = parser.parse_args(argv)
    if args.calculate is not None:
        try:
            print(calculate(args.calculate))
        except CalculatorError as e:
            parser.exit(2, f"decode.py --calculate: error: {e}\n")
        return 0
    if min(args.prompts, args.max_new_tokens, args.compared) < 1:
        parser.error("--prompts, --max_new_tokens and --compared must be >= 1")
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(config_from_preset(args.preset), device).eval()
    lengths = torch.randint(5, 61, (args.prompts,)).tolist()
    prompts = [torch.randint(0, model.config.vocab_size, (n,)).tolist() for n in lengths]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    compared = prompts[:args.compared]
    weights = decode_weights(model, args.dtype)
    # compiles on CUDA
    decode(model, prompts, args.max_new_tokens, dtype=args.dtype, weights=weights)
    sync()
    start = time.perf_counter()
    alone = [decode(model, [p], args.max_new_tokens, dtype=args.dtype,
                    weights=weights)[0][0] for p in compared]
    sync()
    alone_s = time.perf_counter() - start
    start = time.perf_counter()
    rows, _ = decode(model, prompts, args.max_new_tokens, dtype=args.dtype, weights=weights)
    sync()
    batch_s = time.perf_counter() - start
    same = sum(a == b for a, b in zip(rows, alone))
    print(f"{args.preset} {args.dtype} on {device}: decode() one prompt at a time "
          f"{len(compared) * args.max_new_tokens / alone_s:,.0f} tok/s; {len(prompts)} prompts "
          f"together {len(prompts) * args.max_new_tokens / batch_s:,.0f} tok/s; greedy rows equal "
          f"to one at a time: {same}/{len(compared)}")
    return 0 if args.dtype != "float32" or same == len(compared) else 1


if __name__ == "__main__":
    sys.exit(main())
