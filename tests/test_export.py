"""export.py: a checkpoint in the Hugging Face layout computes in transformers what it computes in model.py (logits
within 1e-4 in fp32, the same 32 greedy tokens), its tokenizer gives tokenizer.py's ids for text and for chat
conversations, what cannot be exported is refused by name, and --push uploads the export to a local stand-in of the
hub over HTTP."""
import base64
import hashlib
import json
import threading
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import islice

import pytest
import torch
from helpers import run_in_process, run_script
from jinja2 import TemplateError
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import checkpoint
import export
import prepare as P
from decode import decode
from model import build_model, config_from_preset
from prepare import train_tokenizer
from tokenizer import Tokenizer

SMALL = {"sequence_len": 64, "n_layer": 2, "n_embd": 64, "n_head": 4, "n_kv_head": 2}
RANDOM_MODELS = {  # what each export path must get right, at a size that loads in a second
    # llama3-1b's features (swiglu, learnable norms, GQA, tied, theta 500000, eps 1e-5), shrunk
    "llama": ("llama3-1b", {**SMALL, "mlp_hidden": 128}),
    # tiny's (QK-norm, relu^2, softcap 15), tied and with learnable scales: the q/k norm scales need the RoPE swap too
    "custom": ("tiny", {**SMALL, "norm_learnable": True, "tie_embeddings": True}),
}
MULTILINGUAL = "Grüße aus Köln! 東京は日本の首都です。 Ça va? Москва 🙂👍🏽 year 2024, pi 3.14159265\n\n\t   runs   of  spaces \r\n"
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of Aldora?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hi 🙂"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "東京は?"},
     {"role": "assistant", "content": " Tokyo  2024\n"}],
    [{"role": "user", "content": "  spaces\n\nand lines  "}, {"role": "assistant", "content": ""}],
]


def save_random_checkpoint(root, name, preset, overrides, tokenizer, tokenizer_dir):
    """A checkpoint directory (model.pt + meta.json, as checkpoint.load_model reads it) of random weights: norm scales
    around 1 and a head of unit-scale logits, so no mapping mistake hides behind a scale of ones or tiny logits."""
    torch.manual_seed(0)
    model = build_model(config_from_preset(preset, {**overrides, "vocab_size": tokenizer.vocab_size}))
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.copy_(1 + 0.3 * torch.randn_like(param))
        if model.lm_head is not None:
            model.lm_head.weight.normal_(0, 0.5)
    ckpt = root / name / "ckpt" / "step_000001"
    ckpt.mkdir(parents=True)
    torch.save(model.state_dict(), ckpt / "model.pt")
    meta = {"model_config": asdict(model.config), "tokenizer": str(tokenizer_dir), "stage": "sft", "step": 1,
            "tokenizer_sha256": tokenizer.fingerprint()}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return root / name


@pytest.fixture(scope="module")
def multilingual_tokenizer(tmp_path_factory):
    """A tokenizer whose merges join multi-byte characters (CJK, Cyrillic, accents, emoji), not only ASCII."""
    words = ["the", "capital", "of", "Aldora", "is", "Pelmo", "naïve", "café", "Grüße", "Köln", "Straße", "Москва",
             "привет", "Ελλάδα", "東京", "日本", "首都", "です", "北京", "中文", "🙂", "👍🏽", "❤️", "2024", "3.14159", "...",
             "?!", ","]
    texts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(30)) + "\n\n\t  " for i in range(200)]
    directory = tmp_path_factory.mktemp("multilingual") / "tokenizer"
    train_tokenizer(texts, 384).save(directory)
    return Tokenizer.load(directory), directory


@pytest.fixture(scope="module")
def random_exports(tmp_path_factory, multilingual_tokenizer):
    """{kind: (model.py's model, the export directory)} for RANDOM_MODELS, exported by export.main."""
    tokenizer, tokenizer_dir = multilingual_tokenizer
    root, exports = tmp_path_factory.mktemp("random_exports"), {}
    for kind, (preset, overrides) in RANDOM_MODELS.items():
        run = save_random_checkpoint(root, kind, preset, overrides, tokenizer, tokenizer_dir)
        assert export.main(["--checkpoint", str(run), "--out", str(root / f"{kind}_hf")]) == 0
        exports[kind] = (checkpoint.load_model(checkpoint.find_checkpoint(run), "cpu")[0], root / f"{kind}_hf")
    return exports


class Hub:
    """A stand-in for the hub's upload protocol (huggingface_hub's single-commit path with Xet disabled): create a
    repo, preupload (LFS for safetensors), the LFS batch API with basic PUT transfers, and an NDJSON commit. It keeps
    each committed file's bytes and every request's path and Authorization header."""

    def __init__(self, token="hf_test_token"):
        self.token, self.repos, self.blobs, self.files, self.requests = token, [], {}, {}, []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, obj, status=200):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                hub.requests.append(("PUT", self.path, self.headers.get("Authorization")))
                hub.blobs[self.path.rsplit("/", 1)[1]] = self.rfile.read(int(self.headers["Content-Length"]))
                self.answer({})

            def do_POST(self):
                hub.requests.append(("POST", self.path, self.headers.get("Authorization")))
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Authorization") != f"Bearer {hub.token}":
                    self.answer({"error": "Invalid credentials in Authorization header"}, 401)
                else:
                    self.answer(hub.route(self.path, body))

        return Handler

    def route(self, path, body):
        if path == "/api/repos/create":
            request = json.loads(body)
            self.repos.append(f"{request['organization']}/{request['name']}")
            return {"url": f"{self.url}/{self.repos[-1]}"}
        if "/preupload/" in path:
            return {"files": [{"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(".safetensors") else
                               "regular", "shouldIgnore": False} for f in json.loads(body)["files"]]}
        if path.endswith(".git/info/lfs/objects/batch"):
            return {"transfer": "basic", "objects": [
                {"oid": o["oid"], "size": o["size"], "actions": {"upload": {"href": f"{self.url}/lfs/{o['oid']}"}}}
                for o in json.loads(body)["objects"]]}
        if "/commit/" in path:
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                elif item["key"] == "lfsFile":
                    self.files[item["value"]["path"]] = self.blobs[item["value"]["oid"]]
            return {"commitUrl": f"{self.url}/{path.split('/')[3]}/{path.split('/')[4]}/commit/c0ffee",
                    "commitOid": "c0ffee" * 6 + "c0ff"}
        raise AssertionError(f"the hub stand-in has no route for POST {path}")


@pytest.fixture(scope="module")
def trained_export(demo_world, tmp_path_factory):
    """A tiny d{N}-style model (QK-norm, relu^2, softcap, weightless norms, untied, GQA) trained 40 steps on the demo
    world, checkpointed by checkpoint.save_checkpoint, then exported and pushed by `python export.py` as a user runs
    it. (model, tokenizer, export directory, export.py's stdout, the hub stand-in)."""
    root, tokenizer = tmp_path_factory.mktemp("trained"), Tokenizer.load(demo_world / "tokenizer")
    torch.manual_seed(0)
    model = build_model(config_from_preset("tiny", {**SMALL, "n_kv_head": 1}))
    texts = islice(P.iter_texts(demo_world / "demo" / "pretrain", "train"), 100)
    ids = torch.tensor([i for text in texts for i in [tokenizer.bos_id, *tokenizer.encode(text)]])
    rows = ids[:len(ids) // 65 * 65].view(-1, 65)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(40):
        batch = rows[torch.arange(step * 8, step * 8 + 8) % len(rows)]
        model(batch[:, :-1], batch[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    meta = {"stage": "pretrain", "model_config": asdict(model.config), "tokenizer": str(demo_world / "tokenizer"),
            "tokenizer_sha256": tokenizer.fingerprint()}
    checkpoint.save_checkpoint(root / "runs" / "tiny40" / "ckpt", 40, model, [optimizer], {}, meta, rank=0, keep=1)
    hub = Hub()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_ENDPOINT", hub.url)
        env.setenv("HF_TOKEN", "hf_test_token")
        env.setenv("HF_HUB_DISABLE_XET", "1")  # the stand-in speaks the LFS protocol, not Xet's
        result = run_script("export.py", ["--out", "hf/tiny40", "--push", "me/tiny40"], root)
    hub.server.shutdown()
    return model.eval(), tokenizer, root / "hf" / "tiny40", result.stdout, hub


def max_logit_diff(model, hf, vocab_size, seed=0):
    ids = torch.randint(vocab_size, (4, model.config.sequence_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (model(ids) - hf(ids).logits).abs().max().item()


def greedy_tokens(model, hf, prompt):
    """(decode.py's 32 greedy tokens after prompt, transformers'), with no stop token, so all 32 are compared."""
    ours = decode(model, [prompt], 32)[0][0]
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None)
    return ours, theirs[0, len(prompt):].tolist()


def load_hf(directory, **kwargs):
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()


def test_a_llama_family_model_exports_as_plain_llama_with_equal_logits_and_greedy_tokens(random_exports):
    model, out = random_exports["llama"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["rope_theta"],
            config["rms_norm_eps"], config["tie_word_embeddings"]) == (4, 2, 500000.0, 1e-5, True)
    assert not list(out.glob("*.py"))
    hf = load_hf(out)  # no trust_remote_code: transformers' own Llama
    assert type(hf) is LlamaForCausalLM
    assert max_logit_diff(model, hf, model.config.vocab_size) < 1e-4  # measured 1.1e-6
    ours, theirs = greedy_tokens(model, hf, [7, 300, 42, 99])
    assert ours == theirs and len(ours) == 32


def test_a_qk_norm_relu2_softcap_value_embedding_model_exports_as_custom_code_with_equal_logits_and_tokens(
        random_exports):
    model, out = random_exports["custom"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["NanochatGPTForCausalLM"] and config["model_type"] == "nanochat_gpt"
    assert (config["qk_norm"], config["mlp"], config["logit_softcap"], config["value_embeds"]) == (True, "relu2",
                                                                                                   15.0, True)
    with pytest.raises(ValueError, match="trust_remote_code"):  # never silently loaded as something else
        load_hf(out, trust_remote_code=False)
    hf = load_hf(out, trust_remote_code=True)
    assert type(hf).__name__ == "NanochatGPTForCausalLM"
    assert max_logit_diff(model, hf, model.config.vocab_size) < 1e-4  # measured 2.3e-6
    ours, theirs = greedy_tokens(model, hf, [7, 300, 42, 99])
    assert ours == theirs and len(ours) == 32


@pytest.mark.parametrize("kind", RANDOM_MODELS)
def test_without_the_rotary_half_swap_the_logits_are_measurably_wrong(random_exports, kind):
    model, out = random_exports[kind]
    hf = load_hf(out, trust_remote_code=kind == "custom")
    hf.load_state_dict(export.hf_state_dict(model, permute=False), strict=False)  # tied head: no lm_head key
    assert max_logit_diff(model, hf, model.config.vocab_size) > 0.1  # measured 1.6 (llama), 1.4 (custom)


def test_a_trained_checkpoint_exported_as_a_user_runs_it_matches_model_py(trained_export):
    model, tokenizer, out, stdout, _ = trained_export
    assert f"{sum(p.numel() for p in model.parameters()):,} parameters" in stdout
    assert "(newest pretrain checkpoint under runs; stage pretrain, step 40)" in stdout
    assert "custom code (qk_norm True, mlp relu2, logit_softcap 15.0, value_embeds True, resid_lambdas True: not " \
        "Llama): load with trust_remote_code=True" in stdout
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", *export.REMOTE_FILES):
        assert f"wrote hf/tiny40/{name} (" in stdout
    hf = load_hf(out, trust_remote_code=True)
    assert max_logit_diff(model, hf, tokenizer.vocab_size) < 1e-4  # measured 3.8e-6
    ours, theirs = greedy_tokens(model, hf, [tokenizer.bos_id, *tokenizer.encode("The capital of Aldora is")])
    assert ours == theirs and len(ours) == 32
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.special_id("<|assistant_end|>"), tokenizer.bos_id]


def test_the_exported_tokenizer_encodes_and_decodes_as_tokenizer_py(trained_export, random_exports,
                                                                      multilingual_tokenizer):
    texts = [MULTILINGUAL, "", " ", "The capital of Aldora is Pelmo.", "a\u00a0b\u200bc 12345678 ﬁ'll 'VE"]
    # AutoTokenizer reads config.json first: a custom-code export needs trust_remote_code for it too
    for tokenizer, out, custom in [(trained_export[1], trained_export[2], True),
                                   (multilingual_tokenizer[0], random_exports["llama"][1], False)]:
        hf = AutoTokenizer.from_pretrained(out, trust_remote_code=custom)
        assert hf.bos_token_id == tokenizer.bos_id and hf.eos_token == "<|assistant_end|>"
        for text in texts:
            ids = tokenizer.encode(text)
            assert hf.encode(text) == ids, text  # no <|bos|> added, as tokenizer.py adds none
            assert hf.decode(ids) == tokenizer.decode(ids)
    assert len(multilingual_tokenizer[0].encode("東京 Москва")) < len("東京 Москва".encode())  # merged bytes


def test_the_chat_template_renders_conversations_as_render_conversation_does(trained_export):
    tokenizer, out = trained_export[1], trained_export[2]
    hf = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    for conversation in CONVERSATIONS:
        ids = hf.apply_chat_template(conversation, tokenize=True)["input_ids"]
        assert ids == tokenizer.render_conversation(conversation)[0]
    for conversation in CONVERSATIONS[:2]:
        prompt = conversation[:-1] if conversation[-1]["role"] == "assistant" else conversation
        ids = hf.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)["input_ids"]
        assert ids == tokenizer.render_for_completion(prompt)
    with pytest.raises(TemplateError, match="roles alternate"):
        hf.apply_chat_template([{"role": "assistant", "content": "first"}])


def test_special_token_text_in_a_message_stays_text_with_sanitize_control_tokens(trained_export):
    tokenizer, out = trained_export[1], trained_export[2]
    conversation = [{"role": "user", "content": "say <|assistant_end|><|bos|> please"}]
    hf = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    ids = hf.apply_chat_template(conversation, sanitize_control_tokens=True)
    assert ids["input_ids"] == tokenizer.render_conversation(conversation)[0]  # encode_ordinary's behaviour


def test_push_uploads_every_file_of_the_export_to_the_hub(trained_export):
    out, stdout, hub = trained_export[2], trained_export[3], trained_export[4]
    assert hub.repos == ["me/tiny40"]
    assert hub.files == {path.name: path.read_bytes() for path in out.iterdir()}
    assert f"pushed to {hub.url}/me/tiny40/commit/c0ffee" in stdout
    lfs = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert ("PUT", f"/lfs/{lfs}", None) in hub.requests  # the bytes go by LFS; the token only to the API
    assert all(auth == "Bearer hf_test_token" for method, _, auth in hub.requests if method == "POST")


def test_presets_export_as_llama_or_custom_code_and_bitnet_is_refused():
    assert export.export_kind(asdict(config_from_preset("llama3-1b"))) == "llama"
    assert export.export_kind(asdict(config_from_preset("llama3-1b", {"norm_learnable": False}))) == "llama"
    assert export.export_kind(asdict(config_from_preset("d20"))) == "custom"
    assert export.export_kind(asdict(config_from_preset("tiny"))) == "custom"
    with pytest.raises(ValueError, match=r"^bitnet=True cannot be exported: BitNet b1\.58"):
        export.export_kind(asdict(config_from_preset("bitnet-95m")))


def test_an_unknown_config_field_is_refused_by_name_unless_it_is_off():
    config = asdict(config_from_preset("llama3-1b"))
    for off in (False, 0, 0.0, None, ""):
        assert export.export_kind({**config, "value_embeddings": off}) == "llama"
    for on in (True, 2, 0.5, "all"):
        with pytest.raises(ValueError, match=f"^model field value_embeddings={on!r} is unknown to export.py"):
            export.export_kind({**config, "value_embeddings": on})


def test_a_tensor_without_a_place_in_the_export_is_refused_by_name():
    model = build_model(config_from_preset("llama3-1b", {**SMALL, "vocab_size": 300, "mlp_hidden": 128}))
    model.blocks[0].resid_lambda = torch.nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match="does not map: blocks.0.resid_lambda"):
        export.hf_state_dict(model)


def test_a_bitnet_checkpoint_is_refused_naming_the_feature_and_nothing_is_written(tmp_path, multilingual_tokenizer,
                                                                                 capsys):
    tokenizer, tokenizer_dir = multilingual_tokenizer
    run = save_random_checkpoint(tmp_path, "bitnet", "bitnet-95m", {**SMALL, "mlp_hidden": 128}, tokenizer,
                                 tokenizer_dir)
    code, _, err = run_in_process(export.main, ["--checkpoint", run, "--out", tmp_path / "hf"], capsys, "export.py")
    assert code == 1 and err.startswith("export.py: error: bitnet=True cannot be exported: BitNet b1.58 quantizes")
    assert not (tmp_path / "hf").exists()


def test_an_out_directory_holding_other_files_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    args = ["--out", tmp_path, "--runs_dir", tmp_path / "runs"]
    code, _, err = run_in_process(export.main, args, capsys, "export.py")
    assert code == 1 and f"--out {tmp_path} is not empty and holds no export" in err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_push_the_hub_refuses_says_what_to_do_and_keeps_the_export(random_exports, tmp_path, monkeypatch, capsys):
    hub = Hub(token="hf_write_token")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", "hf_read_only_token")
    run = random_exports["llama"][1].parent / "llama"
    args = ["--checkpoint", run, "--out", tmp_path / "hf", "--push", "me/llama"]
    code, out, err = run_in_process(export.main, args, capsys, "export.py")
    hub.server.shutdown()
    assert code == 1 and err.startswith(f"export.py: error: could not push {tmp_path / 'hf'} to me/llama at {hub.url} (")
    assert "401" in err and "it needs a token with write access (HF_TOKEN" in err
    assert hub.requests == [("POST", "/api/repos/create", "Bearer hf_read_only_token")] and not hub.repos
    assert (tmp_path / "hf" / "model.safetensors").is_file() and "pushed to" not in out
