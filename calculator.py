"""The chat model's calculator: arithmetic on numbers, evaluated by walking the expression's syntax
tree, never by eval(). The model writes <|python_start|>expr<|python_end|> while answering;
generation (chat.py, chat_eval.py) calls calculate(expr) and inserts
<|output_start|>result<|output_end|> after it, as GSM8K's <<expr=result>> annotations are taught in
SFT.

    python calculator.py "12/60*50"          # 10

Allowed: numbers (ints and decimals), + - * / // % ** and unary + -, parentheses. Nothing else:
names, calls, attributes, subscripts, strings, comparisons are refused. Every step is exact
(fractions), and bounded, so a hostile expression costs microseconds and a little memory before it
is refused: at most MAX_CHARS characters, MAX_DEPTH levels of nesting, numbers of at most MAX_DIGITS
digits (operands, intermediate results and the result alike), exponents of at most MAX_EXPONENT, and
MAX_SECONDS of wall time.
"""
import argparse
import ast
import math
import operator
import time
from fractions import Fraction

MAX_CHARS = 200  # GSM8K's longest annotation is under 100 characters
# syntax-tree levels; ast.parse itself recurses, so deep nesting is refused before parsing too
MAX_DEPTH = 20
MAX_DIGITS = 30  # numerator and denominator of every value, in decimal digits
MAX_EXPONENT = 100
MAX_SECONDS = 0.1
LIMIT = 10 ** MAX_DIGITS


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


def _check(value):
    if abs(value.numerator) >= LIMIT or value.denominator >= LIMIT:
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
                          "and "
                          "parentheses")


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
    opens = {sid("<|python_start|>"): sid("<|python_end|>"), sid("<|output_start|>"): sid(
                                                                                          "<|output_end|>")}
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
    parser.add_argument("expr", help="an arithmetic expression, e.g. '12/60*50'")
    args = parser.parse_args(argv)
    try:
        print(calculate(args.expr))
    except CalculatorError as e:
        parser.exit(2, f"calculator.py: error: {e}\n")


if __name__ == "__main__":
    main()
