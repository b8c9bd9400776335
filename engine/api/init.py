"""``smp.init(config=None)``: configuration, process groups and DeepSpeed, from any launcher.

SMP semantics (docs/smp-semantics.md#configuration-sources): the script's dict is overridden key by key by the JSON
in ``SM_HP_MP_PARAMETERS``; the result is validated (here by the translator, so errors read the
same as ``smp2ds validate``); a second call only warns. The world layout comes from whatever
launched the process (see :mod:`launch_env`).

A configuration error is usually the same on every rank; it is printed once (by the lowest rank
that has it) instead of as one traceback per rank, and every rank raises ``SMPConfigError``.
Errors are exchanged over the world group, so a rank with a private problem (say a different
environment) cannot leave the others waiting at a later collective.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

from smp2ds.engine.api import torch_compile
from smp2ds.engine.api.backend_factory import prepare_groups
from smp2ds.engine.core import comm, launch_env
from smp2ds.engine.core.process_groups import create_groups
from smp2ds.engine.core.runtime import Runtime
from smp2ds.engine.core.state import ConfigView, state
from smp2ds.engine.core.version_check import installed_deepspeed, require_deepspeed
from smp2ds.engine.diagnostics import failure_report as faults
from smp2ds.engine.diagnostics import step_log
from smp2ds.engine.diagnostics.watchdog import Watchdog, timeout_from_env
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.parallel import context as parallel_context
from smp2ds.translator import normalize
from smp2ds.translator.issues import Issue, SMPConfigError
from smp2ds.translator.plan_types import Layout, Plan, SMPConfig
from smp2ds.translator.planner import plan as make_plan
from smp2ds.translator.topology import Topology

log = logging.getLogger("smp2ds")

ENV_KEY = "SM_HP_MP_PARAMETERS"


def merged_config(config: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The script's dict overridden key by key by ``SM_HP_MP_PARAMETERS`` (env wins)."""
    env = os.environ if env is None else env
    merged = dict(config or {})
    raw = env.get(ENV_KEY, "").strip()
    if raw:
        try:
            from_env = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SMPConfigError(  # noqa: B904 - the JSON error is summarised in the issue
                [
                    Issue(
                        "",
                        f"environment variable {ENV_KEY} is not valid JSON "
                        f"(line {exc.lineno}, column {exc.colno}: {exc.msg})",
                        given=raw,
                        hint=f"set it to one JSON object, e.g. {ENV_KEY}='{{\"ddp\": true}}', or let "
                        "`smp2ds launch --config FILE` set it from a file",
                    )
                ]
            )
        if not isinstance(from_env, dict):
            raise SMPConfigError(
                [
                    Issue(
                        "",
                        f"environment variable {ENV_KEY} must hold a JSON object",
                        given=from_env,
                        allowed="a JSON object of SMP parameters",
                    )
                ]
            )
        merged.update(from_env)
    return merged


def resolve_backend(requested: Any) -> str:
    """``ddp_dist_backend``: ``auto`` -> nccl when CUDA is usable, else gloo."""
    import torch

    cuda = torch.cuda.is_available()
    choice = str(requested or "auto").lower()
    if choice == "auto":
        return "nccl" if cuda else "gloo"
    if choice == "nccl" and not cuda:
        warnings.warn("ddp_dist_backend is 'nccl' but CUDA is not available; using gloo on CPU", stacklevel=3)
        return "gloo"
    return choice


def _translate(merged: dict[str, Any], launch: launch_env.LaunchEnv) -> tuple[Any, Any]:

    layout = Layout(world_size=launch.world_size, gpus_per_node=launch.local_size)
    cfg = normalize(merged, layout)
    result = make_plan(cfg, layout)
    result.raise_if_unsupported()
    return cfg, result


def init(config: Mapping[str, Any] | None = None) -> None:
    """Initialise SMP on DeepSpeed; see the module docstring. Idempotent (a second call warns)."""
    if state.initialized:
        warnings.warn("smp.init() was already called in this process; this call is ignored", stacklevel=2)
        return
    error: SMPConfigError | None = None
    cfg = plan = None
    merged: dict[str, Any] = dict(config or {})
    try:
        merged = merged_config(config)
    except SMPConfigError as exc:
        error = exc
    ddp_port = merged.get("ddp_port") if isinstance(merged.get("ddp_port"), int) else None
    launch = launch_env.detect(ddp_port=ddp_port)
    _check_deepspeed_version(launch)
    if error is None:
        try:
            cfg, plan = _translate(merged, launch)
        except SMPConfigError as exc:
            error = _note_missing_parameters(exc, config)
    backend = resolve_backend(cfg.ddp_dist_backend if cfg is not None else merged.get("ddp_dist_backend"))
    if backend not in ("gloo", "nccl", "mpi"):
        backend = "gloo"  # the error exchange below still needs a group; the config error says why
    if comm.is_initialized():
        # The script (or a framework) created the world group already: adopt it.
        if comm.get_world_size() != launch.world_size or comm.get_rank() != launch.rank:
            raise RuntimeError(
                f"torch.distributed is initialised as rank {comm.get_rank()} of "
                f"{comm.get_world_size()}, but the launcher says rank {launch.rank} of "
                f"{launch.world_size}"
            )
    else:
        pg_timeout = launch_env.pg_timeout_s()  # validated before anything waits on it
        store = comm.create_store(launch.rendezvous, launch.rank, launch.world_size, pg_timeout)
        comm.init(backend, store, launch.rank, launch.world_size, pg_timeout)
    _raise_config_error_once(error, launch)
    _finish(cfg, plan, launch, backend)


def _check_deepspeed_version(launch: launch_env.LaunchEnv) -> None:
    """An environment mistake, the same on every rank: rank 0 prints one line instead of a traceback per rank."""
    try:
        require_deepspeed(installed_deepspeed())
    except SMPUnsupportedError as exc:
        faults.mark_reported_once(exc, report_rank=0)
        faults.install(launch.rank)
        raise


def _note_missing_parameters(error: SMPConfigError, config: Mapping[str, Any] | None) -> SMPConfigError:
    """Name the likelier cause first when the script got no SMP parameters at all.

    Without ``SM_HP_MP_PARAMETERS`` and a dict, every key is its default, and the user then sees a
    complaint about a key they never wrote (say ``ddp``) instead of the missing variable.
    """
    if config or os.environ.get(ENV_KEY, "").strip():
        return error
    missing = Issue(
        "",
        f"environment variable {ENV_KEY} is not set and smp.init() got no dict, so every SMP parameter has its "
        "default",
        hint=f"start the script with `smp2ds launch --config FILE`, export {ENV_KEY}='{{...}}', or call "
        "smp.init({...})",
    )
    return SMPConfigError([missing, *error.issues])


def _raise_config_error_once(error: SMPConfigError | None, launch: launch_env.LaunchEnv) -> None:
    mine = list(error.issues) if error is not None else None
    everyone = comm.all_gather_object(mine) if launch.world_size > 1 else [mine]
    failing = [r for r, issues in enumerate(everyone) if issues is not None]
    if not failing:
        return
    first = failing[0]
    exc = SMPConfigError(everyone[first])
    note = f"found on rank(s) {failing} of {launch.world_size}" if len(failing) < launch.world_size else None
    faults.mark_reported_once(exc, report_rank=first, note=note)
    faults.install(launch.rank)
    comm.destroy()
    raise exc


def _finish(cfg: SMPConfig, plan: Plan, launch: launch_env.LaunchEnv, backend: str) -> None:
    import torch

    comm.init_deepspeed(backend)
    topology = _topology(plan, launch)
    groups = create_groups(topology, launch.rank)
    # what smp.nn's building blocks are built in: the tensor-parallel group with its stream, the pipeline degree
    context = parallel_context.from_groups(groups, plan.engine_settings.tensor_parallel)
    parallel_context.install(context)
    runtime = Runtime(config=cfg, plan=plan, launch=launch, groups=groups, context=context,
                      mics_groups=prepare_groups(plan, topology, launch), backend_name=backend,
                      # SMP2DS_COMPILE: read and refused here, not at a step
                      compile_model=torch_compile.check_setting(plan.engine_settings.pipeline.enabled))
    os.environ.update(
        {"RANK": str(launch.rank), "WORLD_SIZE": str(launch.world_size), "LOCAL_RANK": str(launch.local_rank)}
    )
    # DeepSpeed's launcher sets LOCAL_SIZE; under torchrun or mpirun it is missing, and DeepSpeed's
    # CPU accelerator then counts devices by running `numactl --hardware` on every call (ZeRO-3
    # asks once per reduce-scatter bucket): a fork and exec each time.
    os.environ.setdefault("LOCAL_SIZE", str(launch.local_size))
    if torch.cuda.is_available() and _accelerator_is_cuda():
        # SMP always selected cuda:local_rank(), whatever the collective backend: scripts that call
        # .to(torch.device("cuda")) before the engine exists then land on the model's device.
        torch.cuda.set_device(launch.local_rank)
    timeout = timeout_from_env()
    if timeout > 0 and launch.world_size > 1:
        rdv = launch.rendezvous
        host = (
            None
            if rdv.kind == "file"
            else ("torchrun agent" if rdv.agent_store else f"rank 0 at {rdv.host}:{rdv.port}")
        )
        state.watchdog = Watchdog(
            lambda: comm.create_store(rdv, launch.rank, launch.world_size, launch_env.pg_timeout_s(), side=True),
            launch.rank,
            launch.world_size,
            timeout,
            store_host=host,
        ).start()
    faults.install(launch.rank)
    atexit.register(shutdown)
    state.runtime = runtime  # smp.state.initialized from here on
    step_log.start_logging(plan, launch, backend)  # SMP2DS_LOG: rank-tagged lines, layout on rank 0
    if launch.rank == 0:
        ConfigView(cfg, plan).display_config()


def _topology(plan: Plan, launch: launch_env.LaunchEnv) -> Topology:
    """The rank layout the Plan chose (degrees and placement), for this launch's world size."""
    topo = plan.topology_settings
    return Topology.for_world(launch.world_size, pp=topo.pipeline_parallel_degree, tp=topo.tensor_parallel_degree,
                              placement=topo.placement)


def shutdown() -> None:
    """Stop the watchdog and destroy the process groups (SMP calls this at exit)."""
    wd, state.watchdog = state.watchdog, None
    runtime = state.runtime

    def destroy() -> None:
        if runtime is not None:
            # Collect unreachable objects first: a collective's work handle still held by a dead
            # reference cycle would otherwise be freed during interpreter teardown, after its
            # process group's threads, which can abort the process at exit.
            gc.collect()
            try:
                comm.destroy()
            except Exception:  # noqa: BLE001 - at exit; peers may be gone already
                pass

    if wd is not None and runtime is not None:
        rdp = runtime.launch.rendezvous
        # The store host (rank 0 with our own TCP store) must outlive the others' last store use.
        hosts_store = rdp.kind == "tcp" and not rdp.agent_store and runtime.launch.rank == 0
        wd.stop(wait_for_peers=hosts_store, before_done=destroy)
    else:
        destroy()
    parallel_context.forget()
    state.runtime = None


def is_initialized() -> bool:
    """True after ``smp.init()`` (SMP API)."""
    return state.initialized


def _accelerator_is_cuda() -> bool:
    """DeepSpeed places the model on CUDA (not forced to the CPU with ``DS_ACCELERATOR=cpu``)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cuda"
