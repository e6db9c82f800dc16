"""Live run tracking (tracking.py): TensorBoard event files that hold metrics.csv, W&B offline
runs, the one-line error for a missing backend, metrics.png at every evaluation, and the
comparison plot of several runs (plotting.plot_runs, chapters/compare_runs.py)."""

import csv
import json
import runpy
from pathlib import Path

import pytest
import torch

from reasoning_from_scratch import tracking
from reasoning_from_scratch.arithmetic import make_split
from reasoning_from_scratch.cli import train as training_cli
from reasoning_from_scratch.distillation_training import DistillConfig, train_distillation
from reasoning_from_scratch.plotting import plot_runs
from reasoning_from_scratch.prm import ProcessRewardModel, train_prm
from reasoning_from_scratch.process_supervision import make_process_advantage_fn
from reasoning_from_scratch.qwen3 import Qwen3Model, tiny_config
from reasoning_from_scratch.run_log import EVAL_COLUMNS, read_metrics, seed_groups
from reasoning_from_scratch.step_scorers import CallableStepScorer
from reasoning_from_scratch.tiny_world import train_bpe_tokenizer
from reasoning_from_scratch.tracking import (
    RunTracker,
    pick_samples,
    report_targets,
    samples_markdown,
    scalar_tag,
)
from reasoning_from_scratch.training import GRPOConfig, train_grpo
from reasoning_from_scratch.weights import load_pretrained

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [{"problem": f"{a}+{b}", "answer": str(a + b)} for a, b in [(2, 3), (4, 5), (6, 7), (8, 9)]]
HELD_OUT = [{"problem": "3+4", "answer": "7"}, {"problem": "5+6", "answer": "11"}]


def _grpo_config(out, **kw):
    base = dict(steps=4, lr=1e-2, warmup_steps=1, prompts_per_step=2, num_rollouts=4,
                max_new_tokens=6, eval_every=2, eval_examples=2, eval_batch_size=2,
                sample_every=2, seed=3, output_dir=str(out), progress=False)
    return GRPOConfig(**{**base, **kw})


def _csv_columns(path):
    """{column: {step: value}} of the filled cells of a metrics.csv."""
    out = {}
    for row in read_metrics(path):
        for k, v in row.items():
            if k != "step" and v is not None:
                out.setdefault(k, {})[int(row["step"])] = v
    return out


# ----------------------------------------------------------------------------------------------
# Choosing backends
# ----------------------------------------------------------------------------------------------


def test_report_targets_and_tags():
    assert report_targets("none") == () and report_targets(None) == ()
    assert report_targets(["tensorboard", "wandb", "tensorboard"]) == ("tensorboard", "wandb")
    assert report_targets("tensorboard,wandb") == ("tensorboard", "wandb")
    with pytest.raises(ValueError, match="trackio"):
        report_targets(["trackio"])
    assert GRPOConfig(report_to=["none"]).report_to == ()
    assert GRPOConfig.from_dict({"report_to": ["tensorboard"]}).report_to == ("tensorboard",)
    assert scalar_tag("reward_mean") == "train/reward_mean"
    assert scalar_tag("eval_accuracy", evaluation=True) == "eval/accuracy"
    assert scalar_tag("val_loss", evaluation=True) == "eval/val_loss"


def test_missing_backend_is_one_line_naming_the_extra(monkeypatch, tmp_path, capsys):
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    assert tracking.missing_backend("tensorboard") is None
    with pytest.raises(ImportError, match=r'pip install -e "\.\[wandb\]"'):
        tracking.load_backend("wandb")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:  # refused before the model loads or a file is written
        training_cli.run_cli(["--report-to", "wandb", "--output-dir", str(out)], "t",
                             GRPOConfig(), "t")
    assert exc.value.code == 2 and not out.exists()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith('wandb logging needs the wandb package: pip install -e ".[wandb]" '
                        "(or pip install wandb)")


def test_no_backend_tracker_does_nothing_and_the_run_writes_no_tracking_files(tiny_dir,
                                                                              tmp_path):
    assert tracking.open_tracker((), tmp_path / "x", {}).backends == []
    model, tok = load_pretrained(tiny_dir, device="cpu")
    out = tmp_path / "run"
    train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", _grpo_config(out, steps=2))
    assert not (out / "tensorboard").exists() and not (out / "wandb").exists()


# ----------------------------------------------------------------------------------------------
# TensorBoard: a process-supervised GRPO run, read back with TensorBoard's event reader
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory):
    """A 4-step process-supervised GRPO run reporting to TensorBoard, and its event reader."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp = tmp_path_factory.mktemp("tb")
    exs = make_split("train", 20, seed=0)
    tok = train_bpe_tokenizer([e["problem"] + " Step 1: 12+3=15 \\boxed{15}" for e in exs],
                              vocab_size=300)
    torch.manual_seed(0)
    model = Qwen3Model(tiny_config(vocab_size=tok.vocab_size, num_hidden_layers=1)).eval()
    # Steps with more digits score higher: a step signal a random model's text carries.
    scorer = CallableStepScorer(lambda prompt, step: float(sum(c.isdigit() for c in step)))
    adv_fn = make_process_advantage_fn(tok, scorer, variant="sum", split_mode="newlines")
    out = tmp / "run"
    config = _grpo_config(out, max_new_tokens=12, supervision="process",
                          skip_zero_advantage=False, report_to=("tensorboard",))
    train_grpo(model, tok, exs[:8], make_split("val", 2), "cpu", config, advantage_fn=adv_fn)
    events = EventAccumulator(str(out / "tensorboard"),
                              size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    events.Reload()
    return out, events


def test_tensorboard_scalars_equal_the_metrics_csv_columns(tb_run):
    out, events = tb_run
    columns = _csv_columns(out / "metrics.csv")
    evaluation = set(EVAL_COLUMNS.values())
    assert {"reward_mean", "entropy", "kl", "clip_frac_low", "len_mean",
            "eval_accuracy"} <= set(columns)
    for col, by_step in columns.items():
        logged = {e.step: e.value for e in events.Scalars(scalar_tag(col, col in evaluation))}
        for step, value in by_step.items():
            assert logged[step] == pytest.approx(value, rel=1e-5, abs=1e-6), (col, step)
    # the evaluations: the base model at step 0, then at steps 2 and 4 (every 2, and the last)
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 2, 4]


def test_tensorboard_histograms_every_step_and_sampled_completions_with_step_scores(tb_run):
    out, events = tb_run
    for tag in ("rollouts/reward", "rollouts/advantage"):
        hist = events.Histograms(tag)
        assert [h.step for h in hist] == [1, 2, 3, 4]
        assert all(h.histogram_value.num == 8 for h in hist)  # 2 prompts x 4 rollouts
    texts = events.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [2, 4]  # every --sample-every steps
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    step4 = [s for s in samples if s["step"] == 4]
    assert all(len(s["steps"]) == len(s["step_rewards"]) >= 1 for s in step4)
    md = texts[-1].tensor_proto.string_val[0].decode()
    shown = pick_samples(step4)
    assert md == samples_markdown(shown)
    assert md.count("| step score | step |") == len(shown)
    assert f"| {shown[0]['step_rewards'][0]:.3f} |" in md


def test_a_resumed_run_hides_the_events_after_its_checkpoint(tiny_dir, tmp_path):
    """Resumed from checkpoint-2 of a finished 4-step run, the event files hold steps 3 and 4
    once (the first session's are purged, as metrics.csv drops their rows), and every scalar
    still equals its metrics.csv cell."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    config = _grpo_config(out, checkpoint_every=2, report_to=("tensorboard",))
    model, tok = load_pretrained(tiny_dir, device="cpu")
    train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", config)
    model, tok = load_pretrained(tiny_dir, device="cpu")
    train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", config, resume_from=out / "checkpoint-2")
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/reward_mean")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 2, 4]
    for col, by_step in _csv_columns(out / "metrics.csv").items():
        if col.startswith("eval_"):
            continue
        logged = {e.step: e.value for e in events.Scalars(scalar_tag(col))}
        assert logged == pytest.approx(by_step, rel=1e-5, abs=1e-6), col


def test_samples_markdown_hand_built():
    samples = [
        {"problem": "1+2", "answer": "3", "text": "Step 1: 1+2=3\n\\boxed{3}", "reward": 1.5,
         "correct": 1.0, "format": 1.0, "advantage": 0.75, "length": 9, "truncated": False,
         "steps": ["Step 1: 1+2=3\n", "\\boxed{3}"], "step_rewards": [1.0, 0.5]},
        {"problem": "1+2", "answer": "3", "text": "4", "reward": 0.0, "correct": 0.0,
         "format": 0.0, "advantage": -0.75, "length": 2, "truncated": True},
        {"problem": "1+2", "answer": "3", "text": "3", "reward": 0.5, "correct": 1.0,
         "format": 0.0, "advantage": 0.0, "length": 2, "truncated": False},
    ]
    assert pick_samples(samples) == [samples[0], samples[1]]  # best and worst of the prompt
    md = samples_markdown(samples[:2])
    assert md == (
        "**problem** 1+2 · **answer** 3  \n"
        "reward **1.500** (correct 1.00, format 1.00) · advantage +0.750 · 9 tokens\n\n"
        "    Step 1: 1+2=3\n    \\boxed{3}\n\n---\n\n"
        "| step score | step |\n|---:|---|\n| 1.000 | Step 1: 1+2=3 |\n| 0.500 | \\boxed{3} |"
        "\n\n---\n\n"
        "**problem** 1+2 · **answer** 3  \n"
        "reward **0.000** (correct 0.00, format 0.00) · advantage -0.750 · 2 tokens "
        "(truncated)\n\n    4")


def test_metrics_png_is_drawn_at_the_first_evaluation(tiny_dir, tmp_path):
    model, tok = load_pretrained(tiny_dir, device="cpu")
    out = tmp_path / "run"

    def stop_after_first_eval(phase, step):
        if phase == "rollouts" and step == 3:
            assert (out / "metrics.png").read_bytes()[:4] == b"\x89PNG"
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", _grpo_config(out),
                   phase_hook=stop_after_first_eval)
    assert (out / "metrics.png").is_file() and not (out / "summary.json").exists()


def test_distillation_and_prm_report_their_rows(tiny_dir, tmp_path):
    """The distillation loop and the PRM loop send every metrics row to the tracker."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, tok = load_pretrained(tiny_dir, device="cpu")
    traces = [{"problem": f"Compute {a} + {b}.", "answer": str(a + b),
               "completion": f"Step 1: {a} + {b} = {a + b}\n\\boxed{{{a + b}}}"}
              for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    out = tmp_path / "distill"
    config = DistillConfig(steps=3, batch_size=2, lr=1e-2, warmup=1, val_fraction=0.25,
                           eval_every=2, eval_examples=2, eval_max_new_tokens=4,
                           eval_batch_size=2, output_dir=str(out), progress=False,
                           report_to=("tensorboard",))
    train_distillation(model, tok, traces, HELD_OUT, "cpu", config)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    columns = _csv_columns(out / "metrics.csv")
    assert {e.step: e.value for e in events.Scalars("train/loss")} == pytest.approx(
        columns["loss"], rel=1e-5)
    assert {e.step: e.value for e in events.Scalars("eval/val_loss")} == pytest.approx(
        {0: events.Scalars("eval/val_loss")[0].value, **columns["val_loss"]}, rel=1e-5)

    class Recorder:  # a backend that keeps what it is sent
        def __init__(self):
            self.scalars_seen = []

        def scalars(self, values, step):
            self.scalars_seen.append((step, values))

        def flush(self):
            pass

    rec = Recorder()
    prm = ProcessRewardModel.from_pretrained_backbone(model)
    records = [{"prompt": "1+2=", "completions": ["3"], "labels": [True]},
               {"prompt": "2+2=", "completions": ["5"], "labels": [False]}]
    losses = train_prm(prm, tok, records, epochs=2, batch_size=1, tracker=RunTracker([rec]))
    assert [(s, v["train/loss"]) for s, v in rec.scalars_seen] == list(
        zip(range(1, 5), losses))


def test_ch09_script_reports_to_tensorboard(tiny_dir, tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from reasoning_from_scratch.distillation import write_traces

    traces = write_traces([{"problem": f"Compute {a} + {b}.", "answer": str(a + b),
                            "completion": f"Step 1: {a} + {b} = {a + b}\n\\boxed{{{a + b}}}"}
                           for a, b in [(1, 2), (3, 4), (5, 6)]], tmp_path / "traces.jsonl")
    out = tmp_path / "run"
    main = runpy.run_path(str(ROOT / "chapters" / "ch09_distill.py"), run_name="ch09")["main"]
    main(["--teacher", str(tiny_dir), "--student", str(tiny_dir), "--traces", str(traces),
          "--output-dir", str(out), "--steps", "3", "--batch-size", "2", "--eval-examples", "2",
          "--eval-max-new-tokens", "4", "--eval-every", "0", "--val-fraction", "0",
          "--no-progress", "--device", "cpu", "--threads", "1", "--report-to", "tensorboard"])
    assert json.loads((out / "config.json").read_text())["report_to"] == ["tensorboard"]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 3]


# ----------------------------------------------------------------------------------------------
# W&B, offline
# ----------------------------------------------------------------------------------------------


def test_wandb_offline_writes_its_run_files(tiny_dir, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert tracking.wandb_mode() == "offline"
    model, tok = load_pretrained(tiny_dir, device="cpu")
    out = tmp_path / "run"
    train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", _grpo_config(out, report_to=("wandb",)))
    wandb.teardown()  # W&B's service process writes the record log: wait until it has
    (run,) = (out / "wandb").glob("offline-run-*")
    (history,) = run.glob("run-*.wandb")
    data = history.read_bytes()
    assert data[:4] == b":W&B"  # W&B's record log, uploaded by `wandb sync`
    for tag in ("train/reward_mean", "train/len_mean", "eval/accuracy", "rollouts/reward"):
        assert tag.encode() in data
    tables = sorted(run.glob("files/media/table/samples_*.table.json"))
    assert [int(p.name.split("_")[1]) for p in tables] == [2, 4]  # every --sample-every steps
    table = json.loads(tables[0].read_text())
    step2 = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()
             if json.loads(line)["step"] == 2]
    assert [row[2] for row in table["data"]] == [s["text"] for s in pick_samples(step2)]


def test_wandb_mode_without_an_account_is_offline(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no `wandb login`
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert tracking.wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert tracking.wandb_mode() == "disabled"


# ----------------------------------------------------------------------------------------------
# Comparing runs
# ----------------------------------------------------------------------------------------------


def _fake_run(path, config, rewards, accuracy_at):
    """A run directory with config.json and a metrics.csv of hand-chosen numbers."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**config, "output_dir": str(path)}))
    with open(path / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "reward_mean", "eval_accuracy"])
        for step, r in enumerate(rewards, 1):
            w.writerow([step, r, accuracy_at.get(step, "")])
    return path


def test_plot_runs_one_line_per_run_and_mean_sd_over_seeds(tmp_path):
    a = _fake_run(tmp_path / "a", {"lr": 1e-4, "seed": 1}, [0.1, 0.2, 0.3], {2: 0.5})
    b = _fake_run(tmp_path / "b", {"lr": 2e-4, "seed": 1}, [0.2, 0.4, 0.6], {2: 0.6})
    fig = plot_runs([a, b], ["reward_mean", "eval_accuracy"])
    assert [len(ax.lines) for ax in fig.axes] == [2, 2]
    assert [line.get_label() for line in fig.axes[0].lines] == ["lr=0.0001", "lr=0.0002"]
    assert list(fig.axes[1].lines[0].get_xdata()) == [2]  # evaluations only where measured
    # seeds of one setting: one line, their mean, and a band of one sd
    a2 = _fake_run(tmp_path / "a2", {"lr": 1e-4, "seed": 2}, [0.3, 0.4, 0.5], {2: 0.7})
    assert seed_groups([a, b, a2]) == [("lr=0.0001 (2 seeds)", [a, a2]), ("lr=0.0002", [b])]
    fig = plot_runs([a, b, a2], ["reward_mean"], save_as=tmp_path / "cmp.png")
    (ax,) = fig.axes
    assert len(ax.lines) == 2 and len(ax.collections) == 1
    assert list(ax.lines[0].get_ydata()) == pytest.approx([0.2, 0.3, 0.4])
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    assert max(band) == pytest.approx(0.4 + 0.1 * 2 ** 0.5)  # sd of (0.3, 0.5)
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"
    fig = plot_runs([a, b, a2], ["reward_mean"], group_seeds=False)
    assert len(fig.axes[0].lines) == 3
    with pytest.raises(ValueError, match="no column"):
        plot_runs([a], ["kl"])
    with pytest.raises(FileNotFoundError, match="not a training run"):
        plot_runs([tmp_path], ["kl"])


def test_compare_runs_script(tmp_path, capsys):
    a = _fake_run(tmp_path / "a", {"lr": 1e-4, "seed": 1}, [0.1, 0.2], {2: 0.5})
    b = _fake_run(tmp_path / "b", {"lr": 2e-4, "seed": 1}, [0.2, 0.4], {2: 0.6})
    main = runpy.run_path(str(ROOT / "chapters" / "compare_runs.py"), run_name="compare")["main"]
    main([str(a), str(b), "--metric", "reward_mean", "eval_accuracy", "--smooth", "0.5",
          "--out", str(tmp_path / "fig.png")])
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main([str(a), "--metric", "kl", "--out", str(tmp_path / "x.png")])
    assert exc.value.code == 2 and "no column(s) ['kl']" in capsys.readouterr().err
