"""The gpu plan's command lines as a user meets them: budget overrides appended through *_ARGS, a small source on
many data streams, a resume on fewer GPUs, speedrun.sh's GPU checks and refusals, each rank's progress record, the
disk the plan really keeps. Each test here failed on the code before its fix (dev/LOG.md, 2026-11-25)."""
import json
import re

import pytest

import gpu_plan
import midtrain
import pretrain
import sft


@pytest.mark.parametrize("module, plan, override, used, replaced", [
    (pretrain, ["--tokens_per_param", "20"], ["--steps", "5"], ("steps", 5), ["tokens_per_param", "target_flops"]),
    (pretrain, ["--steps", "400"], ["--tokens_per_param", "2"], ("tokens_per_param", 2.0), ["steps"]),
    (midtrain, ["--tokens", "500000000"], ["--steps", "5"], ("steps", 5), ["tokens"]),
    (sft, ["--epochs", "1"], ["--steps", "5"], ("steps", 5), ["epochs"]),
    (sft, ["--steps", "200"], ["--epochs", "2"], ("epochs", 2.0), ["steps"]),
])
def test_a_budget_flag_appended_to_the_plans_replaces_its_budget_and_says_so(module, plan, override, used, replaced):
    """speedrun.sh appends PRETRAIN_ARGS / MIDTRAIN_ARGS / SFT_ARGS after the plan's own budget flag: the last budget
    flag given is in force (argparse's mutually exclusive group used to exit 2 here), the others are dropped."""
    _, args = module.get_args([*plan, *override])
    assert getattr(args, used[0]) == used[1]
    assert all(getattr(args, name) is None for name in replaced)
    assert args.budget_line == (f"budget in force: --{used[0]} {used[1]:g}, given after {plan[0]} {float(plan[1]):g}, "
                                f"which it replaces (the last budget flag given wins)")


def test_a_stage_without_a_budget_flag_names_them_and_sft_defaults_to_one_epoch(capsys):
    with pytest.raises(SystemExit) as stop:
        pretrain.get_args([])
    assert stop.value.code == 2
    assert "give a budget: --steps or --target_flops or --tokens_per_param" in capsys.readouterr().err
    _, args = sft.get_args([])
    assert (args.epochs, args.steps) == (1.0, None)
    assert args.budget_line == "budget in force: --epochs 1 (the default: no budget flag given)"


def test_checkpointing_every_0_steps_is_a_usage_error_before_any_step(capsys):
    for module in (pretrain, midtrain, sft):  # 0 once divided the step count after the last step: its training lost
        with pytest.raises(SystemExit) as stop:
            module.get_args(["--steps", "3", "--ckpt_every", "0"])
        assert stop.value.code == 2 and "--ckpt_every 0: give N >= 1 (the last step saves too" in capsys.readouterr().err


def test_the_data_plan_counts_the_budget_that_is_in_force(demo_world, tmp_path, capsys):
    """speedrun.sh's data_plan stage gets the plan's PRETRAIN flags then PRETRAIN_ARGS: the shards are planned for the --steps."""
    pretrain.main(["--data_dir", demo_world / "demo" / "pretrain", "--tokenizer", demo_world / "tokenizer",
                   "--runs_dir", tmp_path, "--preset", "tiny", "--tokens_per_param", "20", "--total_batch_tokens",
                   "4096", "--steps", "3", "--data_plan"])
    out = capsys.readouterr().out
    assert "budget in force: --steps 3, given after --tokens_per_param 20" in out
    assert "data plan: budget 3 steps x 4,096 tokens = 12,288 tokens" in out


# --- a small source on many data streams (midtraining's identity set at micro-batch 8: 32 streams) ---------------

TINY = ["--preset", "tiny", "--n_layer", "1", "--n_embd", "64", "--n_head", "1", "--n_kv_head", "1",
        "--sequence_len", "64", "--compile", "false", "--dtype", "float32"]


@pytest.fixture(scope="module")
def tiny_pretrained(demo_world, tmp_path_factory):
    """A 1-layer pretraining run of 2 steps on a small corpus (runs/text): a parent for midtrain.py and sft.py."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    runs = tmp_path_factory.mktemp("gpu_plan_runs")
    text = runs / "text"
    text.mkdir()
    for shard in range(2):  # a small corpus (the demo's costs seconds more): 64 documents in 2 row groups, 64 to validate
        pq.write_table(pa.table({"text": [f"Document {i} of shard {shard} says hello." for i in range(64)]}),
                       text / f"shard_{shard:05d}.parquet", row_group_size=32)
    pretrain.main(["--data_dir", text, "--tokenizer", demo_world / "tokenizer",
                   "--runs_dir", runs, "--run_name", "base", *TINY, "--steps", "2", "--micro_batch", "2",
                   "--bpb_tokens", "512", "--eval_every", "0", "--sample_prompt", "A"])
    return runs / "base"


def identity_like(directory, n=24):
    """n conversations in one row group, as the identity set is (24 conversations in one row group)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    directory.mkdir(parents=True, exist_ok=True)
    conversations = [[{"role": "user", "content": f"who are you {i}"},
                      {"role": "assistant", "content": f"I am the assistant, number {i}."}] for i in range(n)]
    pq.write_table(pa.table({"messages": conversations}), directory / "train.parquet", row_group_size=n)
    return directory


def test_a_set_of_24_conversations_in_one_row_group_feeds_every_one_of_32_streams(demo_world, tmp_path, capsys):
    """The identity set on 32 virtual ranks: dealt by document, ranks 24-31 got nothing and raised 'found no usable
    document' (after ranks 0-23 printed 'epoch N starts' for each of their one-conversation epochs). Round robin over
    the set repeated to 32 documents, every stream gets conversations, and the epoch lines stop after a few."""
    import loader as L
    from tokenizer import Tokenizer
    files = [identity_like(tmp_path / "identity") / "train.parquet"]
    units = [L.assign_units(files, rank, 32) for rank in range(32)]
    dealt = [[doc for _, _, first, step in rank_units for doc in range(first, 24, step)] for rank_units in units]
    assert all(dealt) and sorted(doc for docs in dealt for doc in docs) == sorted([*range(24)] * 2)  # 48: the set twice
    tokenizer = Tokenizer.load(demo_world / "tokenizer")
    for rank in (0, 23, 24, 31):
        loader = L.chat_loader(None, "train", tokenizer, 1, 64, pack="crop", supervise="all", files=files, rank=rank,
                               world_size=32, seed=0, threads=1)
        for _ in range(40):
            inputs, _ = next(loader)
        text = tokenizer.decode(inputs[0].tolist())
        loader.close()
        assert "I am the assistant, number" in text
    epochs = [line for line in capsys.readouterr().out.splitlines() if "epoch" in line and "starts" in line]
    assert len(epochs) <= 5, epochs  # 1, 2, 3, 10 (rank 0's 40 rows of about 2 conversations each: ~50 epochs)


def test_midtraining_on_32_streams_with_an_identity_like_source_trains(tiny_pretrained, demo_world, tmp_path, capsys):
    """midtrain.py at 32 data streams (1 process x 32 accumulation steps, as micro-batch 8 at 524,288 tokens is on
    one GPU) with a source of 24 conversations: every step trains, and the realized mixture counts its documents."""
    import json
    identity, text = identity_like(tmp_path / "identity"), tiny_pretrained.parent / "text"
    midtrain.main(["--checkpoint", tiny_pretrained, "--tokenizer", demo_world / "tokenizer", "--runs_dir", tmp_path,
                   "--run_name", "mid", "--source", f"text:{text}:0.5", "--source",
                   f"chat:{identity}:0.5", "--val_chat_dir", demo_world / "demo" / "conversations", "--micro_batch", "1",
                   "--total_batch_tokens", str(32 * 64), "--tokens", "1e9", "--steps", "2", "--eval_every", "0",
                   "--eval_rows", "4", "--bpb_tokens", "0", "--loader_threads", "1", "--sample_prompt", "hi",
                   "--compile", "false", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "accumulation 32 = 2,048" in out and "done: 2 steps" in out
    done = json.loads((tmp_path / "mid" / "done.json").read_text())
    assert done["mixture"][f"chat:{identity.name}"]["docs"] >= 32  # every one of the 32 streams read some


# --- a resume on a box with fewer GPUs ---------------------------------------------------------------------------

def fake_cuda(monkeypatch, count, current=0):
    """torch.cuda's RNG functions on a box of `count` GPUs whose current one is `current`: a device index past the
    last raises IndexError, as torch's default_generators[index] does. Returns the per-device states."""
    import torch
    import torch.cuda.random as cuda_random
    states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(count)}

    def get(device="cuda"):
        return states[current if device == "cuda" else int(device)].clone()

    def put(state, device="cuda"):
        index = current if device == "cuda" else int(device)
        if index >= count:
            raise IndexError(f"list index {index} out of range: {count} GPUs")
        states[index] = state.clone()

    for module in (torch.cuda, cuda_random):
        monkeypatch.setattr(module, "get_rng_state", get)
        monkeypatch.setattr(module, "set_rng_state", put)
        monkeypatch.setattr(module, "get_rng_state_all", lambda: [get(i) for i in range(count)])
        monkeypatch.setattr(module, "set_rng_state_all", lambda all_states: [put(x, i) for i, x in enumerate(all_states)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    return states


def test_a_checkpoint_of_an_8_gpu_box_resumes_on_4_with_its_ranks_own_device_rng(monkeypatch):
    """Every rank saved all visible GPUs' RNG states (8); restoring all of them on 4 GPUs raised IndexError. A rank
    saves and restores its own device's state only."""
    import io

    import torch

    import checkpoint
    fake_cuda(monkeypatch, 8, current=5)  # rank 5 of an 8-GPU box saves
    buf = io.BytesIO()
    torch.save(checkpoint.rng_state(), buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    states = fake_cuda(monkeypatch, 4, current=1)  # it resumes as local rank 1 of a 4-GPU box
    checkpoint.set_rng_state(saved)
    assert torch.equal(states[1], torch.full((16,), 5, dtype=torch.uint8))  # rank 5's device state, on its device
    assert all(torch.equal(states[i], torch.full((16,), i, dtype=torch.uint8)) for i in (0, 2, 3))  # others untouched


# --- speedrun.sh: the GPUs torch sees, the batch over the processes, the NCCL probe at each stage -----------------

# The second line comes late, as from a real 8-GPU nvidia-smi: a reader that stops at the first line (head -1) kills the
# writer with SIGPIPE, and under pipefail that ended speedrun.sh with status 141 and no message.
FAKE_SMI = """#!/bin/sh
case "$*" in
    *query-compute-apps*) ;;
    *query-gpu=name*) echo 'NVIDIA H100 80GB HBM3'; echo 'NVIDIA H100 80GB HBM3' ;;
    *query-gpu=driver_version*) echo '470.57.02'; sleep 0.2; echo '470.57.02' ;;
    *) echo '| NVIDIA-SMI 470.57.02    Driver Version: 470.57.02    CUDA Version: 11.4     |'; sleep 0.2; echo ;;
esac
"""


def executable(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def python_seeing_gpus(tmp_path, gpus, torchrun="exit 0"):
    """An interpreter for speedrun.sh that says torch sees `gpus` CUDA GPUs, runs `torchrun` (shell) for a torchrun
    stage and fails prepare.py at once (no stage reaches a network); everything else is this Python."""
    import sys
    return executable(tmp_path / "bin" / "python", f"""#!/bin/bash
case "$*" in
    *device_count*) echo {gpus}; exit 0 ;;
    *torch.version.cuda*) echo 2.13.0+cpu None; exit 0 ;;
    *"-m torch.distributed.run"*) {torchrun} ;;
    *prepare.py*) echo "stand-in: no network" >&2; exit 9 ;;
esac
exec {sys.executable} "$@"
""")


def test_gpus_n_that_torch_cannot_see_stop_the_run_before_any_stage(tmp_path):
    """--gpus 2 where torch sees none: with nvidia-smi listing GPUs (a wheel that cannot use the driver) the driver and
    wheel are named, as for the automatic count; without, the flag to pass. Before, only the automatic count was
    checked, and --gpus 2 went on to train the gpu plan on 2 CPU processes."""
    from helpers import run_speedrun
    smi = executable(tmp_path / "smi" / "nvidia-smi", FAKE_SMI)
    env = {"SPEEDRUN_PYTHON": str(python_seeing_gpus(tmp_path, 0)), "SPEEDRUN_PROBE_CMD": "exit 0",
           "PATH": f"{smi.parent}:/usr/bin:/bin"}
    result = run_speedrun(["--gpus", "2", "--runs_dir", tmp_path], tmp_path, env, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "nvidia-smi lists 2 GPU(s) but torch 2.13.0+cpu sees none. The driver is 470.57.02 (it supports CUDA " \
           "11.4); this torch wheel was built for CUDA none (a CPU-only wheel)." in result.stderr
    assert "stage " not in result.stdout
    env["PATH"] = "/usr/bin:/bin"
    result = run_speedrun(["--gpus", "2", "--runs_dir", tmp_path], tmp_path, env, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "speedrun.sh: error: --gpus 2, but torch sees 0 CUDA GPU(s): pass --gpus 0 (the CPU), or make the GPUs " \
           "visible (CUDA_VISIBLE_DEVICES)" in result.stderr
    assert "stage " not in result.stdout


def test_a_given_micro_batch_that_cannot_split_over_3_gpus_is_refused_before_any_download(tmp_path):
    """524,288 tokens a step over 3 GPUs at PRETRAIN_ARGS="--micro_batch 16" (16 x 2048 x 3 = 98,304 a micro-step): no
    accumulation makes the total. Refused in the first seconds, naming the GPU counts and the totals that work
    (before: pretraining failed after the downloads and the tokenizer)."""
    from helpers import run_speedrun
    env = {"SPEEDRUN_PYTHON": str(python_seeing_gpus(tmp_path, 3)), "SPEEDRUN_PROBE_CMD": "exit 0",
           "PRETRAIN_ARGS": "--micro_batch 16"}
    result = run_speedrun(["--plan", "gpu", "--gpus", "3", "--runs_dir", tmp_path], tmp_path, env, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "--total_batch_tokens 524,288 is not a multiple of micro_batch 16 x sequence_len 2048 x 3 processes = " \
           "98,304, so pretraining would fail at its start. Use --gpus 1 or 2, or PRETRAIN_ARGS=\"--total_batch_tokens " \
           "491520\" (or 589824) with 3 processes" in result.stderr
    assert "stage preflight" not in result.stdout and "NCCL" not in result.stdout  # before the probe, too


def gpus(monkeypatch):
    """pretrain.py --check_batch as on a GPU machine: CUDA processes, so no check of this CPU's memory."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_on_3_5_6_or_7_gpus_the_plan_takes_the_nearest_batch_that_splits_and_says_so(capsys, monkeypatch):
    """524,288 tokens a step is not a whole number of 2048-token sequences over 3, 5, 6 or 7 processes: the plan uses
    the nearest total within 3% whose per-process sequences have the largest power-of-two divisor, says so with the lr
    consequence, and plan_batch (CPU: the whole per-rank batch) runs it; 1, 2, 4 and 8 keep 524,288."""
    gpus(monkeypatch)  # the gpu plan's check on a machine with GPUs (without: tests/test_distributed.py)
    from types import SimpleNamespace

    import torch

    import train_loop
    from model import config_from_preset
    assert {n: train_loop.nearest_batch(524_288, 2048, n) for n in range(1, 9)} == {
        1: 524_288, 2: 524_288, 3: 516_096, 4: 524_288, 5: 532_480, 6: 516_096, 7: 516_096, 8: 524_288}
    assert train_loop.nearest_batch(4096, 2048, 3) is None  # 0.67 sequences a process: none within 3%
    pretrain.main(["--preset", "d20", "--tokens_per_param", "20", "--total_batch_tokens", "524288", "--check_batch", "3"])
    said = capsys.readouterr().out
    assert said == ("batch: --total_batch_tokens 524,288 is not a whole number of sequence_len 2048 x 3 processes: "
                    "516,096 tokens a step instead (-1.6%, 84 sequences a process); a token budget takes proportionally "
                    "more steps, and the AdamW lrs of the embeddings, head and scalars follow the batch (x0.9980, "
                    "optim.py)\n")
    config = config_from_preset("tiny", {"vocab_size": 256, "sequence_len": 2048})
    args = SimpleNamespace(total_batch_tokens=524_288, micro_batch=0)
    micro, accum, _ = train_loop.plan_batch(args, config, 3, None, torch.device("cpu"))
    assert micro * accum * 2048 * 3 == 516_096
    assert capsys.readouterr().out == said


def test_a_given_micro_batch_takes_the_nearest_batch_that_splits_as_a_chosen_one_does(capsys, monkeypatch):
    """PRETRAIN_ARGS="--micro_batch 2" on 3 GPUs: 524,288 is 42.67 x (2 x 2048 x 3 = 12,288); 43 of them (528,384,
    +0.8%) is the nearest within the plan's 3%, said with its lr change by the check and by plan_batch, which runs it
    (before: refused, while the same run without --micro_batch took 516,096)."""
    gpus(monkeypatch)  # the gpu plan's check on a machine with GPUs (without: tests/test_distributed.py)
    from types import SimpleNamespace

    import torch

    import train_loop
    from model import config_from_preset
    assert train_loop.nearest_batch(524_288, 2048, 3, micro=2) == 528_384
    assert train_loop.nearest_batch(524_288, 2048, 3, micro=16) is None  # 5.33 x 98,304: none within 3%
    pretrain.main(["--preset", "d20", "--tokens_per_param", "20", "--total_batch_tokens", "524288", "--check_batch", "3",
                   "--micro_batch", "2"])
    said = capsys.readouterr().out
    assert said == ("batch: --total_batch_tokens 524,288 is not a whole number of micro_batch 2 x sequence_len 2048 x 3 "
                    "processes: 528,384 tokens a step instead (+0.8%, 86 sequences a process, 43 accumulation steps); "
                    "a token budget takes proportionally fewer steps, and the AdamW lrs of the embeddings, head and "
                    "scalars follow the batch (x1.0010, optim.py)\n")
    config = config_from_preset("tiny", {"vocab_size": 256, "sequence_len": 2048})
    args = SimpleNamespace(total_batch_tokens=524_288, micro_batch=2)
    assert train_loop.plan_batch(args, config, 3, None, torch.device("cpu")) == (2, 43, "flag")
    assert capsys.readouterr().out == said


def test_the_batch_check_passes_the_totals_it_names_and_counts_a_given_micro_batch(capsys, monkeypatch):
    gpus(monkeypatch)  # the gpu plan's check on a machine with GPUs (without: tests/test_distributed.py)
    args = ["--preset", "d20", "--tokens_per_param", "20", "--total_batch_tokens", "522240", "--check_batch", "3"]
    pretrain.main(args)  # the fix the refusal above names
    assert capsys.readouterr().out == "batch: 522,240 tokens a step = 85 sequences x sequence 2,048 x 3 processes (a " \
        "process's 85: micro-batch x accumulation steps, the micro-batch chosen when pretraining starts)\n"
    pretrain.main([*args[:-3], "524288", "--check_batch", "1", "--micro_batch", "32"])  # one GPU, the micro-batch given
    assert capsys.readouterr().out == "batch: 524,288 tokens a step = micro-batch 32 x sequence 2,048 x 1 process x 8 " \
                                      "accumulation steps\n"
    with pytest.raises(ValueError, match=r"micro_batch 16 x sequence_len 2048 x 2 processes = 65,536, so pretraining "
                                         r"would fail at its start. Use --gpus 1, "
                                         r"or PRETRAIN_ARGS=\"--total_batch_tokens 524288\" \(or 589824\) with 2"):
        pretrain.main([*args[:-3], "557056", "--check_batch", "2", "--micro_batch", "16"])


def test_after_a_failed_nccl_probe_each_torchrun_stage_probes_the_defaults_again(demo_world, tmp_path):
    """The default flags fail the first probe and the one before pretraining, then pass before core_eval: pretraining
    runs on the safe flags, core_eval on the defaults (the caller's own NCCL_SOCKET_IFNAME back), and the cost of the
    fallback is printed. Before, the first failure pinned the safe flags for every stage."""
    from helpers import run_speedrun
    fast = 'echo \'{"bus_bandwidth": "98.70 GB/s"}\' > "$1"'  # the probe's JSON, to the path it is given
    safe = fast.replace("98.70", "1.60")
    count = tmp_path / "default_probes"
    probe = (f'[ "${{NCCL_P2P_DISABLE:-}}" = 1 ] && {{ {safe}; exit 0; }}; n=$(cat {count} 2>/dev/null || '
             f'echo 0); echo $((n + 1)) > {count}; [ "$n" -ge 2 ] && {{ {fast}; exit 0; }}; exit 3')
    stages = tmp_path / "stages.txt"
    torchrun = f'echo "$NCCL_SOCKET_IFNAME ${{NCCL_P2P_DISABLE:-unset}}" >> {stages}; exit 0'
    env = {"SPEEDRUN_PYTHON": str(python_seeing_gpus(tmp_path, 2, torchrun)), "SPEEDRUN_PROBE_CMD": probe,
           "SPEEDRUN_PROBE_TIMEOUT": "5", "NCCL_SOCKET_IFNAME": "eth7"}
    result = run_speedrun(["--plan", "demo", "--gpus", "2", "--runs_dir", tmp_path, "--data_dir", demo_world / "demo",
                           "--tokenizer", demo_world / "tokenizer", "--stop_after", "core_eval"], tmp_path, env,
                          timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert stages.read_text().splitlines() == ["lo 1", "eth7 unset"]  # pretrain: safe flags; core_eval: defaults
    assert count.read_text().strip() == "3"  # the start, before pretrain, before core_eval; then no more probes
    out = re.sub(r"\(\d+s\)", "(Ns)", result.stdout)  # the probes' durations
    assert "NCCL probe before stage pretrain (Ns): the default flags fail again (exit 3): stage pretrain keeps the " \
           "safe flags, all-reduce bus bandwidth 1.60 GB/s (default flags at the start: none: it failed)" in out
    assert "NCCL probe before stage core_eval (Ns): the default flags pass now, all-reduce bus bandwidth 98.70 GB/s " \
           "against 1.60 GB/s with the safe flags (what the fallback cost each stage since): stage core_eval and the " \
           "later ones use the defaults" in out
    transport = (tmp_path / "speedrun" / "transport.txt").read_text()
    assert transport.strip().endswith("; from stage core_eval on: nccl default, all-reduce bus bandwidth 98.70 GB/s")


# --- SFT's epoch, counted before step 1 without rendering the mixture ---------------------------------------------

def test_sfts_epoch_is_estimated_from_footers_and_a_sample_and_matches_the_exact_count(demo_world, tmp_path,
                                                                                      monkeypatch):
    """sft.py --epochs rendered and packed every conversation of the mixture on one thread before step 1 to count an
    epoch's batches (180,048 conversations: 139 s on this machine; the gpu plan's 1.4M: tens of minutes). The estimate
    renders SAMPLE_ROWS per file and reads the rest from the footers, and lands on the exact count here (a mixture of
    long and short conversations, one of them twice per epoch, on 1 and 4 data streams: within 2% or 2 batches)."""
    import argparse
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    import loader as L
    from dataset import mixture_files
    from tokenizer import Tokenizer
    rng = random.Random(0)
    words = ["the", "a", "cat", "sat", "on", "mat", "and", "then", "it", "ran", "to", "see", "what", "was", "there"]
    sources = []
    for name, n, longest in (("long", 1500, 120), ("short", 2000, 12), ("identity", 24, 20)):
        directory = tmp_path / name
        directory.mkdir()
        rows = [[{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, longest)))},
                 {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 2 * longest)))}]
                for _ in range(n)]
        pq.write_table(pa.table({"messages": rows}), directory / "train.parquet", row_group_size=500)
        sources.append((str(directory), 2 if name == "short" else 1))
    tokenizer = Tokenizer.load(demo_world / "tokenizer")
    args = argparse.Namespace(sources=sources)
    for streams in (1, 4):
        exact = max(sum(1 for _ in L.chat_loader(None, "train", tokenizer, 4, 128, rank=s, world_size=streams,
                                                 max_epochs=1, threads=1, files=mixture_files(sources)))
                    for s in range(streams))
        rendered, real = [], tokenizer.render_conversation

        def counted(*a, real=real, rendered=rendered, **k):
            rendered.append(1)
            return real(*a, **k)
        monkeypatch.setattr(tokenizer, "render_conversation", counted)
        estimate, line = sft.estimate_epoch_batches(args, tokenizer, 4, 128, streams)
        monkeypatch.undo()
        assert len(rendered) == 2 * sft.SAMPLE_ROWS + 24  # a sample of each file, not all 5,524
        assert abs(estimate - exact) <= max(2, 0.02 * exact), (streams, estimate, exact)  # measured: 287/286, 75/77
        assert line.startswith("estimated: 5,524 conversations in the files' footers, about ")
        assert line.endswith(f"the fullest of {streams} data streams")


# --- where each rank was when a stage failed ------------------------------------------------------------------------

@pytest.mark.two_processes
def test_a_failed_stage_prints_where_each_rank_was_from_their_progress_files(demo_world, tmp_path):
    """Rank 1 of 2 (gloo) stops taking part before step 3: the stage fails, and speedrun.sh prints each rank's last
    record from <stage>/progress/ (under NCCL the watchdog aborts in C++ and no Python error names the stuck rank;
    before, nothing recorded where each rank was)."""
    from helpers import faults_env, run_speedrun
    small = ("--steps 20 --sequence_len 64 --n_layer 1 --n_embd 64 --n_head 1 --n_kv_head 1 --micro_batch 2 "
             "--compile false --eval_every 0 --bpb_tokens 256 --ckpt_every 1000 --sample_prompt A")
    env = {"PRETRAIN_ARGS": f"{small} --dist_timeout 3", "NCCL_SAFE": "1", "OMP_NUM_THREADS": "1",
           **faults_env(hang_at_step=3)}
    result = run_speedrun(["--plan", "demo", "--gpus", "2", "--runs_dir", tmp_path, "--data_dir", demo_world / "demo",
                           "--tokenizer", demo_world / "tokenizer", "--stop_after", "pretrain"], tmp_path, env,
                          timeout=300)
    assert result.returncode != 0
    progress = tmp_path / "speedrun" / "pretrain" / "progress"
    assert f"speedrun: where each rank of stage pretrain was last ({progress}/):" in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("speedrun:   rank ")]
    assert len(lines) == 2, result.stderr[-3000:]
    assert lines[0].startswith("speedrun:   rank 0: stage pretrain step 3 forward/backward, process ")
    assert lines[1].startswith("speedrun:   rank 1: stage pretrain step 2 forward/backward, process ")
    assert re.search(r"\(\d+ s before this\)$", lines[1])


# --- the disk the gpu plan really needs for checkpoints -----------------------------------------------------------

def test_the_disk_check_counts_the_checkpoints_the_d20_plan_holds_at_once():
    """d20 (1,399,850,200 parameters; 393,217,200 in block matrices, under Muon): a full checkpoint is fp32 weights
    (4 bytes a parameter) + AdamW's two moments for the 1,006,633,000 others (8) + Muon's momentum (4) =
    15,225,333,600 bytes, not 12 x 1.4B. At 524,288 tokens a step, --ckpt_every 1000 and --keep 3: pretraining's
    21,401 steps keep 3 (4 while a save is written), midtraining's 954 steps keep 1, SFT up to 3 (4 while it saves), RL's
    468 steps keep 3 (4 while it saves): 11 at once, 167.5 GB."""
    from model import config_from_preset, param_breakdown
    config = config_from_preset("d20", {"vocab_size": 65536})
    counts = param_breakdown(config)
    assert (counts["total"], counts["attention"] + counts["mlp"]) == (1_399_850_200, 393_217_200)
    assert pretrain.checkpoint_bytes(config, "muon") == 4 * 1_399_850_200 + 8 * 1_006_633_000 + 4 * 393_217_200 \
        == 15_225_333_600
    assert pretrain.checkpoint_bytes(config, "adamw") == 12 * 1_399_850_200
    assert gpu_plan.kept_checkpoints(21_401, 1000, 3) == (3, 4)
    assert gpu_plan.kept_checkpoints(954, 1000, 3) == (1, 1)
    assert gpu_plan.kept_checkpoints(3000, 1000, 3) == (3, 3)  # 3 saves: never more than --keep at once
    # RL: 468 steps (7,473 questions, 16 a step), a save every 60: 8 saves, 3 kept, 4 held while it saves; beside
    # pretraining's 3, midtraining's 1 and SFT's 3 that is 11 (the check once counted 7 and missed RL's 60 GB)
    assert gpu_plan.RL_STEPS == 468 and gpu_plan.kept_checkpoints(468, 60, 3) == (3, 4)
    line = ("pretraining keeps 3 (holding 4 while it saves), midtraining 1 (holding 1), SFT up to --keep 3 (one more "
            "while it saves), RL 3 (holding 4): at most 11")
    assert gpu_plan.plan_checkpoints(3, 1000, 21_401, 524_288) == (11, f"{line} at once")
    assert round(11 * 15_225_333_600 / 1e9, 1) == 167.5
    # the d20 rehearsal (--steps 3, one checkpoint at the last step, --keep 1; rl 2 steps saving once): its stages
    # hold 4 at once, 60.9 GB, which the 64 GB disk of a lent H200 (68.7 GB free) holds; counted as the real plan's
    # stages (rl saving at steps 1 and 2) it was 5, 76.1 GB, and the check refused the rehearsal there
    assert gpu_plan.plan_checkpoints(1, 3, 3, 524_288, step_cap=3)[0] == 4
    budgets = gpu_plan.rehearsal_budgets(1, False)
    for stage in ("R_PRETRAIN", "R_MIDTRAIN", "R_SFT", "R_RL"):  # each training stage saves once, at its last step
        flags = budgets[stage]
        assert flags[flags.index("--steps") + 1] == flags[flags.index("--ckpt_every") + 1], stage


def test_the_command_lines_the_prediction_and_the_disk_plan_read_one_table(monkeypatch):
    """gpu_plan.py's table is the gpu plan: speedrun.sh's words (launch.py setup's), gpu_plan.py's budgets,
    its disk plan (check_disk) and the printed plan; a number changed there reaches each of them."""
    words = gpu_plan.command_lines(20)
    assert words["PRETRAIN"][:6] == ["--preset", "d20", "--tokens_per_param", 20, "--total_batch_tokens", 524_288]
    assert words["RL"][words["RL"].index("--ckpt_every") + 1] == gpu_plan.gpu_plan_budgets(1)["rl"]["ckpt_every"] == 60
    assert "468 steps, at most 30.7M tokens sampled (468 x 16 x 16 x 256)" in gpu_plan.plan_lines(20, 8)[1]
    assert gpu_plan.plan_checkpoints(3, 1000, 21_401, 524_288)[0] == 11
    monkeypatch.setitem(gpu_plan.FLAGS["rl"], "ckpt_every", 500)  # RL's 468 steps save once: 1 held, not 3 (+1)
    assert gpu_plan.command_lines(20)["RL"][-1] == gpu_plan.gpu_plan_budgets(1)["rl"]["ckpt_every"] == 500
    assert gpu_plan.plan_checkpoints(3, 1000, 21_401, 524_288)[0] == 8


# --- the numbers the gpu plan prints --------------------------------------------------------------------------------

def test_the_probe_on_one_gpu_says_bus_bandwidth_does_not_apply(monkeypatch, capsys, tmp_path):
    """One rank: nccl-tests' bus bandwidth (x 2(n-1)/n) is 0 by definition; it printed 0.00 GB/s. The JSON launch.py
    reads says the same."""
    import socket

    import distributed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    assert distributed.probe_all_reduce(30, mbytes=1, iters=1, out=tmp_path / "probe.json") == 0
    assert json.loads((tmp_path / "probe.json").read_text()) == {"bus_bandwidth": "n/a: one GPU"}
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("probe: 1 MB all-reduce over 1 ranks (gloo, ") and line.endswith("bus bandwidth n/a: one GPU")


def test_h100_nvl_pcie_and_sxm_each_get_their_own_peak():
    from distributed import peak_flops
    assert peak_flops("NVIDIA H100 NVL", "bfloat16") == 835e12  # was the SXM's 989e12: MFU 18% too low
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12


def test_the_eta_leaves_out_this_processs_first_step(tiny_pretrained, demo_world, tmp_path, monkeypatch, capsys):
    """The first step of a process compiles (minutes for d20): timed from the start, a resumed run's one-shot ETA
    (speedrun.sh prints it after 20 steps) counted it as a step's time. A clock where step 1 takes 100 s and the others
    about 1 s: the ETA with 1 step left is seconds, not 100 s / 5."""
    import train_loop
    clock, real = [0.0], train_loop.forward_backward

    def tick():
        clock[0] += 0.25
        return clock[0]

    def slow_first(*a, **k):
        if not getattr(slow_first, "done", False):
            clock[0] += 100  # the compilation of this process's first step
            slow_first.done = True
        return real(*a, **k)
    monkeypatch.setattr(train_loop, "now", tick)
    monkeypatch.setattr(train_loop, "forward_backward", slow_first)
    pretrain.main(["--data_dir", tiny_pretrained.parent / "text", "--tokenizer", demo_world / "tokenizer",
                   "--runs_dir", tmp_path, *TINY, "--steps", "6", "--micro_batch", "2", "--bpb_tokens", "256",
                   "--eval_every", "0", "--log_every", "1", "--sample_prompt", "A"])
    lines = {int(re.match(r"step (\d+)/6", x).group(1)): x for x in capsys.readouterr().out.splitlines()
             if re.match(r"step \d+/6 ", x)}
    assert lines[1].endswith("ETA unknown")
    eta = re.search(r"ETA (\d+):(\d+):(\d+)$", lines[5]).groups()
    assert int(eta[0]) * 3600 + int(eta[1]) * 60 + int(eta[2]) < 5, lines[5]  # before: 20 s and more


def test_the_micro_batch_probes_lines_print_on_rank_0_and_its_peak_is_forgotten(monkeypatch, capsys):
    import argparse

    import torch

    import train_loop
    from model import config_from_preset
    monkeypatch.setattr(train_loop, "build_optimizers", lambda *a, **k: [])
    monkeypatch.setattr(train_loop, "find_micro_batch", lambda try_step, candidates: 16)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    peak = [137 * 2 ** 30]  # the probe's failed try at a larger micro-batch: not the run's peak, so it is reset
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: peak[0])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: peak.__setitem__(0, 0))
    monkeypatch.setattr(train_loop, "all_reduce", lambda value, op=None: value)
    monkeypatch.setattr(train_loop.dist, "is_initialized", lambda: True)
    args = argparse.Namespace(total_batch_tokens=2048 * 64, micro_batch=0, dtype="bfloat16")
    config = config_from_preset("d20", {"vocab_size": 65536})
    line = ("batch: the probe's peak CUDA memory 137.00 GiB\n"
            "batch: micro_batch 16 is the largest that fits on every rank (probed with optimizer state)\n")
    for rank, printed in ((1, ""), (0, line)):
        monkeypatch.setattr(train_loop.dist, "get_rank", lambda rank=rank: rank)
        peak[0] = 137 * 2 ** 30
        assert train_loop.plan_batch(args, config, 2, None, torch.device("cuda")) == (16, 2, "probed")
        assert capsys.readouterr().out == printed and peak[0] == 0


# --- several nodes need one shared run directory --------------------------------------------------------------------

@pytest.mark.two_processes
def test_a_rank_that_cannot_see_the_run_directory_stops_every_rank_naming_it(tiny_pretrained, demo_world, tmp_path,
                                                                              monkeypatch):
    """2 gloo ranks, rank 1 made to look at another directory (as a node with its own disk would: the test hook
    NANOCHAT_TEST_NODE_VIEW): both ranks stop before training, naming rank 1, its host and what to do. Before, rank 0
    alone made the checkpoint directory and the other node's rank failed at the first save, hours in. Looking at the
    same directory, the check passes and the run trains."""
    from helpers import run_script
    args = ["--data_dir", tiny_pretrained.parent / "text", "--tokenizer", demo_world / "tokenizer", "--runs_dir",
            tmp_path / "runs", "--run_name", "two_nodes", *TINY, "--steps", "1", "--micro_batch", "2", "--bpb_tokens",
            "256", "--eval_every", "0", "--sample_prompt", "A"]
    (tmp_path / "other_node").mkdir()
    monkeypatch.setenv("NANOCHAT_TEST_NODE_VIEW", f"1:{tmp_path / 'other_node'}")
    result = run_script("pretrain.py", [str(a) for a in args], tmp_path, nproc=2, check=False)
    assert result.returncode != 0
    refusal = (f"pretrain.py: error: the run directory {tmp_path / 'runs' / 'two_nodes'} is not one filesystem shared "
               f"by every node: a file rank 0 (")
    assert result.stderr.count(refusal) == 2, result.stderr[-3000:]  # every rank says it
    assert "is not seen by rank 1 on " in result.stderr and f"({tmp_path / 'other_node'}). Put --runs_dir on a " \
        "filesystem every node mounts at the same path" in result.stderr
    assert not (tmp_path / "runs" / "two_nodes" / "metrics.jsonl").exists()
    monkeypatch.setenv("NANOCHAT_TEST_NODE_VIEW", f"1:{tmp_path / 'runs' / 'two_nodes'}")
    result = run_script("pretrain.py", [str(a) for a in args], tmp_path, nproc=2)
    assert "done: 1 steps" in result.stdout
