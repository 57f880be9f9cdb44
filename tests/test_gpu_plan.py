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
