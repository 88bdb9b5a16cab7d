"""`dspark serve`: serve a generated package over HTTP with the OpenAI completions API."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark.cli.common import (
    CliError,
    add_online_cost_args,
    load_package_or_fail,
    online_cost_of,
    warn_if_dummy_weights,
)

if TYPE_CHECKING:
    from dspark.runtime.package import GeneratedPackage

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `serve` to a `dspark` subparsers object; the parsed args carry their handler."""
    p = subparsers.add_parser(
        "serve", help="serve a generated package over HTTP (OpenAI /v1/completions)",
        description="Serve a compiled deployment over HTTP: POST /v1/completions (OpenAI shapes, "
                    "streaming with server-sent events), GET /v1/models, GET /health and GET /metrics "
                    "(Prometheus). Requests are batched continuously and decoded speculatively.")
    p.add_argument("package", type=Path, help="generated package directory, e.g. generated/tiny_cpu_static")
    add_serve_args(p)
    p.set_defaults(handler=serve_or_spawn)
    return p


def serve_or_spawn(args: argparse.Namespace) -> int:
    """`dspark serve`: serve the package, or, when it is compiled for more than one process and this is not
    already a rank of a launch, start its ranks with torchrun (rank 0 serves, the others follow)."""
    pkg = load_package_or_fail(args.package)
    check_fixed_verify_len(pkg, args.fixed_verify_len)  # before any rank starts
    world = pkg.deployment.parallel.world_size
    if world == 1 or "WORLD_SIZE" in os.environ:
        return serve_package(args.package, args)
    with socket.socket() as probe:  # a free port for the ranks' rendezvous, on this machine
        probe.bind(("127.0.0.1", 0))
        master_port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-addr", "127.0.0.1", "--master-port", str(master_port),
               "-m", "dspark.cli.main", "serve", str(args.package), "--host", args.host,
               "--port", str(args.port), "--seed", str(args.seed), "--log-level", args.log_level]
    if args.model_name is not None:
        command += ["--model-name", args.model_name]
    if args.target_only:
        command.append("--target-only")
    if args.fixed_verify_len is not None:
        command += ["--fixed-verify-len", str(args.fixed_verify_len)]
    print(f"dspark serve: {pkg.deployment.name} is compiled for {world} processes; starting them with "
          f"torchrun (rank 0 serves on {args.host}:{args.port})", file=sys.stderr, flush=True)
    return subprocess.run(command, check=False).returncode


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The options of `serve`, shared by `dspark serve` and `python -m generated.<name> serve`."""
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1; 0.0.0.0 listens on every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: 8000)")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send and GET /v1/models lists (default: the deployment name)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of sampled requests that do not send their own seed (default: 0)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="server log verbosity (default: info)")
    # Baselines for `dspark bench --sweep`: the same server, decoding without the adaptive planner.
    policy = p.add_mutually_exclusive_group()
    policy.add_argument("--target-only", action="store_true",
                        help="decode every request with the target model alone, no speculation (the "
                             "lossless reference and the baseline speculation must beat)")
    policy.add_argument("--fixed-verify-len", type=int, default=None, metavar="K",
                        help="verify exactly K rows (the root plus K-1 drafts) of every request each "
                             "step instead of planning the rows: a fixed-length baseline; K in 1..gamma+1, "
                             "cap-accept and compact builds only")
    calibration = p.add_mutually_exclusive_group()
    calibration.add_argument("--online-calibration", dest="online_calibration", action="store_true",
                             default=None, help="refit the planner's STS temperatures from the served steps' "
                                                "verified drafts and swap them in between steps (default: "
                                                "as the spec's online_calibration says)")
    calibration.add_argument("--no-online-calibration", dest="online_calibration", action="store_false",
                             help="keep the compiled temperatures, whatever the spec says")
    add_online_cost_args(p)
    p.add_argument("--save-calibration", type=Path, default=None, metavar="PATH",
                   help="with online calibration on: on shutdown, write the live calibration to PATH as a "
                        "calibration file (name it in the spec's calibration.file to start from it)")
    p.add_argument("--save-cost-table", type=Path, default=None, metavar="PATH",
                   help="with the online cost refit on: on shutdown, write the live additive table to PATH "
                        "as a cost-table file (name it in the spec's cost_model.file to start from it)")


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or a `CliError` saying why it cannot be. Binding before the model
    loads makes a taken port fail at once rather than after the weights are read."""
    if not 0 <= port <= 65535:
        raise CliError(f"--port must be between 0 and 65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror:
        raise CliError(f"cannot listen on {host!r}: not an address or a known host name; pass an IP "
                       "address to --host, e.g. 127.0.0.1") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart at once
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        where = f"{host}:{port}"
        if err.errno == errno.EADDRINUSE:
            raise CliError(f"cannot listen on {where}: the port is already in use; stop the process "
                           "that holds it or pass another --port") from None
        if err.errno == errno.EACCES:
            raise CliError(f"cannot listen on {where}: permission denied (ports below 1024 need "
                           "privileges); pass a port above 1023") from None
        if err.errno == errno.EADDRNOTAVAIL:
            raise CliError(f"cannot listen on {where}: {host} is not an address of this machine") from None
        raise CliError(f"cannot listen on {where}: {err.strerror or err}") from None
    return sock


def check_fixed_verify_len(pkg: GeneratedPackage, k: int | None) -> None:
    """A `CliError` naming the flag when `--fixed-verify-len K` does not fit the build; checked before
    the weights load (the runtime refuses the same, but its message cannot name the flag)."""
    if k is None:
        return
    dep = pkg.deployment
    if not dep.verify_mode.plans:
        raise CliError(f"--fixed-verify-len needs a cap-accept or compact build; {dep.name} verifies in "
                       f"{dep.verify_mode} mode (all N rows every step): serve it without the flag")
    n = pkg.plan.num_draft_tokens
    if not 1 <= k <= n:
        raise CliError(f"--fixed-verify-len must be in 1..{n} (gamma + 1 for {dep.name}), got {k}")


def serve_package(package_dir: Path, args: argparse.Namespace) -> int:
    """Load the package and serve it until interrupted. Raises `CliError` for anything the user can fix."""
    from dspark.runtime.distributed.launch import LaunchError
    from dspark.runtime.engine.requests import RequestError
    from dspark.runtime.engine.runtime import Runtime, follows
    from dspark.runtime.planner.online_calibration import OnlineCalibrationSettings

    pkg = load_package_or_fail(package_dir)
    check_fixed_verify_len(pkg, args.fixed_verify_len)
    try:
        # rank 0 owns the HTTP server; another rank ran its steps (target-only comes in rank 0's commands)
        compiled = pkg.deployment.online_calibration  # the spec's setting, which the flags override
        online = {None: compiled, True: compiled or OnlineCalibrationSettings(), False: None}
        options = {"seed": args.seed, "fixed_verify_len": args.fixed_verify_len,
                   "online_calibration": online[args.online_calibration],
                   "online_cost": online_cost_of(pkg, args.online_cost)}
        if args.save_calibration is not None and options["online_calibration"] is None:
            raise CliError("--save-calibration needs online calibration (--online-calibration, or the "
                           "spec's online_calibration section)")
        if args.save_cost_table is not None and options["online_cost"] is None:
            raise CliError("--save-cost-table needs the online cost refit (--online-cost, or the spec's "
                           "online_cost section)")
        if follows(pkg, **options):
            return 0
    except LaunchError as err:
        raise CliError(str(err)) from None
    sock = listen_socket(args.host, args.port)
    try:
        warn_if_dummy_weights(pkg)
        try:
            runtime = Runtime(pkg, **options)
        # a CUDA build without a GPU, a missing checkpoint, a launch that does not fit the build
        except (RequestError, LaunchError, ValueError) as err:
            raise CliError(str(err)) from None
        # Set once: the engine thread never resets it (only `generate` does, and the server never calls it).
        runtime.target_only = args.target_only
        from dspark.runtime.serve.server import serve

        try:
            failed = serve(runtime, sock, args.host, args.port, args.model_name, args.log_level)
        finally:
            runtime.close()
            if args.save_calibration is not None:
                save_live_calibration(runtime, args.save_calibration)
            if args.save_cost_table is not None:
                save_live_cost_table(runtime, args.save_cost_table)
        if failed and runtime.ranks.world.size > 1:
            raise CliError("a rank of the launch failed and the server shut down; restart the launch")
    finally:
        sock.close()
    return 0


def save_live_calibration(runtime: Any, path: Path) -> None:
    """The live calibration of a server that ran with online calibration, written as a calibration file."""
    from dspark.fingerprint import sampling_policy
    from dspark.formats.sts_calibration import write_calibration

    online = runtime.speculative.online
    if online is None:
        raise CliError("--save-calibration needs online calibration (--online-calibration, or the spec's "
                       "online_calibration section)")
    sampling = runtime.sampling
    policy = sampling_policy(sampling.temperature, sampling.top_p, sampling.top_k)
    contents = online.calibration_contents(f"online: {runtime.deployment.name} served traffic", policy)
    print(f"wrote {write_calibration(path, contents)} ({online.refits} refits on {online.samples} "
          "request-steps)", file=sys.stderr)


def save_live_cost_table(runtime: Any, path: Path) -> None:
    """The live additive table of a server that ran with the online cost refit, written as a cost-table file
    with the deployment's fingerprint (as `dspark profile` writes one)."""
    from dspark.fingerprint import fingerprint_of_deployment
    from dspark.formats.cost_tables import write_cost_table

    refit = runtime.speculative.cost_refit
    if refit is None:
        raise CliError("--save-cost-table needs the online cost refit (--online-cost, or the spec's "
                       "online_cost section)")
    fingerprint = fingerprint_of_deployment(runtime.deployment, runtime.tiers).to_json()
    written = write_cost_table(path, refit.table.to_format(), fingerprint)
    print(f"wrote {written} ({refit.refits} refits on {refit.samples} decode steps)", file=sys.stderr)
