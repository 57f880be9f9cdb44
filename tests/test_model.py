"""model.py: exact accounting, init, precision, chunked loss, BitNet, KV cache, checkpointing, bad input."""
import math
import os
import random
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_in_process

import model as M
from decode import decode
from model import GPT, GPTConfig, KVCache, autocast_context, build_model, config_from_preset

ROOT = Path(__file__).resolve().parent.parent


def small(**overrides):
    base = {"vocab_size": 512, "sequence_len": 128, "n_layer": 2, "n_embd": 64, "n_head": 4, "n_kv_head": 4}
    base.update(overrides)
    return GPTConfig(**base)


def meta_model(config):
    with torch.device("meta"):
        return GPT(config)


# --- accounting -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "llama3-1b", "bitnet-95m", "d1", "d12", "d20", "d26"])
def test_param_formula_equals_built_model_for_presets(name):
    config = config_from_preset(name)
    assert sum(p.numel() for p in meta_model(config).parameters()) == M.num_params(config)


def test_seed_parameter_counts_are_exact():
    assert M.num_params(config_from_preset("llama3-1b")) == 1_241_581_568  # the measured 1.2B run's count
    assert M.num_params(config_from_preset("bitnet-95m")) == 95_367_936  # the measured BitNet run's count


def test_token_budget_counts_every_parameter_but_the_value_embedding_tables():
    config = config_from_preset("d20")
    tables = sum(p.numel() for n, p in meta_model(config).named_parameters() if n.startswith("value_embeds."))
    assert M.budget_params(config) == M.num_params(config) - tables == 560_989_400  # + VE gates, resid scalars
    assert M.budget_params(config_from_preset("llama3-1b")) == M.num_params(config_from_preset("llama3-1b"))


def test_param_formula_equals_built_model_for_random_configs():
    rng = random.Random(0)
    for _ in range(40):
        head_dim = rng.choice([8, 16, 32])
        n_kv_head = rng.choice([1, 2, 3])
        n_head = n_kv_head * rng.choice([1, 2, 4])
        config = GPTConfig(vocab_size=rng.randint(50, 3000), sequence_len=64, n_layer=rng.randint(1, 5),
                           n_embd=rng.choice([head_dim * n_head, 48, 96]), n_head=n_head, n_kv_head=n_kv_head,
                           head_dim=head_dim, mlp=rng.choice(["relu2", "swiglu"]), mlp_hidden=rng.choice([0, 100]),
                           norm_learnable=rng.random() < 0.5, qk_norm=rng.random() < 0.5,
                           tie_embeddings=rng.random() < 0.5, bitnet=rng.random() < 0.3,
                           value_embeds=rng.random() < 0.5)
        model = meta_model(config)
        breakdown = M.param_breakdown(config)
        assert sum(p.numel() for p in model.parameters()) == breakdown["total"], config
        norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
        assert norms == breakdown["norms"], config


def test_flops_formula_counts_every_matmul_weight():
    for config in (config_from_preset("d12"), config_from_preset("llama3-1b"), small(n_kv_head=2, mlp="swiglu")):
        model = meta_model(config)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        matmul = linear + (config.vocab_size * config.n_embd if config.tie_embeddings else 0)
        T = config.sequence_len
        expected = 6 * matmul + 12 * config.n_layer * config.n_head * config.head_dim * T
        assert M.flops_per_token(config) == expected
    # d12 by hand: 12 layers x 12*768^2 block matrices + 6 value-embedding gates of 12 x 6 + 65536*768 head,
    # attention 12*12*6*128*2048; the 6 value-embedding tables (layers 1, 3, .., 11) are lookups
    assert M.flops_per_token(config_from_preset("d12")) == (6 * (12 * 12 * 768**2 + 6 * 12 * 6 + 65536 * 768)
                                                            + 12 * 12 * 768 * 2048)
    assert M.param_breakdown(config_from_preset("d12"))["value_embeds"] == 6 * 65536 * 768


def saved_activation_bytes(config, batch, dtype):
    """What autograd really holds after a forward pass, measured with saved-tensor hooks (storages counted once)."""
    model = build_model(config)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    idx = torch.randint(0, config.vocab_size, (batch, config.sequence_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_context("cpu", dtype):
        model(idx, idx)
    return sum(seen.values())


@pytest.mark.parametrize("overrides", [{}, {"mlp": "swiglu", "n_kv_head": 2}, {"norm_learnable": True},
                                       {"bitnet": True, "mlp": "swiglu"}, {"bitnet": True},
                                       {"activation_checkpointing": True},
                                       {"qk_norm": False, "tie_embeddings": True, "head_dim": 32, "n_kv_head": 2}])
def test_activation_estimate_matches_saved_tensors(overrides):
    config = config_from_preset("tiny", {"n_layer": 2, "sequence_len": 128, **overrides})
    for dtype in ("float32", "bfloat16"):
        measured = saved_activation_bytes(config, 2, dtype)
        estimate = M.memory_estimate(config, 2, bf16=dtype == "bfloat16")["activations"]
        assert abs(estimate - measured) / measured < 0.02, (dtype, estimate, measured)


def test_memory_estimate_components():
    config = config_from_preset("llama3-1b")
    est = M.memory_estimate(config, 16, optimizer="adamw")
    P = 1_241_581_568
    assert (est["weights"], est["gradients"], est["optimizer"]) == (4 * P, 4 * P, 8 * P)
    assert est["total"] == 16 * P + est["activations"] + est["transient"]
    ckpt = M.memory_estimate(config_from_preset("llama3-1b", {"activation_checkpointing": True}), 16)
    assert ckpt["activations"] < est["activations"] / 5


def test_memory_estimate_counts_the_loss_chunk_of_its_device():
    """The loss's chunk is 2^28 logits on CUDA and 2^25 on the CPU (model.loss_chunk_elements): d20 (vocabulary
    65,536, width 1280) at 32 x 2048 tokens, chunks of 4,096 and 512 rows. The transient: a chunk's fp32 logits,
    probabilities and tanh (3 x 4 bytes x rows x vocab) + the fp32 head gradient's second copy (4 x vocab x width)."""
    config = config_from_preset("d20")
    head = 4 * 65536 * 1280  # 335,544,320
    cuda, cpu = (M.memory_estimate(config, 32, device_type=device) for device in ("cuda", "cpu"))
    assert cuda["transient"] == 3 * 4 * 4096 * 65536 + head == 3_556_769_792  # 3.3 GiB
    assert cpu["transient"] == 3 * 4 * 512 * 65536 + head == 738_197_504
    assert cuda["total"] - cpu["total"] == 3_556_769_792 - 738_197_504
    assert M.memory_estimate(config, 32) == cuda  # a GPU's estimate unless told
    assert M.memory_estimate(config, 32, device_type="mps") == cpu  # any other device: the CPU's chunk


def test_building_and_training_a_model_eagerly_imports_neither_dynamo_nor_sympy(tmp_path):
    """A process that builds a model and compiles nothing (chat.py, an evaluation) starts without torch._dynamo
    (~2 s) or sympy (~0.4 s): build_model's meta construction and to_empty stay off torch's reference kernels. An eager
    training step with Muon and AdamW, the loss included, and the optimizers' state_dict do not import them either,
    nor, on a CPU with native bf16, the precision probe of a first start (an empty $NANOCHAT_CACHE: with a warm one
    the probe would not run, and the test would pass or fail by what an earlier run left there)."""
    program = ("import sys, argparse, torch, model, optim; m = model.build_model(model.GPTConfig(), 'cpu'); "
               "print(sorted(n for n in ('torch._dynamo', 'sympy') if n in sys.modules), bool(m.lm_head.weight.std() > 0)); "
               "a = argparse.Namespace(matrix_lr=0.02, embedding_lr=0.3, head_lr=0.004, scalar_lr=0.5, optimizer='muon', "
               "adam8bit=False); opts = optim.build_optimizers(m, a, 768, 2048, torch.device('cpu')); "
               "x = torch.randint(0, 100, (1, 8)); m(x, targets=x).backward(); [o.step() for o in opts]; "
               "[(o.zero_grad(), o.state_dict()) for o in opts]; print(sorted(n for n in ('torch._dynamo', 'sympy') "
               "if n in sys.modules), [len(o.state) > 0 for o in opts])")
    out = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "NANOCHAT_CACHE": str(tmp_path)}).stdout
    assert out == "[] True\n[] [True, True]\n"


def test_a_loaded_checkpoint_skips_the_random_init_and_computes_the_rotary_tables(tmp_path, monkeypatch):
    """load_model draws no random weights (init_weights: 4.3 s at d12 on a 2-core Xeon, overwritten at once); the
    weights are the saved ones and the rotary tables, never saved, equal a fresh model's."""
    import json
    from dataclasses import asdict

    import checkpoint
    torch.manual_seed(0)
    saved = build_model(small())
    (tmp_path / "ckpt").mkdir()
    torch.save(saved.state_dict(), tmp_path / "ckpt" / "model.pt")
    (tmp_path / "ckpt" / "meta.json").write_text(json.dumps({"model_config": asdict(saved.config)}))
    monkeypatch.setattr(GPT, "init_weights", lambda self: pytest.fail("a loaded model drew random weights"))
    loaded, _ = checkpoint.load_model(tmp_path / "ckpt", torch.device("cpu"))
    assert all(torch.equal(tensor, loaded.state_dict()[name]) for name, tensor in saved.state_dict().items())
    assert torch.equal(loaded.cos, saved.cos) and torch.equal(loaded.sin, saved.sin) and saved.cos.abs().sum() > 0


def test_cli_prints_exact_counts(capsys):
    as_user = subprocess.run([sys.executable, "model.py", "--preset", "llama3-1b"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout  # once as a user runs it, then in-process
    code, in_process, _ = run_in_process(M.main, ["--preset", "bitnet-95m"], capsys)
    assert code == 0
    for out, count in ((as_user, 1241581568), (in_process, 95367936)):
        assert f"params: {count}\n" in out
        for part in ("embeddings", "attention", "mlp", "norms", "head", "FLOPs/token", "activations"):
            assert part in out


# --- bad input --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,overrides,fragments", [
    ("d13x", {}, ["unknown preset 'd13x'", "llama3-1b", "d<N>"]),
    ("d12", {"n_head": 5}, ["n_embd=768", "n_head=5", "1, 2, 3, 4, 6, 8"]),
    ("d12", {"n_kv_head": 4}, ["n_head=6", "n_kv_head=4", "1, 2, 3, 6"]),
    ("tiny", {"n_layers": 3}, ["unknown model field 'n_layers'", "n_layer", "sequence_len"]),
    ("tiny", {"mlp": "gelu"}, ["mlp='gelu'", "relu2, swiglu"]),
])
def test_bad_config_names_field_and_allowed_values(name, overrides, fragments):
    with pytest.raises(ValueError) as err:
        config_from_preset(name, overrides)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_cli_bad_input_is_one_line(capsys):
    for args, fragment in ((["--preset", "d12", "--n_head", "5"], "n_head=5"),
                           (["--preset", "tiny", "--n_layr", "3"], "model fields are vocab_size"),
                           (["--preset", "gpt5"], "allowed presets are")):
        code, _, err = run_in_process(M.main, args, capsys)
        assert code == 2 and err.count("\n") == 1 and fragment in err


def test_cli_overrides_every_field():
    parser = M.argparse.ArgumentParser()
    M.add_model_args(parser)
    args = M.parse_args(parser, ["--preset", "d4", "--n_layer", "3", "--qk_norm", "false", "--mlp", "swiglu"])
    config = M.config_from_args(args)
    assert (config.n_layer, config.qk_norm, config.mlp, config.n_embd) == (3, False, "swiglu", 256)
    assert {a.dest for a in parser._actions} >= {f.name for f in fields(GPTConfig)}


# --- init, precision --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True, "norm_learnable": True, "mlp": "swiglu"},
                                       {"bitnet": True, "tie_embeddings": True}, {"n_embd": 512, "n_head": 8}])
def test_init_loss_is_log_vocab(overrides):
    torch.manual_seed(0)
    config = config_from_preset("tiny", overrides)
    model = build_model(config)
    idx = torch.randint(0, config.vocab_size, (8, config.sequence_len))
    targets = torch.randint(0, config.vocab_size, (8, config.sequence_len))
    with torch.no_grad():
        loss = model(idx, targets).item()
    assert abs(loss - math.log(config.vocab_size)) < 0.1


def test_tied_1b_width_init_loss():
    # llama3-1b's widths and tying (vocab cut to keep CPU time small): the tied init must not inflate the first loss
    torch.manual_seed(0)
    config = config_from_preset("llama3-1b", {"n_layer": 1, "vocab_size": 8192, "sequence_len": 64,
                                              "mlp_hidden": 256})
    model = build_model(config)
    idx = torch.randint(0, config.vocab_size, (2, 64))
    with torch.no_grad():
        assert abs(model(idx, idx.roll(1, 1)).item() - math.log(8192)) < 0.1


def test_build_on_meta_then_materialize():
    config = config_from_preset("llama3-1b")
    model = build_model(config, device="meta")  # a 1B model: no memory touched, formula still exact
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 1_241_581_568
    tiny = build_model(config_from_preset("tiny"))
    assert not any(p.is_meta for p in tiny.parameters()) and torch.isfinite(tiny.cos).all()
    assert all(p.dtype == torch.float32 for p in tiny.parameters())


def adamw_steps(model, steps, dtype, lr=3e-4):
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    idx = torch.randint(0, model.config.vocab_size, (4, 64))
    for _ in range(steps):
        with autocast_context("cpu", dtype):
            loss = model(idx, idx.roll(-1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_bf16_compute_updates_every_parameter():
    # small enough for a CPU whose bf16 matmuls are emulated (AVX2 only: ~100x slower than fp32)
    config = config_from_preset("tiny", {"norm_learnable": True, "sequence_len": 64, "n_layer": 2, "n_embd": 64,
                                         "n_head": 2, "n_kv_head": 2, "vocab_size": 256})
    torch.manual_seed(0)
    model = build_model(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adamw_steps(model, 20, "bfloat16")
    frozen = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert frozen == []
    M.check_master_weights(model)
    # the bug itself, reproduced: bf16 *parameters* freeze every norm scale at 1.0, and the guard names them
    torch.manual_seed(0)
    broken = build_model(config).to(torch.bfloat16)
    norms_before = {n: p.detach().clone() for n, p in broken.named_parameters() if "norm" in n}
    adamw_steps(broken, 20, "bfloat16")
    assert all(torch.equal(p, norms_before[n]) for n, p in broken.named_parameters() if "norm" in n)
    with pytest.raises(ValueError, match="fp32 master weights.*norm"):
        M.check_master_weights(broken)


# --- the loss ---------------------------------------------------------------------------------------------------

def test_compiling_the_model_leaves_the_loss_chunks_out_of_its_graph(monkeypatch):
    """Under torch.compile the chunk loop runs outside the model's graph and calls one chunk function (compiled on its
    own in a real run): the model's graph is the same size at 1 chunk and at 16, where unrolling the loop into it made
    compilation grow with the vocabulary; the loss and gradients equal the uncompiled model's."""
    nodes, chunk_rows = [], []

    def backend(graph_module, example_inputs):  # counts what dynamo captured, runs it as traced
        nodes.append(len(graph_module.graph.nodes))
        return graph_module.forward

    def chunk(*args):
        chunk_rows.append(args[0].size(0))
        return M.loss_chunk(*args)

    monkeypatch.setattr(M, "compiled_loss_chunk", lambda: chunk)
    monkeypatch.setitem(M.LOSS_CHUNK_ELEMENTS, "cuda", 512 * 300 // 7)  # not this device's: 7 chunks would say so
    captured = {}
    for chunks in (1, 16):
        # 3 x 100 rows over the vocabulary of 512 (the CPU's chunk size: this test runs there)
        monkeypatch.setitem(M.LOSS_CHUNK_ELEMENTS, "cpu", 512 * 300 // chunks)
        torch._dynamo.reset()
        nodes.clear(), chunk_rows.clear()
        torch.manual_seed(0)
        model = build_model(small(logit_softcap=15.0))
        idx, targets = torch.randint(0, 512, (3, 100)), torch.randint(0, 512, (3, 100))
        targets[0, :40] = -1
        loss = torch.compile(model, backend=backend)(idx, targets)
        loss.backward()
        compiled_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        eager = model(idx, targets)
        eager.backward()
        assert len(chunk_rows) == chunks and sum(chunk_rows) == 300
        assert torch.allclose(loss, eager, atol=1e-6, rtol=0)
        for n, p in model.named_parameters():
            assert torch.allclose(compiled_grads[n], p.grad, atol=1e-6, rtol=1e-5), n
        captured[chunks] = sum(nodes)
    assert captured[1] == captured[16] > 0


@pytest.mark.parametrize("softcap", [0.0, 15.0])
@pytest.mark.parametrize("tied", [False, True])
def test_chunked_loss_and_grads_equal_naive(softcap, tied, monkeypatch):
    # 37 rows per chunk on the CPU, where this runs: many chunks, a ragged last one
    monkeypatch.setitem(M.LOSS_CHUNK_ELEMENTS, "cpu", 512 * 37)
    torch.manual_seed(0)
    model = build_model(small(logit_softcap=softcap, tie_embeddings=tied))
    if not tied:  # move the head off its near-zero init so the softcap's curvature matters
        torch.nn.init.normal_(model.lm_head.weight, std=0.5)
    idx = torch.randint(0, 512, (3, 100))
    targets = torch.randint(0, 512, (3, 100))
    targets[0, :40] = -1
    targets[2, 7] = -1

    loss = model(idx, targets)
    loss.backward()
    chunked = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(idx)  # full (B, T, V) logits, softcap applied, then plain cross-entropy
    naive = F.cross_entropy(logits.view(-1, 512), targets.view(-1), ignore_index=-1)
    naive.backward()
    assert torch.allclose(loss, naive, atol=1e-5, rtol=0)
    for n, p in model.named_parameters():
        assert torch.allclose(chunked[n], p.grad, atol=1e-5, rtol=1e-5), n

    with torch.no_grad():
        per_token = model(idx, targets, reduction="none")
        assert torch.allclose(per_token.sum(), model(idx, targets, reduction="sum"), atol=1e-4)
        assert (per_token[targets == -1] == 0).all()
        assert torch.allclose(per_token.sum() / (targets != -1).sum(), naive, atol=1e-5)
        # predictions: the argmax of the full logits where a target exists, -1 elsewhere
        losses, predicted = model(idx, targets, reduction="none", predictions=True)
        assert torch.equal(losses, per_token)
        expected = torch.where(targets != -1, logits.argmax(-1), -1)
        assert torch.equal(predicted, expected) and (predicted != -1).any()


def test_loss_with_no_valid_target_is_zero_not_nan():
    model = build_model(small())
    idx = torch.randint(0, 512, (2, 16))
    loss = model(idx, torch.full((2, 16), -1))
    loss.backward()
    assert loss.item() == 0.0 and all(torch.isfinite(p.grad).all() for p in model.parameters())



@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_loss_without_grad_mode_costs_only_the_forward_head(grad_mode):
    """Under no_grad/inference_mode the chunked loss must not push gradients through the head: its FLOPs equal
    those of computing the logits (one head matmul), not three (logits, grad of the input, grad of the weight)."""
    from torch.utils.flop_counter import FlopCounterMode
    model = build_model(small(vocab_size=4096))
    idx = torch.randint(0, 4096, (2, 64))

    def flops(fn):
        with grad_mode(), FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()
    logits_only = flops(lambda: model(idx))
    assert flops(lambda: model(idx, idx, reduction="sum")) == flops(lambda: model(idx, idx)) == logits_only
    head = 2 * 2 * 64 * 64 * 4096  # one (B*T x n_embd) @ (n_embd x vocab)
    with FlopCounterMode(display=False) as with_grad:
        model(idx, idx)
    assert with_grad.get_total_flops() == logits_only + 2 * head  # with grad: grad_x and grad_w in the forward

# --- BitNet -----------------------------------------------------------------------------------------------------

def test_bitnet_effective_weights_are_ternary():
    torch.manual_seed(0)
    model = build_model(config_from_preset("tiny", {"bitnet": True, "mlp": "swiglu", "n_kv_head": 2}))
    linears = [m for m in model.blocks.modules() if isinstance(m, M.Linear)]
    assert len(linears) == 4 * 7 + 2  # and the gates of the 2 value embeddings
    for layer in linears:
        w = layer.effective_weight().detach()
        scale = layer.weight.abs().mean()
        levels = torch.stack([-scale, torch.zeros(()), scale])
        assert ((w.unsqueeze(-1) - levels).abs().amin(-1) < 1e-6).all()  # every value one of three levels
        if layer.weight.numel() > 1000:  # a projection (the gates start all positive: {0, +scale})
            assert len(torch.unique(w)) == 3
    x = torch.randn(5, 256)
    q = M.bitnet_activation(x) * (127.0 / x.abs().amax(-1, keepdim=True))
    assert torch.allclose(q, q.round(), atol=1e-4) and q.abs().max() <= 127.0001  # 8-bit levels per token


def test_bitnet_gradients_pass_straight_through():
    torch.manual_seed(0)
    layer = M.Linear(16, 8, bitnet=True)
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).sum().backward()
    w_q = M.bitnet_weight(layer.weight.detach())
    assert torch.allclose(layer.weight.grad, torch.ones(4, 8).t() @ M.bitnet_activation(x.detach()))
    assert torch.allclose(x.grad, torch.ones(4, 8) @ w_q)


def test_bitnet_overfits_one_batch():
    torch.manual_seed(0)
    config = config_from_preset("tiny", {"bitnet": True, "mlp": "swiglu", "tie_embeddings": True,
                                         "norm_learnable": True, "n_layer": 2, "vocab_size": 256, "n_embd": 128,
                                         "n_head": 2, "n_kv_head": 2})
    model = build_model(config)
    idx = torch.randint(0, 256, (4, 64))
    targets = idx.roll(-1, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):  # measured: 5.60 -> 0.044
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 10, (losses[0], losses[-1])


# --- KV cache and generation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_kv_head", [4, 2])  # MHA, GQA
def test_kv_cache_matches_recomputation(n_kv_head):
    torch.manual_seed(0)
    model = build_model(small(n_kv_head=n_kv_head, sequence_len=96)).eval()
    with torch.no_grad():
        for p in model.parameters():  # a random model's logits are ~0; widen them so argmax is meaningful
            p.add_(torch.randn_like(p) * 0.05)
    prompt = torch.randint(0, 512, (1, 20))
    cache = KVCache(model.config, batch_size=1, max_len=96)
    seq = prompt
    with torch.no_grad():
        cached = model(prompt, kv_cache=cache)[:, -1]
        for _ in range(64):
            full = model(seq)[:, -1]
            assert torch.allclose(cached, full, atol=1e-4, rtol=0)
            next_id = full.argmax(-1, keepdim=True)
            assert torch.equal(cached.argmax(-1, keepdim=True), next_id)
            seq = torch.cat([seq, next_id], dim=1)
            cached = model(next_id, kv_cache=cache)[:, -1]
    assert cache.pos == 84
    assert decode(model, [prompt[0].tolist()], 64)[0][0] == seq[0, 20:].tolist()  # decode.py's one row, the same


def test_kv_cache_prefill_in_pieces():
    torch.manual_seed(0)
    model = build_model(small(n_kv_head=2)).eval()
    ids = torch.randint(0, 512, (2, 30))
    cache = KVCache(model.config, batch_size=2, max_len=30)
    with torch.no_grad():
        first = model(ids[:, :12], kv_cache=cache)
        second = model(ids[:, 12:], kv_cache=cache)  # 18 queries at positions 12..29 against a 30-long cache
        full = model(ids)
    assert torch.allclose(torch.cat([first, second], 1), full, atol=1e-5)


class Forcing:
    """A stand-in for decode.ToolUse with the same contract: after each sampled `trigger` it returns `forced`,
    the tokens generation must feed next (a tool call's result)."""

    def __init__(self, trigger, forced):
        self.trigger, self.forced, self.calls = trigger, forced, 0

    def __call__(self, token):
        self.calls += token == self.trigger
        return list(self.forced) if token == self.trigger else []


def one_row(model, prompt, budget, stop=(), tools=None):
    """decode()'s greedy tokens for one prompt alone, one row, up to and with the first stop token."""
    return decode(model, [prompt], budget, stop=stop, tools=None if tools is None else [tools])[0][0]


@pytest.mark.parametrize("overrides", [{}, {"n_kv_head": 2, "mlp": "swiglu", "norm_learnable": True,
                                            "value_embeds": True, "resid_lambdas": True},
                                       {"bitnet": True, "tie_embeddings": True, "logit_softcap": 0.0}])
def test_batched_greedy_decoding_equals_one_row_at_a_time(overrides):
    """decode.decode over prompts of different lengths, two rows per prompt, equals each prompt decoded alone,
    token for token: without tools, with a tool whose forced tokens enter one row only (rows then differ in length
    and position), and with stop tokens that end rows early (the cache is compacted as they end)."""
    import decode as D
    torch.manual_seed(0)
    model = build_model(small(**overrides)).eval()
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (7, 1, 33, 12, 20)]
    budgets = [40, 25, 40, 60, 3]
    plain = [one_row(model, p, b) for p, b in zip(prompts, budgets)]
    tokens, sampled = D.decode(model, prompts, budgets, samples=2)
    assert tokens == [t for t in plain for _ in range(2)] and all(all(s) for s in sampled)
    assert [len(t) for t in tokens[::2]] == budgets
    # a trigger that appears in some replies only; its forced tokens count against the budget
    trigger = next(t for t in plain[0][2:] if t not in plain[2])
    forced = [3, 1, 4, 1, 5]
    expected = [one_row(model, p, b, tools=Forcing(trigger, forced)) for p, b in zip(prompts, budgets)]
    rows = [Forcing(trigger, forced) for _ in range(2 * len(prompts))]
    tokens, sampled = D.decode(model, prompts, budgets, samples=2, tools=rows)
    assert tokens == [t for t in expected for _ in range(2)]
    assert expected[0] != plain[0] and expected[2] == plain[2] and rows[0].calls >= 1 and rows[4].calls == 0
    first = expected[0].index(trigger) + 1
    assert sampled[0][first:first + len(forced)] == [False] * len(forced) and sampled[0][:first] == [True] * first
    # stop tokens: each row ends at the first it samples, the stop token kept
    stop = {plain[3][2], plain[2][10]}
    expected = [one_row(model, p, b, stop=stop) for p, b in zip(prompts, budgets)]
    assert len(expected[3]) <= 3 and len(expected[2]) <= 11
    tokens, _ = D.decode(model, prompts, budgets, samples=2, stop=stop)
    assert tokens == [t for t in expected for _ in range(2)]


def test_the_fixed_shape_step_cuda_compiles_gives_the_same_greedy_rows(monkeypatch):
    """The step as CUDA runs it (whole caches attended and masked, widths rounded up to 64, the slot a tensor), here
    uncompiled on the CPU: the same greedy rows as the eager step one row at a time, tool and stop tokens included."""
    import decode as D
    monkeypatch.setattr(D, "compiled_step", lambda: D.decode_step)
    torch.manual_seed(0)
    model = build_model(small(n_kv_head=2)).eval()
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (7, 1, 33)]
    plain = [one_row(model, p, 30) for p in prompts]
    trigger, stop = plain[0][3], {plain[1][5]}
    expected = [one_row(model, p, 30, stop=stop, tools=Forcing(trigger, [9, 8, 7])) for p in prompts]
    tokens, _ = D.decode(model, prompts, 30, samples=2, stop=stop, compiled=True,
                         tools=[Forcing(trigger, [9, 8, 7]) for _ in range(6)])
    assert tokens == [t for t in expected for _ in range(2)] and expected != plain


def test_batched_sampling_is_seeded_and_its_rows_differ():
    import decode as D
    torch.manual_seed(0)
    model = build_model(small()).eval()
    prompts = [[1, 2, 3], list(range(10, 30))]
    a, _ = D.decode(model, prompts, 30, samples=4, temperature=1.0, top_k=50, seed=7)
    b, _ = D.decode(model, prompts, 30, samples=4, temperature=1.0, top_k=50, seed=7)
    c, _ = D.decode(model, prompts, 30, samples=4, temperature=1.0, top_k=50, seed=8)
    assert a == b and a != c and len(a) == 8 and all(len(t) == 30 for t in a)
    assert len({tuple(t) for t in a}) == 8  # each row samples its own reply
    greedy, _ = D.decode(model, prompts, 10, samples=2)
    assert D.decode(model, prompts, 10, samples=2, temperature=1.0, top_k=1, seed=3)[0] == greedy
    with pytest.raises(ValueError, match="sequence_len=128"):
        D.decode(model, prompts, 120)
    logits, generator = torch.tensor([[0.0, 5.0, 4.0, -1.0]]), torch.Generator().manual_seed(0)
    draws = {D.sample_rows(logits, 1.0, 2, generator).item() for _ in range(200)}
    assert draws == {1, 2}  # top-k 2 keeps exactly the two largest


def test_batched_decoding_in_bf16_follows_the_bf16_forward():
    """Under bf16 the batched step (weights cast once, fp32 norms and residual) is not bit for bit the autocast
    forward, but its first greedy tokens agree with recomputing the whole sequence in bf16."""
    import decode as D
    torch.manual_seed(0)
    model = build_model(small(n_kv_head=2)).eval()
    tokens, _ = D.decode(model, [[1, 2, 3], [5, 6, 7, 8, 9]], 40, dtype="bfloat16")
    with autocast_context("cpu", "bfloat16"), torch.no_grad():
        for prompt, row in zip([[1, 2, 3], [5, 6, 7, 8, 9]], tokens):
            seq = torch.tensor([prompt])
            for _ in range(5):
                seq = torch.cat([seq, model(seq, last_only=True)[:, -1].argmax(-1, keepdim=True)], 1)
            assert row[:5] == seq[0, len(prompt):].tolist() and len(row) == 40


# --- activation checkpointing -----------------------------------------------------------------------------------

def test_activation_checkpointing_gives_identical_loss_and_grads():
    torch.manual_seed(0)
    plain = build_model(small(n_kv_head=2, mlp="swiglu", norm_learnable=True))
    ckpt = build_model(small(n_kv_head=2, mlp="swiglu", norm_learnable=True, activation_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 512, (2, 64))
    losses = []
    for model in (plain, ckpt):
        loss = model(idx, idx.roll(-1, 1))
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (n, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n
