"""The byte-level BPE tokenizer: loaded from JSON, encoding with tiktoken, rendering
conversations as ids and a loss mask (prepare.py trains one). How a text splits into tokens:

    python tokenizer.py "Hello, world" --tokenizer runs/tokenizer   # each token's id and bytes

The vocabulary: 256 bytes, the merges, then SPECIAL_TOKENS (ids V-9 .. V-1 of size V). Saved
as JSON, not a pickle, so a downloaded tokenizer cannot run code when loaded.
"""
import argparse
import base64
import hashlib
import json
import os
from pathlib import Path

import tiktoken

# GPT-4's (cl100k) pre-token pattern; nanochat's \p{N}{1,2} differs little in bytes/token
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}|"""
                 r""" ?[^\s\p{L}\p{N}]++[\r\n]*|"""
                 r"""\s*[\r\n]|\s+(?!\S)|\s+""")
# the chat template's, then the calculator's call and result (never trained on)
SPECIAL_TOKENS = ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
                  "<|assistant_end|>", "<|python_start|>", "<|python_end|>", "<|output_start|>",
                  "<|output_end|>"]
CHAT_SPECIALS = SPECIAL_TOKENS[1:5]
FILE_NAME = "tokenizer.json"
FORMAT = "nanochat-bpe-v1"


class Tokenizer:
    """tiktoken over BPE merges + SPECIAL_TOKENS, with token byte lengths."""

    def __init__(self, mergeable_ranks, pattern):
        n = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(n)):
            raise ValueError(f"mergeable ranks must be exactly 0..{n - 1}, each once")
        if any(bytes([b]) not in mergeable_ranks for b in range(256)):
            raise ValueError("mergeable ranks must contain all 256 single bytes (byte-level BPE)")
        self.mergeable_ranks = dict(mergeable_ranks)
        self.pattern = pattern
        self.special_tokens = {name: n + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.enc = tiktoken.Encoding("nanochat", pat_str=pattern,
                                     mergeable_ranks=self.mergeable_ranks,
                                     special_tokens=self.special_tokens)
        self.vocab_size = n + len(SPECIAL_TOKENS)
        self.bos_id = self.special_tokens["<|bos|>"]
        # bytes per id (0: special): bits per byte compare across vocabulary sizes
        self.token_bytes = [0] * self.vocab_size
        for token, rank in self.mergeable_ranks.items():
            self.token_bytes[rank] = len(token)

    def fingerprint(self):
        """sha256 of pattern, merges, specials: checkpoints record it, so a model is never used
        with another tokenizer of the same size."""
        digest = hashlib.sha256(self.pattern.encode())
        for token, rank in sorted(self.mergeable_ranks.items(), key=lambda item: item[1]):
            digest.update(len(token).to_bytes(2, "little") + token)
        digest.update(json.dumps(self.special_tokens, sort_keys=True).encode())
        return digest.hexdigest()

    def special_id(self, name):
        if name not in self.special_tokens:
            raise ValueError(f"unknown special token {name!r}: allowed are "
                             f"{', '.join(SPECIAL_TOKENS)}")
        return self.special_tokens[name]

    def encode(self, text):
        # encode_ordinary: "<|bos|>" typed by a user or in web text is plain text
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts, num_threads=8):
        return self.enc.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids):
        return self.enc.decode(ids)

    def save(self, directory):
        path = Path(directory) / FILE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        ranks = sorted(self.mergeable_ranks.items(), key=lambda item: item[1])
        state = {"format": FORMAT, "pattern": self.pattern, "vocab_size": self.vocab_size,
                 "special_tokens": self.special_tokens, "token_bytes": self.token_bytes,
                 "mergeable_ranks": [[base64.b64encode(token).decode("ascii"), rank] for token,
                                     rank in ranks]}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)  # never half-written
        return path

    @classmethod
    def load(cls, directory):
        path = Path(directory) / FILE_NAME
        how = f"run `python prepare.py tokenizer --data_dir DIR --out {directory}` to create it"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer at {path}: {how}")
        try:
            state = json.loads(path.read_text())
            if state.get("format") != FORMAT:
                raise ValueError(f"format is {state.get('format')!r}, expected {FORMAT!r}")
            ranks = {base64.b64decode(token, validate=True): rank
                     for token, rank in state["mergeable_ranks"]}
            tokenizer = cls(ranks, state["pattern"])
            stored = list(state.get("special_tokens") or {})
            if stored != SPECIAL_TOKENS and stored == SPECIAL_TOKENS[:len(stored)]:
                raise ValueError("it was trained before the special tokens "
                                 f"{', '.join(SPECIAL_TOKENS[len(stored):])} (the calculator's "
                                 "tool calls) existed; a model pretrained with it cannot use them")
            # stored for readers; must agree with merges
            for key in ("vocab_size", "special_tokens", "token_bytes"):
                if state[key] != getattr(tokenizer, key):
                    raise ValueError(f"stored {key} disagrees with the merges")
        # JSONDecodeError and binascii.Error included
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path} is not a valid tokenizer ({e}): delete it and {how}") from e
        return tokenizer

    # --- chat rendering (the rules: _turns) ---
    def render_conversation(self, messages, max_tokens=None):
        """(ids, mask), mask 1 on assistant content and <|assistant_end|>. max_tokens: cut after
        the last whole assistant turn that fits; ([], []) if none."""
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be at least 1 (or None for no limit)")
        user_start, user_end, assistant_start, assistant_end = (self.special_id(name)
                                                                for name in CHAT_SPECIALS)
        ids, mask, turn_ends = [self.bos_id], [0], []
        for role, content, _ in _turns(messages):
            if role == "user":
                tokens = self.encode(content)
                ids += [user_start, *tokens, user_end]
                mask += [0] * (len(tokens) + 2)
            else:
                tokens, token_mask = self.render_parts(content)
                ids += [assistant_start, *tokens, assistant_end]
                mask += [0, *token_mask, 1]
                turn_ends.append(len(ids))
        if max_tokens is not None and len(ids) > max_tokens:
            n = max([end for end in turn_ends if end <= max_tokens], default=0)
            ids, mask = ids[:n], mask[:n]
        return ids, mask

    def render_parts(self, content):
        """(ids, mask) of assistant content: a string or parts text, python (a tool call) or
        python_output (mask 0)."""
        if isinstance(content, str):
            tokens = self.encode(content)
            return tokens, [1] * len(tokens)
        ids, mask = [], []
        for part in content:
            tokens = self.encode(part["text"])
            if part["type"] == "text":
                ids, mask = ids + tokens, mask + [1] * len(tokens)
            elif part["type"] == "python":
                ids += [self.special_id("<|python_start|>"), *tokens,
                        self.special_id("<|python_end|>")]
                mask += [1] * (len(tokens) + 2)
            else:
                ids += [self.special_id("<|output_start|>"), *tokens,
                        self.special_id("<|output_end|>")]
                mask += [0] * (len(tokens) + 2)
        return ids, mask

    def render_for_completion(self, messages):
        """The conversation, then <|assistant_start|>."""
        turns = _turns(messages)
        if turns[-1][0] != "user":
            raise ValueError(f"message {len(messages) - 1}: a conversation to complete must end "
                             f"with a user message, got {messages[-1]['role']!r}")
        return self.render_conversation(messages)[0] + [self.special_id("<|assistant_start|>")]


# -----------------------------------------------------------------------------
# Chat rendering

PART_TYPES = ("text", "python", "python_output")


def is_parts(content):
    return isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in PART_TYPES and
                                             isinstance(p.get("text"), str) for p in content)


def _turns(messages):
    """Validated (role, content, message index) turns, a system message merged into the first
    user's."""
    if not messages:
        raise ValueError("a conversation needs at least one message")
    for i, m in enumerate(messages):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        content_ok = isinstance(content, str) or role == "assistant" and is_parts(content)
        if role not in ("system", "user", "assistant") or not content_ok:
            raise ValueError(f"message {i}: must be {{'role': 'system'|'user'|'assistant', "
                             "'content': str (or, for the assistant, a list of {'type': "
                             "'text'|'python'|'python_output', 'text': str})}, got "
                             f"{str(m)[:80]}")
    turns = [(m["role"], m["content"], i) for i, m in enumerate(messages)]
    if turns[0][0] == "system":
        if len(turns) < 2 or turns[1][0] != "user":
            got = f"message 1 is {turns[1][0]!r}" if len(turns) > 1 else "there is none"
            raise ValueError(f"message {min(1, len(turns) - 1)}: a system message must be followed "
                             f"by a user message, {got}")
        turns = [("user", turns[0][1] + "\n\n" + turns[1][1], 1)] + turns[2:]
    for j, (role, _, i) in enumerate(turns):
        expected = "user" if j % 2 == 0 else "assistant"
        if role != expected:
            raise ValueError(f"message {i}: expected role {expected!r}, got {role!r} (after an "
                             "optional leading system message, roles alternate user, assistant, "
                             "user, ... starting with user)")
    return turns


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("text", help="the text to encode")
    parser.add_argument("--tokenizer", default="runs/tokenizer", help="directory of tokenizer.json "
                        "(default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        tokenizer = Tokenizer.load(args.tokenizer)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(1, f"tokenizer.py: error: {e}\n")
    ids = tokenizer.encode(args.text)
    print(f"{len(ids)} tokens, {len(args.text.encode())} UTF-8 bytes")
    for token in ids:  # bytes: a token may hold part of a character
        print(token, tokenizer.enc.decode_single_token_bytes(token))


if __name__ == "__main__":
    main()
