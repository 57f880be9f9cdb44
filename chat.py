"""Chat with a checkpoint in the terminal. Tokens stream as generated; the conversation stays in the
KV cache across turns, so a new turn prefills only its own tokens.

    python chat.py  # newest RL or SFT checkpoint, else midtraining, else ...
    python chat.py --checkpoint runs/NAME --temperature 0.8 --top_k 40 --seed 7
    python chat.py -p "What is the capital of France?"
        # answer once and exit; -p - reads the prompt from stdin

Prints the checkpoint, device, dtype, decode path, mode (chat, or completion for a pretraining
checkpoint) and seed; after each reply, token and speed stats. Commands: /clear /stats /help
/quit. With -p the reply alone goes to stdout, the rest to stderr.
"""
import argparse
import codecs
import secrets
import signal
import sys
import termios
import time
from contextlib import contextmanager

import torch

import checkpoint
import distributed
from checkpoint import add_checkpoint_args, pick_checkpoint
from decode import ToolUse, compiled_step, decode_step, decode_weights, sample_rows
from model import KVCache, autocast_context, num_params

HELP = ("/clear  forget the conversation (back to <|bos|>)\n/stats  tokens in the cache, context, "
        "turns, last turn's prefill and decode\n/help   this list\n/quit   exit (also Ctrl-D; "
        "Ctrl-C at the prompt)\nCtrl-D after text (a paste of any length) sends it, then exits. "
        "Ctrl-C during a reply stops that reply; the conversation goes on.")
# a terminal's line limit in canonical mode (Linux): input() without readline
CANONICAL_LIMIT = 4095
# ends a line read through readline after Ctrl-D following text (see main)
SEND_AND_END = "\x04"


def get_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature, 0 = "
                   "greedy (default: %(default)s)")
    p.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest tokens, 0 = "
                   "all (default: %(default)s)")
    p.add_argument("--max_new_tokens", type=int, default=256, help="most tokens per reply "
                   "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one, "
                   "printed so it can be passed back)")
    p.add_argument("-p", "--prompt", default=None, help="answer this one prompt and exit; - reads "
                   "it from stdin (default: interactive)")
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="device (default: "
                   "%(default)s)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help=
                   "compute dtype (default: bfloat16 on a GPU that runs it natively, else float32; "
                   "on CPU float32: a 1-token step under bf16 autocast re-casts every weight)")
    p.add_argument("--decode", default="auto", choices=["auto", "eager", "compiled"],
                   help="decode.py's step: eager (attends over the filled cache only), compiled "
                   "(torch.compile, the whole cache attended, masked: fixed shapes); auto = "
                   "compiled for a session on CUDA, eager for one -p prompt and on the CPU "
                   "(default: %(default)s)")
    args = p.parse_args(None if argv is None else [str(a) for a in argv])  # argv may hold paths
    if args.max_new_tokens < 1 or args.top_k < 0 or args.temperature < 0:
        p.error("--max_new_tokens must be >= 1, --top_k >= 0 and --temperature >= 0")
    return args


def utf8_stream(tokenizer):
    """feed(token_id) -> the text its bytes complete ('' mid-character); feed(None) flushes at the
    end of a reply (an incomplete character becomes U+FFFD)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(token_id):
        if token_id is None:
            text = decoder.decode(b"", final=True)
            decoder.reset()
            return text
        return decoder.decode(tokenizer.enc.decode_single_token_bytes(token_id))
    return feed


class Conversation:
    """The token ids in the KV cache (cache.pos == len(ids); ids[0] is <|bos|>), where each
    exchange starts, and whether the last reply's <|assistant_end|> is still to be fed (with the
    next turn)."""

    def __init__(self, model, tokenizer, chat, decode="eager", dtype="float32", max_tokens=256):
        self.model, self.tok, self.chat, self.dtype = model, tokenizer, chat, dtype
        self.device = model.cos.device
        self.capacity = model.config.sequence_len
        self.cache = KVCache(model.config, 1, self.capacity)
        # kept free for the reply when old turns must go
        self.room = min(max_tokens, self.capacity // 4)
        self.special = set(tokenizer.special_tokens.values())
        self.end = tokenizer.special_id("<|assistant_end|>")
        self.last = {}
        self.reset()  # allocates the cache, which the step writes in place
        self.step = self._make_step(decode == "compiled")
        # compile now, not in the first reply: steps at position 1 that later writes
        if decode == "compiled":
            for _ in range(3):    # overwrite; the mask hides them until then
                with torch.inference_mode(), autocast_context(self.device.type, dtype):
                    self.step(torch.tensor([tokenizer.bos_id], device=self.device))
                self.cache.pos -= 1

    def _make_step(self, compiled):
        """step(token (1,)) -> logits (1, vocab), feeding the token at cache.pos: decode.py's step
        with the conversation as the reply slots."""
        model, cache = self.model, self.cache
        weights, fn = decode_weights(model,
                                     self.dtype), compiled_step() if compiled else decode_step
        # (layer, prompt 1, kv head, sample 1, slot, D)
        reply_k, reply_v = cache.k.unsqueeze(3), cache.v.unsqueeze(3)
        # the empty prompt part, and its mask
        no_k, no_v = reply_k[:, :, :, 0, :0], reply_v[:, :, :, 0, :0]
        no_valid = torch.zeros(1, 1, 1, 0, dtype=torch.bool, device=self.device)

        def step(token):
            pos = torch.tensor([cache.pos], device=self.device)
            logits = fn(model, weights, token, pos, pos if compiled else cache.pos, no_k, no_v,
                        no_valid, reply_k,
                        reply_v, cache.shape[3] if compiled else cache.pos + 1)
            cache.pos += 1
            return logits
        return step

    def forward(self, ids):
        """Prefill ids after the cache in one forward; the last position's logits."""
        with torch.inference_mode(), autocast_context(self.device.type, self.dtype):
            logits = self.model(torch.tensor([ids], device=self.device), kv_cache=self.cache,
                                last_only=True)[:, -1]
        self.ids += ids
        return logits

    def reset(self):
        self.ids, self.starts, self.pending = [], [], False
        self.cache.pos = 0
        self.forward([self.tok.bos_id])

    def turn_tokens(self, text):
        """(head, body, tail): the tokens a message adds; only body may be cut."""
        body = self.tok.encode(text)
        if not self.chat:
            return [], body, []
        sid = self.tok.special_id
        head = [self.end] * self.pending + [sid("<|user_start|>")]
        return head, body, [sid("<|user_end|>"), sid("<|assistant_start|>")]

    def fit(self, text):
        """The next turn's new tokens, made to fit: the oldest exchanges are dropped (cache rebuilt)
        until the turn and a reply fit; a message too long alone keeps its last tokens (a paste's
        question is usually at its end). Returns (new ids, notices)."""
        head, body, tail = self.turn_tokens(text)
        notices, dropped = [], 0
        while self.starts and \
                len(self.ids) + len(head) + len(body) + len(tail) + self.room > self.capacity:
            dropped += 1
            kept = [self.ids[0], *self.ids[self.starts[1]:]] if len(self.starts) > 1 else \
                [self.ids[0]]
            shift = (self.starts[1] - 1) if len(self.starts) > 1 else 0
            self.starts = [s - shift for s in self.starts[1:]]
            # nothing left to close: the pending <|assistant_end|> goes with its exchange
            if not self.starts:
                self.pending = False
                head = [t for t in head if t != self.end]
            self.ids, self.cache.pos = [], 0
            self.forward(kept)
        if dropped:
            notices.append(f"[context full: dropped the {dropped} oldest "
                           f"turn{'s' * (dropped > 1)}, kept <|bos|> and {len(self.starts)} "
                           f"turn{'s' * (len(self.starts) != 1)}; cache rebuilt, {len(self.ids):,} "
                           "tokens]")
        space = self.capacity - self.room - len(self.ids) - len(head) - len(tail)
        if len(body) > space:
            notices.append(f"[message too long: {len(body):,} tokens, the context holds "
                           f"{self.capacity:,}; kept its last {max(space, 0):,} tokens]")
            body = body[len(body) - space:] if space > 0 else []
        return head + body + tail, notices

    def respond(self, text, write, temperature, top_k, max_tokens, generator, stop=lambda: False,
                notify=None):
        """One turn: prefill, then sample until an end token, max_tokens, a full cache or stop().
        write(str) gets the reply's text, notify(str) each notice. Returns stats."""
        notify = notify or (lambda line: write(line + "\n"))
        new, notices = self.fit(text)
        for notice in notices:
            notify(notice)
        if not new:  # completion mode with nothing to continue from
            self.last = {"prefill": 0, "prefill_s": 0.0, "decode": 0, "decode_s": 0.0,
                         "why": "empty"}
            return self.last
        start = len(self.ids)
        t0 = time.perf_counter()
        logits = self.forward(new)
        prefill_s = time.perf_counter() - t0
        self.starts.append(start + (1 if self.chat and new[0] == self.end else 0))
        feed, count, why = utf8_stream(self.tok), 0, "max_new_tokens"
        # the calculator: its call shown, its result fed in
        tools = ToolUse(self.tok) if self.chat else None
        calls = {tools.start, tools.end} if tools else set()
        t1 = time.perf_counter()
        with torch.inference_mode(), autocast_context(self.device.type, self.dtype):
            while count < max_tokens:
                if stop():
                    why = "interrupted"
                    break
                token = sample_rows(logits, temperature, top_k, generator)
                if token.item() in self.special and token.item() not in calls:
                    why = "end"
                    break
                if len(self.ids) >= self.capacity:
                    why = "context full"
                    break
                forced = tools(token.item()) if tools else []
                if token.item() in calls:
                    write(feed(None) + ("[calculator: " if token.item() == tools.start else
                                        f" = {tools.calls[-1][1]}]"))
                else:
                    write(feed(token.item()))
                logits = self.step(token)
                self.ids.append(token.item())
                count += 1
                # the result, fed as if generated
                for f in forced[:max(0, self.capacity - len(self.ids))]:
                    logits = self.step(torch.tensor([f], device=self.device))
                    self.ids.append(f)
                    count += 1
        decode_s = time.perf_counter() - t1
        write(feed(None))
        # sampled <|assistant_end|>, or one closing a cut reply: fed with the next turn
        self.pending = self.chat
        if why in ("interrupted", "context full"):
            write("\n")
            notify(f"[reply stopped: {why}]")
        self.last = {"prefill": len(new), "prefill_s": prefill_s, "decode": count,
                     "decode_s": decode_s,
                     "why": why}
        return self.last


def stats_line(s):
    prefill_rate = s["prefill"] / s["prefill_s"] if s["prefill_s"] else 0
    decode_rate = s["decode"] / s["decode_s"] if s["decode_s"] else 0
    return (f"[{s['decode']} tokens, prefill {s['prefill']} tok in {s['prefill_s']:.2f} s "
            f"({prefill_rate:,.0f} tok/s), decode {decode_rate:,.0f} tok/s]")


def print_stats(conv, out):
    print(f"cache: {len(conv.ids):,} tokens of a {conv.capacity:,}-token context; turns: "
          f"{len(conv.starts)}", file=out)
    if conv.last:
        print(f"last turn: prefilled {conv.last['prefill']} tokens, decoded {conv.last['decode']} "
              f"(ended: {conv.last['why']}) {stats_line(conv.last)}", file=out)


@contextmanager
def during_reply(fd):
    """Ctrl-C only appends to the yielded list, read between tokens, so the cache is never left
    half-written. The terminal (fd) without echo: typing meanwhile waits unseen for the next
    prompt."""
    hits = []
    saved = None if fd is None else termios.tcgetattr(fd)
    previous = signal.signal(signal.SIGINT, lambda signum, frame: hits.append(signum))
    try:
        if saved:
            termios.tcsetattr(fd, termios.TCSANOW,
                              saved[:3] + [saved[3] & ~termios.ECHO] + saved[4:])
        yield hits
    finally:
        if saved:
            termios.tcsetattr(fd, termios.TCSANOW, saved)
        signal.signal(signal.SIGINT, previous)


@contextmanager
def typeahead_kept(fd):
    """The terminal (fd) out of canonical mode for the session (readline's prompts set their
    own): in canonical mode the kernel silently drops past a line's 4,095 characters (a paste
    while a reply streams), and Ctrl-D between prompts becomes a NUL readline does not take for
    EOF. Ctrl-C stays a signal, Enter a newline."""
    saved = None if fd is None else termios.tcgetattr(fd)
    try:
        if saved:
            termios.tcsetattr(fd, termios.TCSANOW,
                              saved[:3] + [saved[3] & ~termios.ICANON] + saved[4:])
        yield
    finally:
        if saved:
            termios.tcsetattr(fd, termios.TCSANOW, saved)


def read_message(out):
    """The next line typed, or None at EOF or Ctrl-C (both end the session)."""
    try:
        return input("> ")
    except (EOFError, KeyboardInterrupt):
        print(file=out)
        return None


def decode_path(choice, device_type, one_prompt):
    if choice != "auto":
        return choice
    return "compiled" if device_type == "cuda" and not one_prompt else "eager"


def main(argv=None):
    args = get_args(argv)
    device = torch.device(args.device)
    # with -p, stdout holds the reply alone
    out = sys.stderr if args.prompt is not None else sys.stdout
    ckpt, how = pick_checkpoint(args)
    model, meta = checkpoint.load_model(ckpt, device)
    tokenizer, tokenizer_path = checkpoint.checkpoint_tokenizer(meta, ckpt, args.tokenizer)
    stage = meta.get("stage") or "unknown"
    chat = stage != "pretrain"
    if chat:
        checkpoint.check_chat_tokenizer(tokenizer, tokenizer_path)
    dtype = args.dtype or (distributed.matmul_dtype(device) if device.type == "cuda" else "float32")
    decode = decode_path(args.decode, device.type, args.prompt is not None)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    generator = torch.Generator(device=device).manual_seed(seed)
    conv = Conversation(model, tokenizer, chat, decode, dtype, args.max_new_tokens)
    print(f"checkpoint: {ckpt} ({how}): stage {stage}, step {meta.get('step', 'unknown')}, "
          f"{num_params(model.config):,} parameters, context {conv.capacity:,} tokens; tokenizer "
          f"{tokenizer_path}",
          file=out)
    print(f"device: {distributed.device_name(device)}; dtype {dtype}; decode {decode}", file=out)
    print("mode: chat (the chat template; special tokens only by id)" if chat else "mode: "
          "completion (a pretraining checkpoint: no chat template, each input is continued as "
          "plain text)", file=out)
    print(f"sampling: temperature {args.temperature}, top_k {args.top_k}, max_new_tokens "
          f"{args.max_new_tokens}, seed {seed} (--seed {seed} to reproduce)", file=out)

    def write(text):
        print(text, end="", flush=True)

    # the terminal quiet during replies and out of canonical mode (set below)
    typeahead_fd = None

    def turn(text):
        with during_reply(typeahead_fd) as hits:
            s = conv.respond(text, write, args.temperature, args.top_k, args.max_new_tokens,
                             generator,
                             lambda: bool(hits), lambda line: print(line, file=out, flush=True))
            if s["why"] not in ("interrupted", "context full"):
                print(file=sys.stdout)
            print(stats_line(s), file=out, flush=True)
        if hits and s["why"] != "interrupted":  # came after the last token: said, not lost
            print("[Ctrl-C came as the reply ended: nothing to stop; Ctrl-C again or Ctrl-D to "
                  "leave]", file=out)

    if args.prompt is not None:
        text = sys.stdin.buffer.read().decode("utf-8",
                                              "replace") if args.prompt == "-" else args.prompt
        if not text.strip():
            raise ValueError("-p: the prompt is empty" + (" (nothing came on stdin)"
                                                          if args.prompt == "-" else "")
                             + ": pass the text to answer, or - and the text on stdin")
        turn(text.strip("\n"))
        return 0
    # invalid UTF-8 typed or piped in becomes U+FFFD, not a crash
    sys.stdin.reconfigure(errors="replace")
    cut = None  # input()'s line limit: none with readline (it reads key by key)
    if sys.stdin.isatty():
        try:
            import readline  # line editing and history for input()
            # readline takes Ctrl-D after text as delete-char (a bell; the paste is never sent):
            # bind it to end of line, a literal Ctrl-D, accept. macOS's libedit differs
            if "libedit" not in (readline.__doc__ or ""):
                readline.parse_and_bind(r'"\C-d": "\C-e\C-v\C-d\C-j"')
            typeahead_fd = sys.stdin.fileno()
        except ImportError:
            cut = CANONICAL_LIMIT
    print("type a message; /help for commands", file=out)
    try:
        with typeahead_kept(typeahead_fd):
            talk(conv, turn, cut, out)
    # a Ctrl-C outside input() and a reply, or with a Ctrl-D: the end
    except KeyboardInterrupt:
        print(file=out)
    return 0


def talk(conv, turn, cut, out):
    """The prompt loop: commands or turns until /quit, Ctrl-D or Ctrl-C at the prompt."""
    while (line := read_message(out)) is not None:
        last, line = line.endswith(SEND_AND_END), line.removesuffix(SEND_AND_END)
        if cut and len(line) >= cut:
            print(f"[the terminal cut this line at {cut:,} characters (its limit without "
                  "readline): pass longer text with -p - < FILE]", file=out)
        command = line.strip()
        if command in ("/quit", "/exit"):
            break
        if command == "/help":
            print(HELP, file=out)
        elif command == "/clear":
            conv.reset()
            print("[conversation cleared]", file=out)
        elif command == "/stats":
            print_stats(conv, out)
        # a mistyped command is not sent to the model
        elif command.startswith("/") and " " not in command:
            print(f"unknown command {command}; /help lists them", file=out)
        elif command:
            turn(line)
        if last:
            break


if __name__ == "__main__":
    sys.exit(distributed.run_main(main))
