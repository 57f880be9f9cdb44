"""The calculator (decode.py): exact arithmetic by an ast walk (never eval), hostile expressions refused fast, and the calculator
inside generation: a tool call's result is fed to the model as if generated, and scoring leaves calls out."""
import time

import pytest
import torch

from decode import MAX_CHARS, CalculatorError, ToolUse, calculate, decode, reply_text
from model import GPTConfig, build_model
from prepare import train_tokenizer


@pytest.mark.parametrize("expr, value", [
    ("12/60*50", "10"), ("0.2*50", "10"), ("12/60", "0.2"), ("1,000*3", "3000"), ("10/3", "3.333333333"),
    ("2**10", "1024"), ("-(3+4)", "-7"), ("7//2", "3"), ("-7//2", "-4"), ("7%3", "1"), ("0.1+0.2", "0.3"),
    ("2**-2", "0.25"), (" 48 / 2 ", "24"), ("+5-8", "-3"), ("(((1+2)))*3", "9"),
])
def test_values_are_exact(expr, value):
    assert calculate(expr) == value  # 0.1+0.2 is 0.3: decimals are exact fractions, not binary floats


HOSTILE = {
    "huge power": "9**9**9", "big power": "2**1000", "power of a big base": "99999**99", "big product":
    "10**20*10**20", "deep parentheses": "(" * 5000 + "1" + ")" * 5000, "deep unary": "-" * 150 + "1",
    "name": "x+1", "call": "__import__('os').system('echo pwned')", "dunder via attribute": "().__class__",
    "attribute": "(1).real", "string": "'a'*10", "list": "[1]*10**9", "lambda": "(lambda: 1)()", "comparison":
    "1<2", "bool": "True+1", "complex": "1j*1j", "infinity": "1e999", "100k characters": "1+" * 50_000 + "1",
    "walrus": "(x:=1)", "division by zero": "1/0", "modulo zero": "5%0", "zero to a negative power": "0**-1",
    "fractional exponent": "2**0.5", "empty": "", "statement": "import os", "underscore literal": "1_000",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_expressions_are_refused_quickly(name):
    start = time.perf_counter()
    with pytest.raises(CalculatorError):
        calculate(HOSTILE[name])
    assert time.perf_counter() - start < 0.05, name


def test_the_limits_are_the_documented_ones():
    assert calculate("9" * 29) == "9" * 29
    with pytest.raises(CalculatorError, match="more than 30 digits"):
        calculate("9" * 31)
    with pytest.raises(CalculatorError, match=f"at most {MAX_CHARS}"):
        calculate("1" + "+1" * MAX_CHARS)
    assert calculate("2**99") == str(2 ** 99)  # 30 digits
    with pytest.raises(CalculatorError, match="more than 30 digits"):
        calculate("2**100")
    with pytest.raises(CalculatorError, match="larger than 100"):
        calculate("1**101")


@pytest.fixture(scope="module")
def tok():
    words = ["what is three plus four", "it is seven", "12 + 30 = 42", "numbers 0123456789 + - * /"] * 50
    return train_tokenizer(words, 300)


def test_tool_use_answers_a_call_and_refuses_a_bad_one(tok):
    tools, sid = ToolUse(tok), tok.special_id
    call = [sid("<|python_start|>"), *tok.encode("12+30"), sid("<|python_end|>")]
    assert [tools(t) for t in call[:-1]] == [[]] * (len(call) - 1)
    assert tools(call[-1]) == [sid("<|output_start|>"), *tok.encode("42"), sid("<|output_end|>")]
    bad = [sid("<|python_start|>"), *tok.encode("9**9**9"), sid("<|python_end|>")]
    assert [tools(t) for t in bad] == [[]] * len(bad)  # refused: nothing inserted, the model goes on
    assert tools.calls[0] == ("12+30", "42") and tools.calls[1][0] == "9**9**9"
    assert tools.calls[1][1].startswith("refused: exponent")
    reply = [*tok.encode("it is "), *call, *tools.__class__(tok)(call[0]), sid("<|output_start|>"),
             *tok.encode("42"), sid("<|output_end|>"), *tok.encode("42")]
    assert reply_text(tok, reply) == "it is 42"


def test_generation_feeds_the_result_and_continues_as_a_full_forward_would(tok):
    """With the calculator on, the tokens after a call's output come from the cache that holds the output: greedy
    generation agrees token for token with greedy argmax over full forwards of everything so far."""
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=tok.vocab_size, sequence_len=64, n_layer=2, n_embd=64, n_head=2,
                                  n_kv_head=2)).eval()
    sid = tok.special_id
    start, end = sid("<|python_start|>"), sid("<|python_end|>")
    # after the first sampled token, a call of "3+4" as if the model had written it; the calculator answers it
    inner, called = ToolUse(tok), []

    def tools(token):
        if called:
            return []
        called.append(token)
        return [f for t in [start, *tok.encode("3+4"), end] for f in [t, *inner(t)]]
    prompt = [tok.bos_id, *tok.encode("what is three plus four")]
    out = decode(model, [prompt], 20, tools=[tools])[0][0]
    assert len(out) == 20 and inner.calls == [("3+4", "7")]
    call = [start, *tok.encode("3+4"), end, sid("<|output_start|>"), *tok.encode("7"), sid("<|output_end|>")]
    assert out[1:1 + len(call)] == call  # the call, then the result right after <|python_end|>
    sampled = [0, *range(1 + len(call), len(out))]
    for i in sampled:  # each sampled token is the argmax of a full forward over everything before it
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out[:i]]))[0, -1]
        assert out[i] == int(logits.argmax()), i


def test_the_calculate_flag_prints_the_answer_or_one_line_naming_the_refusal(capsys):
    import decode
    assert decode.main(["--calculate", "12/60*50"]) == 0
    assert capsys.readouterr().out == "10\n"
    with pytest.raises(SystemExit) as exit_info:
        decode.main(["--calculate", "__import__('os')"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("decode.py --calculate: error: ") and err.count("\n") == 1
