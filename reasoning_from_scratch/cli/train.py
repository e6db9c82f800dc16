"""The chapter 6-7 training scripts' command line: flags for every GRPOConfig field, data flags,
resume, and `run_cli` (parse, check, load model and data, `train_grpo`).

--help lists the flags in groups: each GRPOConfig field's flag under the group its metadata
names (`CONFIG_GROUPS`: core first, then process, variants, systems, run), the script's own
flags (model and data, resume, device) in `SCRIPT_GROUPS`; docs/flags.md is the same list as a
table (`flags_table`).

Every bad value is refused by argparse before anything is written (one line, exit status 2):
numbers outside their range (the rules live next to GRPOConfig), a device this torch cannot
use, a new run pointed at a directory that holds one, a resume of a run whose checkpoints are
all unusable (a run that stopped before its first checkpoint starts over in place).

Exit status: 0 done; 130 after Ctrl-C and 75 after a stop signal (SIGTERM, SIGHUP, SIGUSR1), a
checkpoint saved in both cases (interrupts.py); 1 with one line when a checkpoint could not be
written (a full disk: the line names the path and the free space); 2 for bad flags.

Started by `torchrun --nproc-per-node N`, the same script trains data-parallel (distributed.py,
`training.train_grpo`): every process parses the same flags, joins the process group, loads
the model onto its own device (GPU LOCAL_RANK on CUDA) and trains on its share of each step;
rank 0 alone writes and prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ..checkpoints import (
    CheckpointWriteError,
    check_new_run_dir,
    find_checkpoint_or_restart,
    read_trainer_state,
    run_dir_of,
)
from ..datasets import DATASET_NAMES, load_dataset_by_name
from ..device import check_device
from ..distributed import (
    DEFAULT_TIMEOUT_MINUTES,
    env_world_size,
    is_main,
    run_on_main,
    world_size,
)
from ..files import atomic_write_json, read_json
from ..fsdp import check_fsdp_run, load_for_run
from ..interrupts import exit_status
from ..tracking import REPORT_CHOICES, missing_backend, report_targets
from ..training import DEFAULT_TRAIN_LEVEL_WEIGHTS, GRPOConfig, train_grpo
from ..validation import arg_type, optional_positive_int
from .arguments import add_dtype_argument, add_model_argument, add_runtime_arguments
from .launch import add_timeout_argument, run_in_process_group

# Help, range, choices and group of every GRPOConfig field live in its metadata (training.py)
CONFIG_HELP = {f.name: f.metadata["help"] for f in fields(GRPOConfig)}
# The groups of the fields (metadata "group"), in --help's order: title -> what they hold
CONFIG_GROUPS = {
    "core": "the GRPO step of chapters 6-7: optimizer, rollouts, rewards, advantages, loss, seed "
            "and run directory",
    "process": "process supervision (chapter 8): step scorers, process advantages, branches at "
               "the first error",
    "variants": "GRPO variants of the literature: GDPO reward normalisation, DAPO dynamic "
                "sampling and truncation masking, KL estimator, truncated importance sampling, "
                "off-policy masking",
    "systems": "speed and memory: compiled paths, precision, activation checkpointing, FSDP",
    "run": "evaluation, samples, checkpoints, live logging, stop signals, progress",
}
# The training scripts' own flags (not config fields), shown after core
SCRIPT_GROUPS = {
    "model and data": "the starting model, the training problems and the held-out set",
    "resume": "continue a run where it stopped, or replace one",
    "device": "where the run computes, in which dtype, and torchrun's patience",
}
CHOICES = {f.name: f.metadata["choices"] for f in fields(GRPOConfig) if f.metadata["choices"]}
# fields whose default is None: their value type ('none' on the command line gives None)
OPTIONAL_TYPES = {f.name: float if f.type.startswith("float") else int
                  for f in fields(GRPOConfig) if f.type.endswith("| None")}


def add_argument_groups(parser, titles: dict) -> dict:
    """{title: argument group} for `titles` ({title: description}), in that order; on an
    argument group rather than a parser (argparse does not nest them), that group for each."""
    if not isinstance(parser, argparse.ArgumentParser):
        return {title: parser for title in titles}
    return {title: parser.add_argument_group(title, about) for title, about in titles.items()}


def add_config_arguments(parser, defaults: GRPOConfig, helps: dict | None = None,
                         groups: dict | None = None) -> dict:
    """One `--dashed-flag` per GRPOConfig field, with help text, defaults and range checks,
    group by group (`CONFIG_GROUPS`); `helps` replaces the help of some fields (a script that
    uses them differently). A field goes into `groups[its group]` where given, else into a new
    argument group of `parser` titled by its group (all into `parser` itself when it is an
    argument group). Returns {group: where its flags went}."""
    helps = {**CONFIG_HELP, **(helps or {})}
    missing = {g: about for g, about in CONFIG_GROUPS.items() if g not in (groups or {})}
    groups = {**(groups or {}), **add_argument_groups(parser, missing)}
    for f in sorted(fields(GRPOConfig), key=lambda f: list(CONFIG_GROUPS).index(
            f.metadata["group"])):
        if f.name == "output_dir":
            continue  # the scripts add it with a timestamped default
        where = groups[f.metadata["group"]]
        flag, default = "--" + f.name.replace("_", "-"), getattr(defaults, f.name)
        if f.name == "report_to":  # several names
            add_report_argument(where, default)
            continue
        if isinstance(default, bool) or f.type == "bool | None":  # None: the field decides
            where.add_argument(flag, default=default, action=argparse.BooleanOptionalAction,
                               help=helps[f.name])
            continue
        kind = OPTIONAL_TYPES.get(f.name, type(default))
        value_type = kind
        if kind in (int, float) or f.metadata["rule"] is not None:
            value_type = arg_type(kind, f.metadata["rule"], f.name in OPTIONAL_TYPES)
        where.add_argument(flag, type=value_type, default=default, choices=CHOICES.get(f.name),
                           help=helps[f.name])
    return groups


def add_report_argument(parser, default=(), help=CONFIG_HELP["report_to"]):
    """--report-to: the live logging backends of tracking.py, comma-separated (default none)."""
    # a string default: argparse converts it with `type` (to a tuple) and --help shows it as given
    parser.add_argument("--report-to", type=report_arg, default=",".join(default) or "none",
                        metavar="{" + ",".join(REPORT_CHOICES) + "}", help=help)


def report_arg(text):
    """argparse type: backend names, comma-separated ('none': none) -> a tuple of names."""
    try:
        return report_targets(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def check_report_backends(parser, names):
    """Refuse (parser.error, one line) a backend whose package is not installed, before the
    model loads or a file is written."""
    for name in report_targets(names):
        if problem := missing_backend(name):
            parser.error(problem)


def add_data_arguments(parser, eval_split: str = "test"):
    """--eval-split (default `eval_split`), --train-examples and --train-level-weights (saved in
    data.json)."""
    parser.add_argument("--eval-split", default=eval_split, choices=("test", "val"),
                        help="held-out split for arith (val for tuning, test for reporting)")
    parser.add_argument("--train-examples", type=optional_positive_int,
                        default=None,
                        help="use the first N training problems (None: the whole split)")
    parser.add_argument("--train-level-weights", type=parse_level_weights,
                        default=DEFAULT_TRAIN_LEVEL_WEIGHTS,
                        help="arith: mix of difficulty levels 1-5 in the training problems, five "
                             "comma-separated weights such as 1,1,2,2,2 ('none': uniform, like "
                             "the held-out splits)")


def build_parser(description, defaults: GRPOConfig, run_prefix):
    """The chapter scripts' parser: every GRPOConfig field, group by group (core first), and
    the script's own flags (`SCRIPT_GROUPS`: model and data, resume, device) after core."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    groups = add_argument_groups(p, {"core": CONFIG_GROUPS["core"]})
    own = add_argument_groups(p, SCRIPT_GROUPS)
    add_config_arguments(p, defaults, groups=groups)
    groups["core"].add_argument(
        "--output-dir", default=None,
        help=f"run directory (None: runs/{run_prefix}-<timestamp>); must not hold a run "
             "already, unless --overwrite")
    g = own["model and data"]
    add_model_argument(g)
    g.add_argument("--dataset", default="arith", choices=DATASET_NAMES,
                   help="arith: train on the train split, evaluate on --eval-split; math: MATH "
                        "train / MATH-500; gsm8k: train / test")
    add_data_arguments(g)
    g = own["resume"]
    g.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --output-dir (its metrics, samples and "
                        "checkpoints are deleted once the model and data have loaded)")
    g.add_argument("--resume", default=None,
                   help="run directory (its latest intact checkpoint) or checkpoint directory to "
                        "continue exactly, in that run directory wherever it now is; takes the "
                        "run's settings and data flags (flags given explicitly override them, "
                        "e.g. --steps)")
    g = own["device"]
    add_runtime_arguments(g)
    add_timeout_argument(g)
    add_dtype_argument(g, "model dtype for training (float32 keeps small AdamW updates exact)")
    return p


def flags_table(parser) -> str:
    """Every flag of `parser` as a markdown table, in --help's order: flag, group (its --help
    section), default (as --help shows it) and help (choices appended), one row each; the
    table of docs/flags.md."""
    def cell(text):
        return (str(text).replace("|", "\\|").replace("<", "\\<").replace("*", "\\*")
                .replace("\n", " "))

    rows = ["| flag | group | default | help |", "|---|---|---|---|"]
    for group in parser._action_groups:  # argparse keeps no public list of them
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
            about = action.help + (f" (choices: {', '.join(map(str, action.choices))})"
                                   if action.choices else "")
            rows.append(f"| {flags} | {group.title} | `{action.default}` | {cell(about)} |")
    return "\n".join(rows) + "\n"


def parse_level_weights(text):
    """argparse type: 'none' or five non-negative comma-separated weights, not all zero."""
    if text.lower() == "none":
        return None
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected five comma-separated numbers, got {text!r}") from None
    if len(weights) != 5 or any(not math.isfinite(w) or w < 0 for w in weights) \
            or not sum(weights):
        raise argparse.ArgumentTypeError(f"expected five non-negative weights (levels 1-5), "
                                         f"not all zero, got {text!r}")
    return weights


def load_grpo_data(dataset, train_examples=None, eval_split="test", eval_examples=None,
                   train_level_weights=None):
    """(train, held-out) example lists for a dataset name."""
    if train_level_weights is not None and dataset != "arith":
        raise ValueError("--train-level-weights applies to the arith dataset only")
    if dataset == "arith":
        train = load_dataset_by_name("arith", "train", n=train_examples,
                                     level_weights=train_level_weights)
        held_out = load_dataset_by_name("arith", eval_split, n=eval_examples)
    elif dataset in ("math", "math500"):
        train = load_dataset_by_name("math", n=train_examples)
        held_out = load_dataset_by_name("math500", n=eval_examples)
    else:
        train = load_dataset_by_name(dataset, "train", n=train_examples)
        held_out = load_dataset_by_name(dataset, "test", n=eval_examples)
    return train, held_out


# saved in data.json, reused on resume (the weights' dtype too: a resumed run keeps it)
DATA_FLAGS = ("dataset", "eval_split", "train_examples", "train_level_weights", "dtype")


def resolve_run(parser, args, argv, run_prefix):
    """(GRPOConfig, data flags, model source, checkpoint or None) for the parsed flags; refuses
    (parser.error, exit 2) anything that would fail later, before a file is written."""
    explicit = explicit_flags(argv)
    values = {f.name: getattr(args, f.name) for f in fields(GRPOConfig) if f.name != "output_dir"}
    data = {k: getattr(args, k) for k in DATA_FLAGS}
    try:
        if args.device:
            check_device(args.device)
        if args.resume:  # the run's own settings, except flags given explicitly now
            ckpt = find_checkpoint_or_restart(args.resume, log=_print_on_rank_0)
            run_dir = run_dir_of(ckpt) if ckpt else Path(args.resume).resolve()
            if args.output_dir and Path(args.output_dir).resolve() != run_dir:
                parser.error(f"--resume continues in the run's own directory {run_dir}; "
                             "leave out --output-dir")
            saved = read_trainer_state(ckpt)["config"] if ckpt else \
                read_json(run_dir / "config.json")  # no checkpoint: start over in place
            values = {**saved, **{k: v for k, v in values.items() if k in explicit},
                      "output_dir": str(run_dir)}
            if (run_dir / "data.json").is_file():
                data = {**json.loads((run_dir / "data.json").read_text()),
                        **{k: v for k, v in data.items() if k in explicit}}
            source = ckpt or (args.model if "model" in explicit else data.get("model", args.model))
        else:
            ckpt, source = None, args.model
            data["model"] = args.model  # in data.json: a run restarted from scratch reloads it
            values["output_dir"] = args.output_dir or time.strftime(
                f"runs/{run_prefix}-%Y%m%d-%H%M%S")
            if not args.overwrite:
                check_new_run_dir(values["output_dir"])
        if data["dataset"] != "arith" and "train_level_weights" not in explicit:
            data["train_level_weights"] = None  # the level mix is the arithmetic world's default
        config = GRPOConfig.from_dict(values)
        check_fsdp_run(config.fsdp, ckpt)
        check_report_backends(parser, config.report_to)
        if env_world_size() > config.prompts_per_step:
            raise ValueError(f"{env_world_size()} processes need --prompts-per-step >= "
                             f"{env_world_size()} (whole groups per process), got "
                             f"{config.prompts_per_step}")
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        parser.error(str(err))
    return config, data, source, ckpt


@dataclass
class TrainRun:
    """A checked training command: what `run_training` needs, as plain values."""

    config: GRPOConfig
    data: dict  # DATA_FLAGS (saved in data.json)
    model_source: str  # model name / directory, or the checkpoint resumed
    checkpoint: str | Path | None = None  # resume from this checkpoint
    device: str | None = None
    threads: int | None = 1  # torch CPU threads (0 or None: torch's default)
    dtype: str = "float32"
    overwrite: bool = False
    dist_timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES  # collectives' patience (launch.py)


def parse_train_args(argv, description, defaults: GRPOConfig, run_prefix) -> TrainRun:
    """Parse and check the chapter 6-7 training flags; a bad value exits 2 before anything is
    written."""
    parser = build_parser(description, defaults, run_prefix)
    args = parser.parse_args(argv)
    config, data, source, ckpt = resolve_run(parser, args, argv, run_prefix)
    restart = bool(args.resume) and ckpt is None  # no checkpoint yet: the run starts over
    return TrainRun(config, data, source, ckpt, args.device, args.threads,
                    data.get("dtype", args.dtype),  # a data.json from before it was saved
                    args.overwrite or restart, args.dist_timeout_minutes)


def run_training(run: TrainRun):
    """Load model and data and run `train_grpo` (data-parallel under torchrun); returns the
    summary."""
    return run_in_process_group(_train, run, Path(sys.argv[0]).name)


def run_cli(argv, description, defaults: GRPOConfig, run_prefix):
    """`parse_train_args` then `run_training`: the whole command line in one call."""
    return run_training(parse_train_args(argv, description, defaults, run_prefix))


def _train(run: TrainRun, device):
    """`run_training` once the process group (if any) is joined."""
    config, data = run.config, run.data
    model, tokenizer = load_for_run(run.model_source, device, getattr(torch, run.dtype),
                                    sharded=config.fsdp)  # FSDP: a sharded start
    train, held_out = load_grpo_data(data["dataset"], data["train_examples"], data["eval_split"],
                                     config.eval_examples, data.get("train_level_weights"))
    if is_main():
        where = f"{device}" if world_size() == 1 else f"{device.type} x {world_size()} processes"
        print(f"model {run.model_source} on {where}; {len(train)} training problems, "
              f"{len(held_out)} held-out ({data['dataset']}); run dir {config.output_dir}")
    # written only now that model and data loaded (a failed start leaves the directory as it was)
    run_on_main(atomic_write_json, Path(config.output_dir) / "data.json", data)
    try:
        summary = train_grpo(model, tokenizer, train, held_out, device, config,
                             resume_from=run.checkpoint, overwrite=run.overwrite)
    except KeyboardInterrupt as stop:  # the checkpoint is saved and the way on printed
        raise SystemExit(exit_status(stop)) from None
    except CheckpointWriteError as err:  # a full disk: one line, no traceback
        if is_main():
            print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    if is_main():
        print(json.dumps(summary, indent=2))
    return summary


def _print_on_rank_0(message):
    """Print once under torchrun (before the process group exists; RANK says who is who)."""
    if os.environ.get("RANK", "0") == "0":
        print(message)


def explicit_flags(argv):
    """Config field names whose flags appear on the command line (to override a resumed run)."""
    given = set()
    for arg in (argv if argv is not None else sys.argv[1:]):
        if arg.startswith("--"):
            name = arg[2:].split("=")[0].replace("-", "_")
            given.add(name[3:] if name.startswith("no_") else name)
    return given
