"""decode.py's decode() on a random model: batched greedy rows checked against each prompt
decoded alone, and the tok/s of both.

    python dev/bench_decode.py                    # tiny, 8 prompts of 5 to 60 tokens, 32 new each
    python dev/bench_decode.py --preset d12 --prompts 64 --dtype bfloat16 --device cuda
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from decode import decode, decode_weights
from model import build_model, config_from_preset


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model preset, random weights (default: "
                        "%(default)s)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts decoded together (default: "
                        "%(default)s)")
    parser.add_argument("--max_new_tokens", type=int, default=32, help="greedy tokens per prompt "
                        "(default: %(default)s)")
    parser.add_argument("--compared", type=int, default=4, help="prompts also decoded alone, one "
                        "row each, the rest of the check's time (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help=
                        "compute dtype (default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help=
                        "device (default: %(default)s)")
    args = parser.parse_args(argv)
    if min(args.prompts, args.max_new_tokens, args.compared) < 1:
        parser.error("--prompts, --max_new_tokens and --compared must be >= 1")
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(config_from_preset(args.preset), device).eval()
    lengths = torch.randint(5, 61, (args.prompts,)).tolist()
    prompts = [torch.randint(0, model.config.vocab_size, (n,)).tolist() for n in lengths]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    compared = prompts[:args.compared]
    weights = decode_weights(model, args.dtype)
    # warm-up, untimed: compiles on CUDA
    decode(model, prompts, args.max_new_tokens, dtype=args.dtype, weights=weights)
    sync()
    start = time.perf_counter()
    alone = [decode(model, [p], args.max_new_tokens, dtype=args.dtype,
                    weights=weights)[0][0] for p in compared]
    sync()
    alone_s = time.perf_counter() - start
    start = time.perf_counter()
    rows, _ = decode(model, prompts, args.max_new_tokens, dtype=args.dtype, weights=weights)
    sync()
    batch_s = time.perf_counter() - start
    same = sum(a == b for a, b in zip(rows, alone))
    print(f"{args.preset} {args.dtype} on {device}: decode() one prompt at a time "
          f"{len(compared) * args.max_new_tokens / alone_s:,.0f} tok/s; {len(prompts)} prompts "
          f"together {len(prompts) * args.max_new_tokens / batch_s:,.0f} tok/s; greedy rows equal "
          f"to one at a time: {same}/{len(compared)}")
    return 0 if args.dtype != "float32" or same == len(compared) else 1



if __name__ == "__main__":
    sys.exit(main())
