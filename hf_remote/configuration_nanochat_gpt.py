"""The config of a nanochat model that a plain Llama cannot represent: LlamaConfig's fields plus the
five features modeling_nanochat_gpt.py adds. export.py copies this file next to the weights;
transformers loads it with trust_remote_code=True (written for transformers 5.x, tested with
5.23.0)."""
from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig


@strict
class NanochatGPTConfig(LlamaConfig):
    # its own model_type: nothing that knows only Llama runs these weights without the features
    # below (silently wrong logits); without trust_remote_code transformers refuses it. Not
    # "nanochat": transformers' model of that name (karpathy/nanochat) normalizes the embeddings
    # and has no learnable scales, yet would load these weights with only a warning.
    model_type = "nanochat_gpt"
    qk_norm: bool = False  # RMSNorm over each head's queries and keys, before RoPE
    mlp: str = "swiglu"  # 'swiglu' (Llama's gated MLP) | 'relu2': down(relu(up(x))^2), no gate
    logit_softcap: float = 0.0  # logits -> cap * tanh(logits / cap); 0 = off
    # a token embedding gated into the values of every other layer, the last included
    value_embeds: bool = False
    # layer i reads resid_lambdas[i] * hidden + x0_lambdas[i] * (the token embedding)
    resid_lambdas: bool = False
