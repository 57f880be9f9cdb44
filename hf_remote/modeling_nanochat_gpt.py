"""A nanochat model in transformers: Llama with QK-norm, the relu^2 MLP, the logit softcap, value
embeddings and the residual scalars where its config asks for them. export.py copies this file next
to the weights; load it with

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

Everything else is transformers' own Llama (attention, RoPE, cache, generation). Each feature
replaces one module after LlamaForCausalLM has built itself, so LlamaAttention's forward runs
unchanged: the q/k projections return normalized heads, the head returns capped logits (so a loss
computed from labels sees the capped logits too). Weightless RMSNorms are exported as scales of
ones: x * 1.0 == x exactly.
"""
import functools

import torch
from torch import nn
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from .configuration_nanochat_gpt import NanochatGPTConfig


class Relu2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class HeadNormLinear(nn.Linear):
    """A q or k projection followed by an RMSNorm over each head's channels (QK-norm). Its output
    feeds LlamaAttention, which splits the heads and applies RoPE: the norm comes before the
    rotation, as in the model it was trained as."""

    def __init__(self, in_features, out_features, head_dim, eps):
        super().__init__(in_features, out_features, bias=False)
        self.norm = LlamaRMSNorm(head_dim, eps=eps)

    def forward(self, x):
        heads = super().forward(x).unflatten(-1, (-1, self.norm.weight.numel()))
        return self.norm(heads).flatten(-2)


class SoftcapLinear(nn.Linear):
    """The output head with the logit softcap: cap * tanh(logits / cap)."""

    def __init__(self, in_features, out_features, cap):
        super().__init__(in_features, out_features, bias=False)
        self.cap = cap

    def forward(self, x):
        return self.cap * torch.tanh(super().forward(x) / self.cap)


class ValueEmbedProjection(nn.Linear):
    """v_proj plus the layer's value embedding: v + 3 sigmoid(gate(x[..., :12])) * table[token], per
    KV head. The token ids come from `ids`, the list the model's pre-hook fills with each forward's
    input_ids."""

    def __init__(self, in_features, out_features, vocab_size, kv_heads, ids, gate_channels=12):
        super().__init__(in_features, out_features, bias=False)
        self.value_embed = nn.Embedding(vocab_size, out_features)
        self.gate = nn.Linear(gate_channels, kv_heads, bias=False)
        self.ids = ids

    def forward(self, x):
        if self.ids[0] is None:
            raise ValueError("this model has value embeddings, which need the token ids: pass "
                             "input_ids, not inputs_embeds")
        gate = 3 * torch.sigmoid(self.gate(x[..., :self.gate.in_features]))
        embed = self.value_embed(self.ids[0]).unflatten(-1, (gate.size(-1), -1))
        return super().forward(x) + (gate.unsqueeze(-1) * embed).flatten(-2)


class NanochatGPTForCausalLM(LlamaForCausalLM):
    config_class = NanochatGPTConfig

    def __init__(self, config):
        super().__init__(config)
        d, eps = config.hidden_size, config.rms_norm_eps
        for layer in self.model.layers:
            if config.mlp == "relu2":
                layer.mlp = Relu2MLP(config)
            if config.qk_norm:
                attn = layer.self_attn
                attn.q_proj = HeadNormLinear(d, config.num_attention_heads * attn.head_dim,
                                             attn.head_dim, eps)
                attn.k_proj = HeadNormLinear(d, config.num_key_value_heads * attn.head_dim,
                                             attn.head_dim, eps)
        if config.value_embeds:  # every other layer, counted back from the last
            self.token_ids = [None]
            for i in range(config.num_hidden_layers - 1, -1, -2):
                attn = self.model.layers[i].self_attn
                attn.v_proj = ValueEmbedProjection(d, config.num_key_value_heads * attn.head_dim,
                                                   config.vocab_size,
                                                   config.num_key_value_heads, self.token_ids)
            self.model.register_forward_pre_hook(self.remember_ids, with_kwargs=True)
        # each layer's input mixed with the token embedding by two learned scalars
        if config.resid_lambdas:
            self.resid_lambdas = nn.Parameter(torch.ones(config.num_hidden_layers))
            self.x0_lambdas = nn.Parameter(torch.zeros(config.num_hidden_layers))
            self.token_embeds = [None]
            self.model.register_forward_pre_hook(self.remember_embeds, with_kwargs=True)
            self.model.embed_tokens.register_forward_hook(self.remember_embedding)
            for i, layer in enumerate(self.model.layers):
                layer.register_forward_pre_hook(functools.partial(self.mix_embedding, i),
                                                with_kwargs=True)
        if config.logit_softcap:
            self.lm_head = SoftcapLinear(d, config.vocab_size, config.logit_softcap)
        self.post_init()  # again: initializes the new modules and ties a new head to the embeddings

    def remember_ids(self, module, args, kwargs):
        self.token_ids[0] = kwargs.get("input_ids", args[0] if args else None)

    # inputs_embeds given: the model does not call embed_tokens
    def remember_embeds(self, module, args, kwargs):
        self.token_embeds[0] = kwargs.get("inputs_embeds")

    def remember_embedding(self, module, args, out):
        self.token_embeds[0] = out

    def mix_embedding(self, i, module, args, kwargs):
        """Layer i's input hidden states (its first argument, or hidden_states=) -> resid[i] * them
        + x0[i] * x0."""
        hidden = args[0] if args else kwargs["hidden_states"]
        mixed = self.resid_lambdas[i] * hidden + self.x0_lambdas[i] * self.token_embeds[0]
        return ((mixed, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": mixed})
