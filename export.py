"""Export a checkpoint to the Hugging Face layout (transformers, vLLM, llama.cpp's converters, the
hub).

    python export.py --out hf/mychat  # the newest RL or SFT checkpoint under runs/
    python export.py --checkpoint runs/sft --out hf/mychat
        # a run (its newest checkpoint) or a ckpt/step_* dir
    python export.py --checkpoint runs/sft --out hf/mychat --push user/mychat
        # then upload it to the hub

Writes into --out: model.safetensors (fp32), config.json, generation_config.json, tokenizer.json,
tokenizer_config.json, chat_template.jinja, and hf_remote/'s code where a plain Llama cannot
represent the model (load with trust_remote_code=True); a plain Llama export (the llama3-1b
preset) is what vLLM and llama.cpp take. BitNet, and any unknown GPTConfig field that is on, is
refused. The mapping, RoPE included: docs/export.md.
"""
import argparse
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

import checkpoint
import distributed
from checkpoint import add_checkpoint_args, pick_checkpoint
from prepare import hub_endpoint
from tokenizer import SPECIAL_TOKENS

REMOTE_CODE = Path(__file__).resolve().parent / "hf_remote"
REMOTE_FILES = ("configuration_nanochat_gpt.py", "modeling_nanochat_gpt.py")
# GPTConfig fields and the LlamaConfig field each becomes
LLAMA_FIELDS = {"vocab_size": "vocab_size", "sequence_len": "max_position_embeddings",
                "n_layer": "num_hidden_layers",
                "n_embd": "hidden_size", "n_head": "num_attention_heads",
                "n_kv_head": "num_key_value_heads",
                "head_dim": "head_dim", "mlp_hidden": "intermediate_size",
                "rope_theta": "rope_theta",
                "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings"}
# Llama's value of each; any other needs hf_remote/
CUSTOM_FIELDS = {"qk_norm": False, "mlp": "swiglu", "logit_softcap": 0.0, "value_embeds": False,
                 "resid_lambdas": False}
# ones for weightless norms; training only
EXACT_FIELDS = {"norm_learnable", "activation_checkpointing"}
REFUSED = {"bitnet": "BitNet b1.58 quantizes weights to {-1, 0, +1} and activations to 8 bits "
                     "inside every layer, which neither Llama nor hf_remote/ does; its fp32 latent "
                     "weights would be another model"}
# tokenizer.py's render_conversation as Jinja: a system message joins the first user message
CHAT_TEMPLATE = r"""
{%- set system = messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' else '' -%}
{%- set turns = messages[1:] if messages[0]['role'] == 'system' else messages -%}
{{- '<|bos|>' -}}
{%- for message in turns -%}
{%- if message['role'] != ['user', 'assistant'][loop.index0 % 2] -%}
{{- raise_exception('roles alternate user, assistant, user, ... after an optional leading '
    ~ 'system message') -}}
{%- elif message['role'] == 'user' -%}
{{- '<|user_start|>' + (system if loop.first else '') + message['content'] + '<|user_end|>' -}}
{%- else -%}
{{- '<|assistant_start|>' + message['content'] + '<|assistant_end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant_start|>' -}}{%- endif -%}
"""


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.add_argument("--out", required=True, help="the export's directory, new or a "
                   "previous export")
    p.add_argument("--push", default=None, metavar="REPO", help="then upload --out to this hub "
                   "model repo, e.g. user/name, created if missing; HF_TOKEN and HF_ENDPOINT from "
                   "the environment (default: none)")
    return p.parse_args(argv)


def export_kind(config):
    """'llama' (plain LlamaForCausalLM) or 'custom' (hf_remote/'s code) for GPTConfig fields."""
    for name, value in config.items():
        if name in REFUSED and value:
            raise ValueError(f"{name}={value} cannot be exported: {REFUSED[name]}")
        if name not in {*LLAMA_FIELDS, *CUSTOM_FIELDS, *EXACT_FIELDS, *REFUSED} and value:
            raise ValueError(f"model field {name}={value!r} is unknown to export.py, and exporting "
                             "without it would give a model that computes something else: map it "
                             "in export.py (and hf_remote/) first")
    if config["n_embd"] % config["n_head"]:
        raise ValueError(f"n_embd={config['n_embd']} is not a multiple of "
                         f"n_head={config['n_head']}, which transformers' LlamaConfig requires")
    return "custom" if any(config[name] != value for name,
                           value in CUSTOM_FIELDS.items()) else "llama"


def swap_halves(weight, head_dim):
    """Swap the two halves of every head's rows: model.py rotates by -angle, transformers' Llama by
    +angle (q . k unchanged)."""
    return weight.reshape(-1, 2, head_dim // 2, *weight.shape[1:]).flip(1).reshape(weight.shape)


def hf_state_dict(model, permute=True):
    """model.py's tensors under transformers' Llama names, q and k in its RoPE layout. Refuses a
    tensor with no place in the export."""
    c, sd = model.config, {name: t.detach() for name, t in model.state_dict().items()}

    def rope(weight):
        return swap_halves(weight, c.head_dim) if permute else weight

    def norm(name, dim):  # a weightless norm (no tensor in the checkpoint) is a scale of ones
        return sd.pop(name) if name in sd else torch.ones(dim)

    out = {"model.embed_tokens.weight": sd.pop("wte.weight"),
           "model.norm.weight": norm("norm_f.weight", c.n_embd)}
    for i in range(c.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out[theirs + "input_layernorm.weight"] = norm(ours + "attn_norm.weight", c.n_embd)
        out[theirs + "post_attention_layernorm.weight"] = norm(ours + "mlp_norm.weight", c.n_embd)
        for name in ("q", "k"):
            proj = theirs + f"self_attn.{name}_proj."
            out[proj + "weight"] = rope(sd.pop(ours + f"attn.{name}_proj.weight"))
            if c.qk_norm:  # hf_remote's HeadNormLinear: the norm is part of the projection
                weight = norm(ours + f"attn.{name}_norm.weight", c.head_dim)
                out[proj + "norm.weight"] = rope(weight)
        for name in ("v_proj", "o_proj"):
            out[theirs + f"self_attn.{name}.weight"] = sd.pop(ours + f"attn.{name}.weight")
        # hf_remote's ValueEmbedProjection: the table and gate live in v_proj
        if f"value_embeds.{i}.weight" in sd:
            out[theirs + "self_attn.v_proj.value_embed.weight"] = sd.pop(f"value_embeds.{i}.weight")
            out[theirs + "self_attn.v_proj.gate.weight"] = sd.pop(ours + "attn.ve_gate.weight")
        for name in ("gate_proj", "up_proj", "down_proj"):
            if ours + f"mlp.{name}.weight" in sd:
                out[theirs + f"mlp.{name}.weight"] = sd.pop(ours + f"mlp.{name}.weight")
    if not c.tie_embeddings:
        out["lm_head.weight"] = sd.pop("lm_head.weight")
    # hf_remote keeps them on the top module, under the same names
    for name in ("resid_lambdas", "x0_lambdas"):
        if name in sd:
            out[name] = sd.pop(name)
    if sd:
        raise ValueError("the checkpoint holds tensors export.py does not map: "
                         f"{', '.join(sorted(sd))}")
    return {name: t.float().contiguous() for name, t in out.items()}


def hf_config(c, tokenizer, kind):
    """config.json: LlamaConfig's fields, or NanochatGPTConfig's (hf_remote/, with auto_map)."""
    config = {LLAMA_FIELDS[name]: value for name,
              value in asdict(c).items() if name in LLAMA_FIELDS}
    # generation stops at the end of a reply, or where a base model starts the next document
    stop = [tokenizer.special_id("<|assistant_end|>"), tokenizer.bos_id]
    config |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
               "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
               "attention_bias": False,
               "mlp_bias": False, "attention_dropout": 0.0, "bos_token_id": tokenizer.bos_id,
               "eos_token_id": stop,
               "torch_dtype": "float32", "use_cache": True}
    if kind == "custom":
        config |= {name: getattr(c, name) for name in CUSTOM_FIELDS}
        config |= {"architectures": ["NanochatGPTForCausalLM"], "model_type": "nanochat_gpt",
                   "hidden_act": "relu2" if c.mlp == "relu2" else "silu",
                   "auto_map": {"AutoConfig": "configuration_nanochat_gpt.NanochatGPTConfig",
                                "AutoModelForCausalLM":
                                    "modeling_nanochat_gpt.NanochatGPTForCausalLM"}}
    return config


def bytes_to_unicode():
    """GPT-2's map of bytes to printable characters, as byte-level BPE files spell tokens."""
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"),
                                                                                   ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return {b: chr(b) if b in kept else chr(next(others)) for b in range(256)}


def tokenizer_json(tokenizer):
    """tokenizers' byte-level BPE with tiktoken's ranks as ids. Merges: every two-token split of a
    token, in rank order (as transformers' tiktoken converter); ignore_merges keeps a whole-token
    pre-token, as tiktoken. No <|bos|> added."""
    spell = bytes_to_unicode()

    def text(token):
        return "".join(spell[b] for b in token)

    ranks, merges = tokenizer.mergeable_ranks, []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [(token[:i], token[i:]) for i in range(
                1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [[text(a), text(b)] for a, b in sorted(splits, key=lambda s: (ranks[s[0]],
                                                                                ranks[s[1]]))]
    added = [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False,
              "special": True} for name, i in tokenizer.special_tokens.items()]
    split = {"type": "Split", "pattern": {"Regex": tokenizer.pattern}, "behavior": "Isolated",
             "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
             "ignore_merges": True,
             "vocab": {text(token): rank for token, rank in ranks.items()}, "merges": merges}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
            "post_processor": None,
            "decoder": byte_level, "model": model}


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def write_export(out, tensors, model, tokenizer, kind):
    c = model.config
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = hf_config(c, tokenizer, kind)
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id")}
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
                        "eos_token": "<|assistant_end|>",
                        "extra_special_tokens": SPECIAL_TOKENS[1:],
                        "model_max_length": c.sequence_len, "clean_up_tokenization_spaces": False}
    written = [out / "model.safetensors", write_json(out / "config.json", config),
               write_json(out / "generation_config.json", generation),
               write_json(out / "tokenizer.json", tokenizer_json(tokenizer)),
               write_json(out / "tokenizer_config.json", tokenizer_config)]
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    written.append(out / "chat_template.jinja")
    # custom code copied; stale copies from an earlier export removed
    for name in REMOTE_FILES:
        (out / name).unlink(missing_ok=True)
        if kind == "custom":
            written.append(Path(shutil.copy(REMOTE_CODE / name, out / name)))
    return written


def push(out, repo):
    """Upload --out to a hub model repo (created if missing); the commit's URL."""
    from huggingface_hub import HfApi  # here: only --push needs it
    from huggingface_hub.utils import httpx
    api = HfApi(endpoint=hub_endpoint())
    try:
        api.create_repo(repo, repo_type="model", exist_ok=True)
        return api.upload_folder(folder_path=out, repo_id=repo, repo_type="model",
                                 commit_message="Upload a nanochat export (export.py)").commit_url
    # the hub's HTTP errors are OSErrors; httpx's network errors are not
    except (OSError, httpx.HTTPError) as e:
        raise RuntimeError(f"could not push {out} to {repo} at {hub_endpoint()} "
                           f"({str(e).splitlines()[0]}): it needs a token with write access "
                           f"(HF_TOKEN, or `hf auth login`) and the network; the export in {out} "
                           "is complete: run the same command again to push it") from None


def main(argv=None):
    args = get_args(argv)
    out = Path(args.out)
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ValueError(f"--out {out} is not empty and holds no export: pass a new directory or a "
                         "previous export")
    ckpt, how = pick_checkpoint(args)
    model, meta = checkpoint.load_model(ckpt, "cpu")
    tokenizer, tokenizer_path = checkpoint.checkpoint_tokenizer(meta, ckpt, args.tokenizer)
    checkpoint.check_chat_tokenizer(tokenizer, tokenizer_path)
    kind = export_kind(asdict(model.config))
    # before anything is written: it refuses what it cannot place
    tensors = hf_state_dict(model)
    params = sum(p.numel() for p in model.parameters())
    print(f"export: checkpoint {ckpt} ({how}; stage {meta.get('stage', 'unknown')}, "
          f"step {meta.get('step', 'unknown')}), {params:,} parameters")
    print(f"export: tokenizer {tokenizer_path} (vocab {tokenizer.vocab_size})")
    if kind == "llama":
        print("export: plain Llama (LlamaForCausalLM): no custom code")
    else:
        features = ", ".join(f"{name} {getattr(model.config, name)}" for name,
                             value in CUSTOM_FIELDS.items()
                             if getattr(model.config, name) != value)
        print(f"export: custom code ({features}: not Llama): load with trust_remote_code=True")
    out.mkdir(parents=True, exist_ok=True)
    for path in write_export(out, tensors, model, tokenizer, kind):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    if args.push:
        print(f"pushed to {push(out, args.push)}")
    return 0


if __name__ == "__main__":
    sys.exit(distributed.run_main(main))
