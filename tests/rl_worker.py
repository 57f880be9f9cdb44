"""For tests/test_rl.py, run under torchrun by tests/two_rank_worker.py: one step of rl.py's update on 2 gloo processes
with a hand-made policy; then one rl_step whose questions teach on one rank only.

The policy is a bigram table: every block's output projections are zero, so the residual stream is the token's
embedding, a one-hot row; the weightless final norm scales it to sqrt(n_embd); the head's column for token i is row i of
the table over sqrt(n_embd). After <|assistant_start|> it likes to write the call 3+4 to the calculator, then the result
7 and <|assistant_end|>; any other token is followed by any token alike. Rank r samples replies to r + 1 questions (so
the ranks run different numbers of micro-batches), rewards them (1 when the last word is 7: the gradient is what is
checked, and any rule that tells the replies apart serves), and takes rl.policy_gradient's backward through DDP: every
rank's rollouts, the head and embedding weights and the head's gradient; the test computes the gradient that only the
sampled tokens give, in closed form, and compares."""
import itertools

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import optim
import rl
from decode import reply_text
from model import GPTConfig, build_model
from prepare import train_tokenizer
from tasks import normalize

LIKED = 7.0  # the logit of a token's liked successor, the others 0: p = e^7 / (e^7 + 299) = 0.79 in a vocab of 300
SAMPLES, QUESTION = 8, "what is three plus four"


def tokenizer():
    words = ["what is three plus four", "it is seven", "12 + 30 = 42", "numbers 0123456789 + - * /"] * 50
    return train_tokenizer(words, 300)


def hand_made_policy(tok):
    """(model, prompt): the bigram policy described above, and the prompt it answers."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tok.vocab_size, sequence_len=64, n_layer=1, n_embd=320, n_head=4, n_kv_head=4,
                       logit_softcap=0.0)
    model = build_model(config)
    sid, prompt = tok.special_id, tok.render_for_completion([{"role": "user", "content": QUESTION}])
    chain = [sid("<|assistant_start|>"), sid("<|python_start|>"), *tok.encode("3+4"), sid("<|python_end|>")]
    liked = dict(itertools.pairwise(chain))
    liked[sid("<|output_end|>")] = tok.encode("7")[0]
    liked[tok.encode("7")[0]] = sid("<|assistant_end|>")
    table = torch.zeros(tok.vocab_size, tok.vocab_size)
    for token, successor in liked.items():
        table[token, successor] = LIKED
    with torch.no_grad():
        for block in model.blocks:
            block.attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
        model.wte.weight.copy_(torch.eye(tok.vocab_size, config.n_embd))
        model.lm_head.weight.copy_(torch.cat([table.t(), torch.zeros(tok.vocab_size, config.n_embd - tok.vocab_size)],
                                             1) / config.n_embd ** 0.5)
    return model, prompt


def results(rank, world):
    tok = tokenizer()
    model, prompt = hand_made_policy(tok)
    rollouts, rows, rewards = [], [], []
    for question in range(rank + 1):
        replies, sampled = rl.sample_groups(model, tok, [prompt], SAMPLES, 12, 1.0, 0,
                                            rl.sampling_seed(0, rank, question), "float32")
        scores = [float(normalize(reply_text(tok, rl.strip_end(r, tok))).rpartition(" ")[2] == "7") for r in replies]
        rollouts += [{"reply": r, "sampled": s, "reward": x} for r, s, x in zip(replies, sampled, scores, strict=True)]
        rows += rl.training_rows(prompt, replies, sampled, tok.bos_id)
        rewards += scores
    weights = rl.advantages(rewards, SAMPLES)
    loss, count = rl.policy_gradient(DDP(model), rows, weights, 3, "float32", torch.device("cpu"), world)
    gathered = [None] * world
    dist.all_gather_object(gathered, [{**r, "advantage": float(a)} for r, a in zip(rollouts, weights, strict=True)])
    return {"rollouts": [r for part in gathered for r in part], "prompt": prompt, "count": count, "loss": loss,
            "head": model.lm_head.weight.detach().clone(), "wte": model.wte.weight.detach().clone(),
            "grad": model.lm_head.weight.grad.clone(), "eps": model.config.norm_eps,
            "teaching": teaching_step(rank, world, tok)}


def teaching_step(rank, world, tok):
    """rl.rl_step with the rewards patched: of the step's 3 questions rank 0 takes the first (4 replies all right) and
    the third (all wrong), rank 1 the second (2 of 4 right). Every rank's (teaching, lr_mult, lrs, base lrs)."""
    scores = iter([1.0] * 4 + [0.0] * 4 if rank == 0 else [0.0, 1.0, 0.0, 1.0])
    rl.reward = lambda item, text: next(scores)
    record, base, _ = scored_step(tok, 0, rank, world, DDP)
    gathered = [None] * world
    dist.all_gather_object(gathered, (record["teaching"], record["lr_mult"], record["lr"], base))
    return gathered


def scored_step(tok, step, rank, world, wrap=lambda model: model):
    """One rl.rl_step of 3 questions x 4 replies on the hand-made policy, the train model wrap(model), rl.reward
    replaced by the caller. Returns (the step's record, {group: base lr}, args)."""
    model, _ = hand_made_policy(tok)
    _, args = rl.get_args(["--questions_per_step", "3", "--samples", "4", "--max_new_tokens", "6"])
    args.__dict__.update(sequence_len=64, dtype="float32", optimizer="muon", matrix_lr=0.02, embedding_lr=0.2,
                         head_lr=0.004, scalar_lr=0.04, weight_decay=0.0, grad_clip=1.0)
    optimizers = optim.build_optimizers(model, args, model.config.n_embd, 2 ** 19, torch.device("cpu"))
    items = [{"prompt": QUESTION, "answer": "7"}] * 3
    record = rl.rl_step(args, model, wrap(model), optimizers, rl.Cursor(), tok, items, step, 10, 4, rank, world,
                        torch.device("cpu"), None, lambda: False)
    return record, {g["name"]: g["base_lr"] for opt in optimizers for g in opt.param_groups}, args
