"""The ``elastic-trainer`` command: parse, build, run, always clean up.

    elastic-trainer run --nnodes 1:2 --nproc-per-node 2 -m elastic_trainer.examples.synthetic_cnn
    elastic-trainer status --rdzv-endpoint 127.0.0.1:2379 --run-id job1
    elastic-trainer top --url node-0:9400 --url node-1:9400
    elastic-trainer doctor --nproc-per-node 2
    elastic-trainer checkpoint list ./checkpoints --json

User mistakes are one line on stderr and exit code 2; a failed job exits 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from elastic_trainer import __version__
from elastic_trainer.launch.options import OPTIONS, UserError, resolve_run_options
from elastic_trainer.ops import top as top_view
from elastic_trainer.runtime.failures import OneLineArgumentParser
from elastic_trainer.runtime.process_exit import exit_process
from rendezvous.conf_keys import RendezvousConfigError, parse_conf_string

PROG = "elastic-trainer"

RUN_EXAMPLE = """example:
  elastic-trainer run --nnodes 1:2 --nproc-per-node 2 \\
      -m elastic_trainer.examples.synthetic_cnn --max-steps 200 --checkpoint-dir ./ckpt

  Without --rdzv-endpoint an embedded etcd is started on a free port and stopped on exit.
  With a shared etcd, give every node the same endpoint and a unique run id:
  elastic-trainer run --rdzv-endpoint etcd-0:2379,etcd-1:2379 --run-id job-42 train.py --lr 0.1

Every option can also be set as ELASTIC_TRAINER_<OPTION> (e.g. ELASTIC_TRAINER_RDZV_ENDPOINT)
or in the [run] table of a TOML file given with --config; precedence: command line >
environment > file > default."""

STATUS_EXAMPLE = """example:
  elastic-trainer status --rdzv-endpoint 127.0.0.1:2379 --run-id job-42 --checkpoint-dir ./ckpt
  elastic-trainer status --rdzv-endpoint etcd:2379 --run-id job-42 --json"""

DEBUG_EXAMPLE = """example:
  elastic-trainer debug stacks --rdzv-endpoint 127.0.0.1:2379 --run-id job-42
  elastic-trainer debug profile --steps 5 --out prof/ --rdzv-endpoint etcd:2379 --run-id job-42
  elastic-trainer debug dump --out dump/ --rdzv-endpoint etcd:2379 --run-id job-42

A rank that does not answer within --timeout is named; exit status 1 then (docs/diagnostics.md)."""

DOCTOR_EXAMPLE = """example:
  elastic-trainer doctor --nproc-per-node 2            # one node, embedded etcd
  elastic-trainer doctor --rdzv-endpoint etcd:2379 --run-id doctor-1 --nnodes 2 -- --json

Arguments after -- go to the doctor module (see python -m elastic_trainer.doctor --help)."""

CHECKPOINT_EXAMPLE = """example:
  elastic-trainer checkpoint list ./ckpt --json
  elastic-trainer checkpoint verify ./ckpt
  elastic-trainer checkpoint inspect ./ckpt/ckpt-000000000200.pt
  elastic-trainer checkpoint export ./ckpt model.pt   # sharded or not: one plain file"""


def _add_launch_options(parser: argparse.ArgumentParser) -> None:
    for spec in OPTIONS:
        default_text = "none" if spec.default is None else spec.default
        parser.add_argument(
            *spec.flags,
            dest=spec.name,
            default=None,
            metavar=spec.name.split("_")[-1].upper(),
            help=f"{spec.help} (default: {default_text}; env {spec.env})",
        )
    parser.add_argument(
        "--config", default=None, help="TOML file with a [run] table of these options"
    )
    # torchrun habits: the same job line should work with both commands.
    parser.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        dest="rdzv_backend",
        default=None,
        help="accepted for torchrun compatibility; must be etcd-v3",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="accepted for torchrun compatibility: one node on an embedded etcd (the default)",
    )


class _Parser(OneLineArgumentParser):
    """The parser of the command and of each subcommand: its examples keep their lines."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Fault-tolerant, elastic PyTorch DDP training.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (
        _add_run, _add_status, _add_top, _add_debug, _add_doctor, _add_demo, _add_checkpoint
    ):  # fmt: skip
        add(commands)
    return parser


def _add_run(commands: Any) -> None:
    """``run``: the launcher's options, the target and its arguments."""
    run = commands.add_parser("run", help="launch a training job elastically", epilog=RUN_EXAMPLE)
    _add_launch_options(run)
    run.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="treat the target as a module (python -m MODULE)",
    )
    run.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    run.add_argument(
        "target", nargs=argparse.REMAINDER, metavar="SCRIPT|ARGS", help="script and its arguments"
    )


def _add_status(commands: Any) -> None:
    """``status``: where the run's etcd is and what to show."""
    status = commands.add_parser(
        "status", help="show a run's rendezvous from etcd", epilog=STATUS_EXAMPLE
    )
    status.add_argument(
        "--rdzv-endpoint", required=True, help="etcd endpoint(s) host:port[,host:port]"
    )
    status.add_argument("--run-id", required=True, help="the run's rendezvous id")
    status.add_argument(
        "--rdzv-conf", default="", help="KEY=VALUE[,...] etcd settings (TLS, auth, timeouts)"
    )
    status.add_argument(
        "--checkpoint-dir", default=None, help="also show the newest checkpoint here"
    )
    status.add_argument("--json", action="store_true", help="print JSON")


def _add_top(commands: Any) -> None:
    """``top``: its options are :mod:`elastic_trainer.ops.top`'s."""
    top = commands.add_parser(
        "top", help="live view of a job from its nodes' metrics endpoints", epilog=top_view.EXAMPLES
    )
    top_view.add_arguments(top)


def _add_debug(commands: Any) -> None:
    """``debug``: its options are :mod:`elastic_trainer.ops.debug`'s (imported when it runs)."""
    debug = commands.add_parser(
        "debug", help="every rank's stacks, flight recorder or a profile, now", epilog=DEBUG_EXAMPLE
    )
    debug.add_argument(
        "what", choices=("stacks", "trace", "profile", "dump"),
        help="stacks: every thread's stack; trace: the flight recorder; profile: a torch.profiler "
        "trace of the next --steps steps; dump: stacks, trace and wait counters to --out",
    )  # fmt: skip
    debug.add_argument("--rdzv-endpoint", help="the job's etcd host:port[,...] (with --run-id)")
    debug.add_argument("--run-id", help="the job's rendezvous id")
    debug.add_argument(
        "--url", help="or a node's metrics endpoint (top's --url): the job and its etcd from there"
    )
    debug.add_argument(
        "--rdzv-conf", default="", help="KEY=VALUE[,...] etcd settings (TLS, auth, timeouts)"
    )
    debug.add_argument(
        "--timeout", type=float, default=None,
        help="seconds a rank has to answer (default 1.5; profile: 60, for its steps)",
    )  # fmt: skip
    debug.add_argument("--steps", type=int, default=5, help="profile: steps traced (1..1000)")
    debug.add_argument("--native", action="store_true", help="stacks: native frames too (py-spy)")
    debug.add_argument("--out", default=None, help="write one file per rank here")


def _add_doctor(commands: Any) -> None:
    """``doctor``: the launcher's options, then the doctor's own."""
    doctor = commands.add_parser(
        "doctor", help="check the distributed setup on every rank", epilog=DOCTOR_EXAMPLE
    )
    _add_launch_options(doctor)
    doctor.add_argument("doctor_args", nargs=argparse.REMAINDER, metavar="-- DOCTOR-ARGS")


def _add_demo(commands: Any) -> None:
    """``demo``: its options are its own parser's (:mod:`elastic_trainer.ops.demo`)."""
    demo = commands.add_parser(
        "demo",
        help="watch a two-node job heal from real faults (about 90 s)",
        description="Starts an etcd and two nodes on this machine, then: a node joins, a "
        "worker is SIGKILLed, a node leaves with SIGTERM; ends with each fault's recovery "
        "time and the steps lost.",
    )
    demo.add_argument(
        "demo_args",
        nargs=argparse.REMAINDER,
        metavar="OPTIONS",
        help="--max-steps N, --throttle-ms MS, --dir DIR, --metrics-port PORT, --sharded",
    )


def _add_checkpoint(commands: Any) -> None:
    """``checkpoint list|verify|inspect|export``."""
    checkpoint = commands.add_parser(
        "checkpoint", help="list, verify, inspect or export checkpoints", epilog=CHECKPOINT_EXAMPLE
    )
    actions = checkpoint.add_subparsers(dest="action", required=True, parser_class=_Parser)
    for name, text in (
        ("list", "checkpoints with path and step, newest last"),
        ("verify", "check every checkpoint against its manifest's sha256"),
        ("inspect", "what a checkpoint holds (no GPU needed)"),
    ):
        action = actions.add_parser(name, help=text, epilog=CHECKPOINT_EXAMPLE)
        action.add_argument("path", metavar="DIR" if name != "inspect" else "DIR|FILE")
        action.add_argument("--json", action="store_true", help="print JSON")
    export = actions.add_parser(
        "export",
        help="write a checkpoint (sharded or not) as one plain .pt file",
        epilog=CHECKPOINT_EXAMPLE,
    )
    export.add_argument(
        "path",
        metavar="DIR|CHECKPOINT",
        help="a checkpoint directory (its newest good one) or one checkpoint",
    )
    export.add_argument(
        "out",
        metavar="OUT.pt",
        help="torch.load(OUT.pt, weights_only=True)['model'] is a full state dict",
    )


def _launch_values(args: argparse.Namespace) -> dict[str, Any]:
    return {spec.name: getattr(args, spec.name) for spec in OPTIONS}


def _check_torchrun_habits(args: argparse.Namespace) -> None:
    if args.rdzv_backend is not None and args.rdzv_backend != "etcd-v3":
        raise UserError(
            f"--rdzv-backend {args.rdzv_backend}: elastic-trainer run always uses etcd-v3 (drop the "
            "option, or use plain torchrun for other backends)"
        )
    if args.standalone and (args.rdzv_endpoint or "").strip():
        raise UserError(
            "--standalone starts an embedded etcd: drop --rdzv-endpoint, or drop --standalone"
        )


def _warn_launcher_flags_after_target(words: Sequence[str]) -> None:
    """``elastic-trainer run train.py --nproc-per-node 2``: the flag goes to the script; say so."""
    flags = {flag for spec in OPTIONS for flag in spec.flags} | {"--max-restarts", "--module", "-m"}
    for word in words[1:]:
        name = word.split("=", 1)[0]
        if name in flags:
            print(
                f"{PROG}: warning: {name} comes after the script, so the script gets it; if it is meant for "
                f"{PROG} run, put it before the script",
                file=sys.stderr,
            )


def _cmd_run(args: argparse.Namespace) -> int:
    from elastic_trainer.launch import launcher, plan  # cost: startup-and-threads.md

    _check_torchrun_habits(args)
    words = list(args.target)
    if words and words[0] == "--":
        words = words[1:]
    _warn_launcher_flags_after_target(words)
    target = plan.split_target(words, as_module=args.module)
    options = resolve_run_options(_launch_values(args), config_path=args.config)
    if not args.dry_run:  # a dry run changes nothing in this process (a test's, say)
        launcher.install_sigterm_as_exception()
        launcher.default_env_for_workers()
    code = launcher.launch(options, target, dry_run=args.dry_run)
    if not args.dry_run:
        _exit_without_teardown(code)
    return code


def _exit_without_teardown(code: int) -> NoReturn:
    """End the launcher once everything it started is cleaned up, skipping the interpreter's
    teardown: with torch imported, its garbage collection alone takes about a second, which the
    launcher's exit after SIGTERM would add to its last child's (docs/design/launcher.md)."""
    exit_process(code)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from elastic_trainer.launch import launcher, plan  # cost: startup-and-threads.md

    extra = list(args.doctor_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    # One node and no restarts unless asked: a failed check must be reported, not retried.
    options = resolve_run_options(
        _launch_values(args), config_path=args.config, defaults={"nnodes": "1", "max_restarts": 0}
    )
    launcher.install_sigterm_as_exception()
    doctor = plan.Target(None, "elastic_trainer.doctor", tuple(extra))
    _exit_without_teardown(launcher.launch(options, doctor))


def _cmd_status(args: argparse.Namespace) -> int:
    from elastic_trainer.ops import status  # cost: startup-and-threads.md

    try:
        conf = parse_conf_string(args.rdzv_conf)
    except RendezvousConfigError as exc:
        raise UserError(str(exc)) from exc
    conf.setdefault("retry_timeout", "5")
    report = status.read_status(args.rdzv_endpoint, args.run_id, conf, args.checkpoint_dir)
    print(json.dumps(report, indent=2) if args.json else status.render_status(report))
    return 0


def _cmd_debug(args: argparse.Namespace) -> int:
    from elastic_trainer.ops import debug  # cost: startup-and-threads.md (torch, gRPC)

    try:
        args.conf = parse_conf_string(args.rdzv_conf)
    except RendezvousConfigError as exc:
        raise UserError(str(exc)) from exc
    debug.check_arguments(args)
    return debug.run(args)


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    from elastic_trainer.checkpoint import catalog as checkpoint_cli  # torch: only this command

    if args.action == "list":
        rows = checkpoint_cli.list_checkpoints(args.path)
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for row in rows:
                print(
                    f"step {row['step']:>10}  epoch {row['epoch']}  world {row['world_size']}  {row['bytes']} B  {row['path']}"
                )
        return 0
    if args.action == "verify":
        results = checkpoint_cli.verify_checkpoints(args.path)
        if args.json:
            print(json.dumps(results, indent=2))
        else:
            for r in results:
                print(
                    f"{'OK ' if r['ok'] else 'BAD'} step {r['step']:>10}  {r['error'] or r['path']}"
                )
        return 0 if all(r["ok"] for r in results) else 1
    if args.action == "export":
        done = checkpoint_cli.export_checkpoint(args.path, args.out)
        print(
            f"exported step {done['step']} from {done['source']} to {done['out']} ({done['bytes']} B)"
        )
        return 0
    report = checkpoint_cli.inspect_checkpoint(args.path)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{report['path']}: step {report['step']}, epoch {report['epoch']}, world size {report['world_size']}, "
            f"{report['model_parameters']} model parameters"
        )
        for key, entry in report["entries"].items():
            print(f"  {key:<16} {entry['tensors']:>6} tensors  {entry['bytes']:>14} B")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from elastic_trainer.ops import demo  # cost: startup-and-threads.md

    return demo.main(list(args.demo_args))


def _cmd_top(args: argparse.Namespace) -> int:
    return top_view.run_args(args, prog=f"{PROG} top")


COMMANDS = {
    "run": _cmd_run,
    "status": _cmd_status,
    "top": _cmd_top,
    "debug": _cmd_debug,
    "doctor": _cmd_doctor,
    "checkpoint": _cmd_checkpoint,
    "demo": _cmd_demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``elastic-trainer`` command; returns the exit code."""
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["demo"]:
            # The demo's options are its own parser's: argparse's REMAINDER does not take
            # arguments that start with an option (`demo --sharded` would be refused).
            return _cmd_demo(argparse.Namespace(demo_args=argv[1:]))
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except UserError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
