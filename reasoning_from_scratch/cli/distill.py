"""Chapter 9's command line: teacher -> verified traces -> SFT of a student (`run_distill_cli`).

The steps, each written into the run directory so a resumed run redoes none of them:
1. the teacher: `--teacher` (a local HF directory, a hub id or a checkpoint), or by default the
   chapter 7 trained model, cached in `--teacher-run-dir` (trained there with chapter 7's
   defaults the first time, resumed if that run was interrupted);
2. traces.jsonl: the teacher's solutions to the training problems, kept only when verified
   (`distillation.generate_distillation_data`), or `--traces FILE` made elsewhere (verified too,
   unless `--no-verify-traces`);
3. the student (`--student`, default the bundled base model) fine-tuned on them
   (`distillation_training.train_distillation`), evaluated greedily before, during and after;
4. summary.json: student_base_accuracy, student_final_accuracy, teacher_accuracy, wall_seconds
   and the trace statistics.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from ..checkpoints import (
    CheckpointWriteError,
    check_new_run_dir,
    checkpoint_problem,
    find_checkpoint_or_restart,
    read_trainer_state,
    run_contents,
    run_dir_of,
)
from ..datasets import DATASET_NAMES
from ..device import check_device
from ..distillation import filter_traces, generate_distillation_data, read_traces, write_traces
from ..distillation_training import (
    DISTILL_RULES,
    DistillConfig,
    train_distillation,
)
from ..distributed import (
    DEFAULT_TIMEOUT_MINUTES,
    is_main,
    run_on_main,
    world_size,
)
from ..evaluation import evaluate_policy
from ..files import atomic_write_json, read_json
from ..fsdp import check_fsdp_run, load_for_run
from ..interrupts import (
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    StopSignal,
    defer_interrupts,
    exit_status,
    stop_reason,
)
from ..run_dir import mark_stopped, stoppable_before_run, write_run_config
from ..training import GRPOConfig
from ..validation import arg_type, positive_int
from ..weights import load_pretrained
from .arguments import add_dtype_argument, add_runtime_arguments, add_sampling_arguments
from .launch import add_timeout_argument, run_in_process_group
from .train import (
    add_data_arguments,
    add_report_argument,
    check_report_backends,
    explicit_flags,
    load_grpo_data,
    run_cli,
)

TEACHER_RUN_DIR = "runs/ch07-teacher"
TRACES_FILE = "traces.jsonl"
# The teacher's finished sampling batches while it samples (distillation.SampledBatches)
PARTIAL_TRACES_FILE = "traces.partial.jsonl"
# Help and range of every DistillConfig field live in its metadata (distillation_training.py)
DISTILL_HELP = {f.name: f.metadata["help"] for f in fields(DistillConfig)}


def add_teacher_arguments(parser) -> None:
    """--teacher, --teacher-run-dir and --student (chapter 9's scripts)."""
    parser.add_argument("--teacher", default=None,
                        help="teacher model: local HF dir, hub id or checkpoint (None: the "
                             "chapter 7 trained model in --teacher-run-dir, trained there first "
                             "if missing)")
    parser.add_argument("--teacher-run-dir", default=TEACHER_RUN_DIR,
                        help="where the default chapter 7 teacher is trained and cached")
    parser.add_argument("--student", default="tiny-arith",
                        help="student model: bundled name, local HF dir or hub id")


def build_distill_parser(description: str) -> argparse.ArgumentParser:
    """Every flag of chapters/ch09_distill.py (defaults shown by --help)."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_teacher_arguments(p)
    p.add_argument("--traces", default=None,
                   help="JSONL of traces made elsewhere (problem, answer, completion) to train "
                        "on instead of sampling the teacher")
    p.add_argument("--no-verify-traces", dest="verify_traces", action="store_false",
                   help="train on --traces as they are (default: keep only verified ones)")
    p.add_argument("--dataset", default="arith", choices=DATASET_NAMES,
                   help="problems: the teacher solves its training split, the student is "
                        "evaluated on its held-out split (math: MATH train / MATH-500)")
    add_data_arguments(p)
    # 2000 problems x 4 samples: about 1.5 minutes of teacher sampling on one CPU core and ~2000
    # distinct verified traces; the whole 10k split takes 4x longer for little gain
    p.set_defaults(train_examples=2000)
    p.add_argument("--num-samples", type=positive_int, default=4,
                   help="teacher samples per training problem (rejection sampling)")
    p.add_argument("--max-per-problem", type=positive_int, default=4,
                   help="distinct verified traces kept per problem at most")
    p.add_argument("--no-check-steps", dest="check_steps", action="store_false",
                   help="keep traces with a right answer even if an arithmetic step is wrong "
                        "(default: the step verifier must accept every step where one exists)")
    add_sampling_arguments(p, prefix="teacher_", temperature=1.0, top_p=1.0,
                           helps={"temperature": "teacher sampling temperature",
                                  "top_p": "teacher nucleus-sampling threshold"})
    add_sampling_arguments(p, max_new_tokens=112, helps={
        "max_new_tokens": "maximum tokens of a teacher solution (truncated ones are dropped)"})
    p.add_argument("--prompts-per-batch", type=positive_int, default=64,
                   help="training problems decoded together when sampling the teacher")
    defaults = DistillConfig()
    for f in fields(DistillConfig):
        if f.name in ("progress", "output_dir"):
            continue
        if f.name in ("fsdp", "export_hf_checkpoints", "activation_checkpointing"):
            p.add_argument("--" + f.name.replace("_", "-"), action="store_true",
                           help=DISTILL_HELP[f.name])
            continue
        if f.name == "report_to":
            add_report_argument(p, help=DISTILL_HELP["report_to"])
            continue
        if f.name == "compile":  # None: on for CUDA, off elsewhere
            p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                           help=DISTILL_HELP["compile"])
            continue
        kind = type(getattr(defaults, f.name))  # int, float or str
        p.add_argument("--" + f.name.replace("_", "-"), type=arg_type(kind, DISTILL_RULES[f.name]),
                       default=getattr(defaults, f.name), help=DISTILL_HELP[f.name])
    p.add_argument("--output-dir", default=None, help=DISTILL_HELP["output_dir"])
    p.add_argument("--resume", default=None,
                   help="run directory to continue exactly (its saved settings are used; "
                        "--steps, --report-to, --fsdp, --export-hf-checkpoints, --device and "
                        "--threads may be given again)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --output-dir")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars")
    p.add_argument("--record", default=None,
                   help="JSON file of several runs' results (e.g. docs/distill_step_check.json): "
                        "this run's figures are added under '<filter>-seed<seed>' (filter: "
                        "answer+steps or answer), replacing an earlier run of that name")
    add_runtime_arguments(p)
    add_timeout_argument(p)
    add_dtype_argument(p, "dtype of teacher and student")
    return p


def chapter7_teacher(run_dir=TEACHER_RUN_DIR, threads: int | None = 1, device=None) -> Path:
    """The chapter 7 trained model (run_dir/final), trained with chapter 7's defaults if absent.

    An interrupted earlier training is resumed from its checkpoint, not restarted.
    """
    run_dir = Path(run_dir)
    final = run_dir / "final"
    if final.is_dir() and checkpoint_problem(final) is None \
            and read_trainer_state(final)["step"] > 0 and (run_dir / "summary.json").is_file():
        return final
    argv = ["--output-dir", str(run_dir), "--threads", str(threads)]
    if device:
        argv += ["--device", str(device)]
    if any(name.startswith("checkpoint-") for name in run_contents(run_dir)):
        argv = ["--resume", str(run_dir), "--threads", str(threads)]
    elif run_dir.exists():
        argv.append("--overwrite")
    what = "continuing its training" if argv[0] == "--resume" else "training it now"
    print(f"no chapter 7 teacher in {run_dir}: {what} (chapter 7 defaults, "
          f"python chapters/ch07_train.py {' '.join(argv)})")
    run_cli(argv, "chapter 7 teacher for distillation", GRPOConfig(), "ch07")
    return final


def _resolve(parser, args, argv):
    """(config, data settings, checkpoint or None) of a new or resumed run; errors exit 2."""
    values = {f.name: getattr(args, f.name) for f in fields(DistillConfig)
              if f.name != "output_dir"}
    data = {k: getattr(args, k) for k in (
        "teacher", "teacher_run_dir", "student", "traces", "verify_traces", "dataset",
        "eval_split", "train_examples", "train_level_weights", "num_samples", "max_per_problem",
        "check_steps", "teacher_temperature", "teacher_top_p", "max_new_tokens",
        "prompts_per_batch", "dtype")}
    try:
        if args.device:
            check_device(args.device)
        if args.resume:
            ckpt = find_checkpoint_or_restart(args.resume)
            run_dir = run_dir_of(ckpt) if ckpt else Path(args.resume).resolve()
            saved = read_trainer_state(ckpt)["config"] if ckpt else \
                read_json(run_dir / "config.json")  # no checkpoint: start over in place
            steps_given = any(a == "--steps" or a.startswith("--steps=") for a in argv or [])
            report_given = any(a.startswith("--report-to") for a in argv or [])
            fsdp_given = "--fsdp" in (argv or [])
            export_given = "--export-hf-checkpoints" in (argv or [])
            values = {**saved, "steps": args.steps if steps_given else saved["steps"],
                      "fsdp": True if fsdp_given else saved.get("fsdp", False),
                      "export_hf_checkpoints": export_given
                      or saved.get("export_hf_checkpoints", False),
                      "progress": args.progress, "output_dir": str(run_dir),
                      "report_to": args.report_to if report_given
                      else saved.get("report_to", ())}
            data = read_json(run_dir / "data.json")
            if "dtype" in explicit_flags(argv) or "dtype" not in data:
                data["dtype"] = args.dtype  # else the run's own: a resumed run keeps it
        else:
            ckpt = None
            values["output_dir"] = args.output_dir or time.strftime("runs/ch09-%Y%m%d-%H%M%S")
            if not args.overwrite:
                check_new_run_dir(values["output_dir"])
            if args.traces and not Path(args.traces).is_file():
                raise FileNotFoundError(f"--traces {args.traces}: no such file")
            if data["dataset"] != "arith":
                data["train_level_weights"] = None
        config = DistillConfig.from_dict(values)
        check_fsdp_run(config.fsdp, ckpt)
        check_report_backends(parser, config.report_to)
        return config, data, ckpt
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        parser.error(str(err))


def _traces(data, out, teacher, tokenizer, train, config):
    """The run's trace records: reused from out/traces.jsonl, read from --traces, or sampled
    (continuing a sampling that was stopped: out/traces.partial.jsonl)."""
    path = out / TRACES_FILE
    if path.is_file():  # a resumed run, or a rerun that only got this far
        return read_traces(path), data.get("generation")
    if data["traces"]:
        records = read_traces(data["traces"], require_answer=data["verify_traces"])
        if data["verify_traces"]:
            records = filter_traces(records, data["check_steps"])
        stats = {"source": data["traces"], "kept": len(records)}
    else:
        records, stats = generate_distillation_data(
            teacher, tokenizer, train, num_samples=data["num_samples"],
            max_per_problem=data["max_per_problem"], temperature=data["teacher_temperature"],
            top_p=data["teacher_top_p"], max_new_tokens=data["max_new_tokens"],
            prompts_per_batch=data["prompts_per_batch"], check_steps=data["check_steps"],
            seed=config.seed, teacher_name=data["teacher_source"], progress=config.progress,
            partial_path=out / PARTIAL_TRACES_FILE)
    if not records:  # an Exception, so run_on_main hands it to every process
        raise NoTracesError("no verified traces to train on (try more --num-samples or "
                            "--no-check-steps)")
    write_traces(records, path)
    (out / PARTIAL_TRACES_FILE).unlink(missing_ok=True)
    return records, stats


# The figures of a run that `record_run` keeps (summary.json has more)
RECORDED = ("teacher", "teacher_accuracy", "student", "student_base_accuracy",
            "student_final_accuracy", "final_step_correctness", "final_carry_step_correctness",
            "final_right_answer_wrong_step", "final_format_rate", "steps", "train_traces",
            "eval_examples", "output_dir")


def record_name(data: dict, seed: int) -> str:
    """A run's name in a `--record` file: "answer+steps-seed0" or "answer-seed0"."""
    return f"{'answer+steps' if data['check_steps'] else 'answer'}-seed{seed}"


def record_run(path, summary: dict, data: dict) -> dict:
    """Add a finished run's figures (RECORDED, the traces kept, the filter, the seed) to the JSON
    file `path` under `record_name`, replacing an earlier run of that name; returns the file's
    content. Several runs (seeds, with and without the step check) thus write one results
    file that a notebook or a table reads."""
    path = Path(path)
    content = read_json(path) if path.is_file() else {}
    seed = summary["config"]["seed"]
    entry = {**{k: summary.get(k) for k in RECORDED}, "seed": seed,
             "check_steps": data["check_steps"], "traces_kept": summary["traces"].get("kept"),
             "recorded_by": "ch09_distill.py --record"}
    runs = {**content.get("runs", {}), record_name(data, seed): entry}
    content = {**content, "runs": dict(sorted(runs.items()))}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, content)
    return content


class NoTracesError(RuntimeError):
    """The teacher (or --traces) gave no verified trace: nothing to train the student on."""


@dataclass
class DistillRun:
    """A checked chapter 9 command: what `run_distillation` needs, as plain values."""

    config: DistillConfig
    data: dict  # teacher, student, traces and data settings (saved in data.json)
    checkpoint: str | Path | None = None  # resume from this checkpoint
    device: str | None = None
    threads: int | None = 1  # torch CPU threads (0 or None: torch's default)
    dtype: str = "float32"
    overwrite: bool = False
    dist_timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES  # collectives' patience (launch.py)
    record: str | Path | None = None  # add the run's figures to this JSON file (`record_run`)


def parse_distill_args(argv, description: str) -> DistillRun:
    """Parse and check chapters/ch09_distill.py's flags; a bad value exits 2 before anything
    is written."""
    parser = build_distill_parser(description)
    args = parser.parse_args(argv)
    config, data, ckpt = _resolve(parser, args, argv)
    restart = bool(args.resume) and ckpt is None  # no checkpoint yet: the run starts over
    return DistillRun(config, data, ckpt, args.device, args.threads, data["dtype"],
                      args.overwrite or restart, args.dist_timeout_minutes, args.record)


def run_distill_cli(argv, description: str) -> dict:
    """`parse_distill_args` then `run_distillation`: the whole command line in one call."""
    return run_distillation(parse_distill_args(argv, description))


def run_distillation(run: DistillRun) -> dict:
    """Get teacher and traces, distil into the student; returns the summary.

    Under torchrun (distributed.py) every process runs this: the teacher is evaluated on each
    process's share of the problems, rank 0 alone samples the traces (the others wait for them),
    and every process trains on its share of each batch (`train_distillation`).
    """
    return run_in_process_group(_distill, run, "ch09_distill.py")


def _teacher_phase(run: DistillRun, data, out, device, train, held_out):
    """The teacher's part of the run, before the student's run has state: (teacher or None,
    trace records, trace statistics). Fills data's teacher_source, teacher_accuracy and
    generation as they become known and writes out/data.json and out/traces.jsonl."""
    config = run.config
    teacher_source = data.get("teacher_source") or data["teacher"]
    needs_teacher = not data["traces"] or data["teacher"]
    if needs_teacher and teacher_source is None:
        if world_size() > 1:  # chapter7_teacher runs a whole (one-process) training
            raise SystemExit(f"error: no --teacher given; train the chapter 7 teacher first "
                             f"(torchrun ... chapters/ch07_train.py --output-dir "
                             f"{data['teacher_run_dir']}) or pass --teacher")
        teacher_source = str(_chapter7_teacher_or_stop(data["teacher_run_dir"], run))
    data["teacher_source"] = teacher_source
    teacher = tokenizer = None
    if teacher_source is not None and (data.get("teacher_accuracy") is None
                                       or not (out / TRACES_FILE).is_file()):
        teacher, tokenizer = load_pretrained(teacher_source, device=device,
                                             dtype=getattr(torch, run.dtype))
        if data.get("teacher_accuracy") is None:  # every process evaluates its share
            data["teacher_accuracy"] = evaluate_policy(
                teacher, tokenizer, held_out, device, config.eval_max_new_tokens,
                config.eval_batch_size)["accuracy"]
            if is_main():
                print(f"teacher {teacher_source}: held-out accuracy "
                      f"{data['teacher_accuracy']:.3f}")
    data.setdefault("teacher_accuracy", None)
    records, stats = run_on_main(_traces, data, out, teacher, tokenizer, train, config)
    data["generation"] = stats
    run_on_main(atomic_write_json, out / "data.json", data)
    return teacher, records, stats


def _chapter7_teacher_or_stop(run_dir, run: DistillRun) -> Path:
    """`chapter7_teacher`; a stop of its training (its checkpoint saved, exit 75 / 130) becomes
    this run's stop, so this run's directory is marked stopped too."""
    try:
        return chapter7_teacher(run_dir, run.threads, run.device)
    except SystemExit as end:
        if end.code in (EXIT_STOPPED, EXIT_INTERRUPTED):
            raise (StopSignal(signal.SIGTERM) if end.code == EXIT_STOPPED
                   else KeyboardInterrupt()) from None
        raise


def _save_stopped_teacher(out, data, config, stop):
    """Rank 0, after a stop before the student's run began: config.json and data.json (what a
    `--resume` of this directory starts over from; the teacher's accuracy and finished sampling
    batches are kept) and the `stopped` file, then how to continue."""
    with defer_interrupts():
        out.mkdir(parents=True, exist_ok=True)
        write_run_config(out, config)
        atomic_write_json(out / "data.json", data)
        mark_stopped(out, exit_status(stop))
    kept = "" if not (out / PARTIAL_TRACES_FILE).is_file() else \
        f"; its finished teacher samples are in {out / PARTIAL_TRACES_FILE}"
    print(f"{stop_reason(stop)} before the student's training{kept}; continue with "
          f"--resume {out}")


def _distill(run: DistillRun, device) -> dict:
    """`run_distillation` once the process group (if any) is joined."""
    config, data, ckpt = run.config, run.data, run.checkpoint
    t0 = time.time()
    out = Path(config.output_dir)
    dtype = getattr(torch, run.dtype)
    train, held_out = load_grpo_data(data["dataset"], data["train_examples"], data["eval_split"],
                                     config.eval_examples, data["train_level_weights"])
    run_on_main(out.mkdir, parents=True, exist_ok=True)
    try:
        with stoppable_before_run(config.stop_signals):
            teacher, records, stats = _teacher_phase(run, data, out, device, train, held_out)
    except KeyboardInterrupt as stop:  # nothing to checkpoint: the settings, traces so far
        run_on_main(_save_stopped_teacher, out, data, config, stop)
        raise SystemExit(exit_status(stop)) from None
    except NoTracesError as err:
        raise SystemExit(f"error: {err}") from None
    del teacher
    teacher_accuracy = data["teacher_accuracy"]
    student, student_tok = load_for_run(ckpt or data["student"], device, dtype,
                                        sharded=config.fsdp)  # FSDP: a sharded start
    if is_main():
        where = "" if world_size() == 1 else f" ({device.type} x {world_size()} processes)"
        print(f"student {data['student']}: {len(records)} traces; run dir {out}{where}")
    try:
        summary = train_distillation(student, student_tok, records, held_out, device, config,
                                     resume_from=ckpt, overwrite=run.overwrite)
    except KeyboardInterrupt as stop:  # Ctrl-C or a stop signal: the checkpoint is saved
        raise SystemExit(exit_status(stop)) from None
    except CheckpointWriteError as err:  # a full disk: one line, no traceback
        raise SystemExit(f"error: {err}") from None
    # wall_seconds: this command's, teacher sampling included (train_distillation's own
    # summary times the SFT run alone; it stays as sft_wall_seconds)
    summary = {"student_base_accuracy": summary["base_accuracy"],
               "student_final_accuracy": summary["final_accuracy"],
               "teacher_accuracy": teacher_accuracy, "wall_seconds": time.time() - t0,
               "sft_wall_seconds": summary["wall_seconds"], "teacher": data["teacher_source"],
               "student": data["student"], "traces": stats, "config": asdict(config),
               **{k: v for k, v in summary.items() if k != "wall_seconds"}}
    run_on_main(atomic_write_json, out / "summary.json", summary)
    if run.record:
        run_on_main(record_run, run.record, summary, data)
    if is_main():
        print(json.dumps({k: summary[k] for k in ("student_base_accuracy",
                                                  "student_final_accuracy",
                                                  "teacher_accuracy", "wall_seconds")},
                         indent=2))
    return summary
