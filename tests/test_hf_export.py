"""An FSDP run's Hugging Face weights: written into final/ always and into checkpoint-<k> only
with --export-hf-checkpoints; resuming reads the shards alone (one CPU process, a Gloo group
of one, the bundled tiny model)."""

import shutil

import pytest
from test_distributed import _run_here, _weights
from tolerance import max_diff, saved_weights

from reasoning_from_scratch.checkpoints import checkpoint_problem, find_checkpoint
from reasoning_from_scratch.fsdp import SHARDED_DIR
from reasoning_from_scratch.weights import has_weights, load_pretrained, save_pretrained

FLAGS = ["--steps", "2", "--prompts-per-step", "2", "--num-rollouts", "2",
         "--max-new-tokens", "16", "--eval-examples", "1", "--eval-every", "0",
         "--train-examples", "16", "--train-level-weights", "1,1,0,0,0", "--lr", "1e-3",
         "--warmup-steps", "0", "--checkpoint-every", "1", "--keep-checkpoints", "0",
         "--checkpoint-minutes", "0", "--fsdp", "--threads", "1", "--device", "cpu",
         "--no-progress"]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two sharded steps, a checkpoint after each: by default and with the export asked for."""
    tmp = tmp_path_factory.mktemp("export")
    _run_here(["--output-dir", str(tmp / "default"), *FLAGS])
    _run_here(["--output-dir", str(tmp / "exported"), *FLAGS, "--export-hf-checkpoints"])
    return tmp


def test_checkpoints_lack_the_hf_weights_unless_asked_and_final_has_them(runs):
    for k in (1, 2):
        ckpt = runs / "default" / f"checkpoint-{k}"
        assert not has_weights(ckpt)  # config and tokenizer only, beside the shards
        assert (ckpt / "config.json").is_file() and (ckpt / SHARDED_DIR / ".metadata").is_file()
        assert checkpoint_problem(ckpt) is None  # intact: the shards are its model state
        assert has_weights(runs / "exported" / f"checkpoint-{k}")
    for name in ("default", "exported"):
        assert has_weights(runs / name / "final")
    assert find_checkpoint(runs / "default").name in ("checkpoint-2", "final")
    # the export holds the weights of its step: checkpoint-2's are final/'s
    exported = saved_weights(runs / "exported" / "checkpoint-2")
    assert max_diff(exported, _weights(runs / "exported")) == 0.0
    assert max_diff(_weights(runs / "default"), _weights(runs / "exported")) == 0.0


def test_a_checkpoint_without_hf_weights_resumes_exactly(runs):
    out = runs / "resumed"
    shutil.copytree(runs / "default", out)
    for later in ("checkpoint-2", "final", "summary.json"):
        target = out / later
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    _run_here(["--resume", str(out), "--no-progress", "--threads", "1"])
    assert max_diff(_weights(out), _weights(runs / "default")) == 0.0


def test_save_pretrained_without_weights_writes_the_rest(tmp_path):
    model, tok = load_pretrained("tiny-arith", device="cpu")
    save_pretrained(model, tok, tmp_path, weights=False)
    assert not has_weights(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {"config.json", "generation_config.json"}
