"""The gpu plan's command lines as a user meets them: budget overrides appended through *_ARGS, a small source on
many data streams, a resume on fewer GPUs, speedrun.sh's GPU checks and refusals, each rank's progress record, the
disk the plan really keeps. Each test here failed on the code before its fix (dev/LOG.md, 2026-11-25)."""
import pytest

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


def test_the_data_plan_counts_the_budget_that_is_in_force(demo_world, tmp_path, capsys):
    """speedrun.sh's data_plan stage gets GPU_BUDGET then PRETRAIN_ARGS: the shards are planned for the --steps."""
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
