"""``smp.state``: the process-global SMP state object.

Clients read ``smp.state.cfg.<key>`` (Hugging Face reads ``fp16``, ``prescaled_batch``,
``shard_optimizer_state``), ``smp.state.model`` / ``.optimizer``, the ``*_process_group``
attributes and the Megatron/DeepSpeed "mpu" methods; transformers' ``save_pretrained`` reads
``smp.state.module_manager.translate_functions``.
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from smp2ds.engine.core.launch_env import LaunchEnv
from smp2ds.engine.core.runtime import Runtime
from smp2ds.engine.exceptions import DDPNotEnabledError, NotInitializedError
from smp2ds.translator.plan_types import Plan, SMPConfig
from smp2ds.translator.topology import Topology

if TYPE_CHECKING:  # process_groups imports comm, which imports state: for the annotation only
    from smp2ds.engine.core.process_groups import ProcessGroups
    from smp2ds.engine.diagnostics.watchdog import Watchdog
    from smp2ds.engine.mics.shard_groups import MicsGroups

log = logging.getLogger("smp2ds")


class ConfigView:
    """Attribute access to every canonical SMP key of the validated config (``cfg.microbatches``).

    One key reads the run, not the dict: ``shard_optimizer_state`` is True whenever the optimizer state is
    sharded over the reduced-data-parallel ranks, which sharded data parallelism does too. Scripts (Hugging Face's
    ``Trainer`` among them) read it to decide whether every rdp rank saves its own optimizer part (``v3``) or only
    rdp rank 0 saves one for all; under sharded data parallelism rank 0's part is not everyone's. The config as
    given stays in ``get_config_dict()`` and ``smp_config``.
    """

    def __init__(self, config: SMPConfig, plan: Plan):
        self._config = config
        self._plan = plan

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "shard_optimizer_state":
            return bool(self._config.shard_optimizer_state) or self.zero2d_enabled()
        if name == "_fp16_param_init":
            return bool(self._config.params.get("fp16") or self._config.params.get("fp16_params"))
        return getattr(self._config, name)

    @property
    def smp_config(self) -> SMPConfig:
        """The translator's frozen ``SMPConfig``."""
        return self._config

    @property
    def plan(self) -> Plan:
        """The translator's ``Plan`` this run follows."""
        return self._plan

    def zero2d_enabled(self) -> bool:
        """SMP's name for "sharded data parallelism is on"."""
        return int(self._config.params.get("sharded_data_parallel_degree", 1)) > 1

    def get_config_dict(self) -> dict[str, Any]:
        return self._config.to_dict()

    def display_config(self) -> None:
        log.info("SMP configuration: %s", json.dumps(self._config.to_dict(), sort_keys=True, default=str))

    def __repr__(self) -> str:
        return f"ConfigView({self._config.to_dict()!r})"


@dataclass
class ModuleManager:
    """Model-specific registries shared with the pipeline / tensor-parallel helpers."""

    translate_functions: list[tuple[Any, Any]] = field(default_factory=list)
    """(smp_to_hf, hf_to_smp) callables; read by transformers' ``save_pretrained``."""
    activation_checkpointing: weakref.WeakKeyDictionary[Any, dict] = field(default_factory=weakref.WeakKeyDictionary)
    """Module -> options from ``smp.set_activation_checkpointing``."""
    gptneox_num_attention_heads: int | None = None
    """The head count of the GPT-NeoX SMP's transformer replaced: what SMP's GPT-NeoX translators, whose
    signatures take none, split and fuse q, k, v with."""


class State:
    """``smp.state``: the runtime ``smp.init`` built (:class:`~smp2ds.engine.core.runtime.Runtime`), and the
    current model and optimizer with their step counters (one per process).

    The runtime's facts are read through it, never stored twice: ``plan``, ``groups``, ``launch``,
    ``mics_groups``, ``config``, ``backend_name`` and ``compile_model`` are its fields (None before ``smp.init``),
    ``cfg`` SMP's view of its config, ``rng_manager`` its tensor-parallel context's random stream.
    """

    def __init__(self) -> None:
        self.runtime: Runtime | None = None
        self.watchdog: Watchdog | None = None
        self.reset()

    def reset(self) -> None:
        """Forget model-specific state (SMP's ``smp.reset()``), keeping the runtime."""
        self.model: Any = None
        self.optimizer: Any = None
        self.microbatch = 0
        self.in_step = False
        self.step_calls = 0
        self.module_manager = ModuleManager()
        self.pending_model_load: Any = None
        self.pending_optimizer_load: Any = None

    # ---- the runtime's facts -----------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        """Whether ``smp.init`` has run (and ``smp.shutdown`` has not)."""
        return self.runtime is not None

    @property
    def plan(self) -> Plan | None:
        return self.runtime.plan if self.runtime is not None else None

    @property
    def groups(self) -> ProcessGroups | None:
        return self.runtime.groups if self.runtime is not None else None

    @property
    def launch(self) -> LaunchEnv | None:
        return self.runtime.launch if self.runtime is not None else None

    @property
    def mics_groups(self) -> MicsGroups | None:
        return self.runtime.mics_groups if self.runtime is not None else None

    @property
    def config(self) -> SMPConfig | None:
        return self.runtime.config if self.runtime is not None else None

    @property
    def backend_name(self) -> str | None:
        return self.runtime.backend_name if self.runtime is not None else None

    @property
    def compile_model(self) -> bool:
        """``SMP2DS_COMPILE=1``, as ``smp.init`` read it: DeepSpeed's ``engine.compile()`` before the first step."""
        return self.runtime is not None and self.runtime.compile_model

    @property
    def cfg(self) -> ConfigView | None:
        """SMP's ``smp.state.cfg``: attribute access to the config's keys."""
        return ConfigView(self.runtime.config, self.runtime.plan) if self.runtime is not None else None

    @property
    def rng_manager(self) -> Any:
        """SMP's ``smp.state.rng_manager``: the tensor-parallel group's random stream (``smp.init``, ``smp.reset``)."""
        return self.runtime.context.tp.rng if self.runtime is not None else None

    # ---- convenience ---------------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        self.require()
        return self.groups.topology

    def require(self) -> None:
        if not self.initialized:
            raise NotInitializedError("smp.init() has not been called in this process; call it first")

    def _process_group(self, kind: str) -> Any:
        self.require()
        assert self.runtime is not None  # require() above
        if not self.runtime.plan.engine_settings.data_parallel.ddp_api and kind != "mp":
            raise DDPNotEnabledError(
                f"the {kind} process group exists only with the config key ddp: true (SMP semantics)"
            )
        return self.groups.group(kind)

    @property
    def world_process_group(self) -> Any:
        return self._process_group("world")

    @property
    def dp_process_group(self) -> Any:
        return self._process_group("dp")

    @property
    def mp_process_group(self) -> Any:
        return self._process_group("mp")

    @property
    def pp_process_group(self) -> Any:
        return self._process_group("pp")

    @property
    def tp_process_group(self) -> Any:
        return self._process_group("tp")

    @property
    def rdp_process_group(self) -> Any:
        return self._process_group("rdp")

    # ---- Megatron/DeepSpeed "mpu" interface (SMP: data-parallel means reduced DP) -----------
    def get_model_parallel_rank(self) -> int:
        return self.groups.coords.mp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.groups.topology.mp

    def get_model_parallel_group(self) -> Any:
        return self.groups.group("mp")

    def get_data_parallel_rank(self) -> int:
        return self.groups.coords.rdp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.groups.topology.rdp

    def get_data_parallel_group(self) -> Any:
        return self.groups.group("rdp")


state = State()
"""The process-global instance (``smp.state``)."""
