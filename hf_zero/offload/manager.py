"""``OffloadManager``: the offload backends of one engine and the few points where they plug in.

The engine builds one manager when the config offloads anything; the stages call it at fixed
points, so that offload stays out of the stage and engine code:

============================  ====================================================================
``prepare_fsdp`` (stage 2/3)  before ``fully_shard``: FSDP2's CPU offload policy when
                              ``offload_param`` is set
``after_fsdp``                after ``fully_shard``: capture this rank's fp32 master shard of each
                              offloaded parameter, cast the parameter to the compute dtype (the
                              accelerator keeps 16-bit shards only); the ``offload_param`` backend
``prepare_ddp`` (stage 1)     the DDP wrapper whose comm hook will copy gradients to the host
``build_optimizer``           the :class:`OffloadedOptimizer` (or a plain optimizer when only the
                              parameters are offloaded) and its gradient feed
``checkpoint_state`` /        the engine's ``state_dict``/``load_state_dict`` entries
``load_checkpoint_state``
``backends``                  what ``ZeroEngine.memory_report`` asks for bytes per tier
``close``                     threads, hooks and swap files
============================  ====================================================================
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hf_zero.config.schema import ZeroConfig
from hf_zero.distributed.collectives import collective_device
from hf_zero.offload.base import OffloadBackend, OffloadError, agree_on_error
from hf_zero.offload.grad_feeds import DdpGradFeed, FsdpGradFeed
from hf_zero.offload.cpu_optimizer import (
    HostOffloadConfig,
    OffloadedOptimizer,
    ParamPlan,
)

__all__ = ["OffloadManager", "check_offload_config", "make_offload_manager", "shard_group"]

logger = logging.getLogger("hf_zero")

_OPT = "zero_optimization.offload_optimizer"
_PARAM = "zero_optimization.offload_param"


def check_offload_config(config: ZeroConfig) -> None:
    """Offload combinations the config parser lets through but the engine cannot run.

    Raises:
        ValueError: ``offload_param.device`` is ``nvme`` without an offloaded optimizer (the fp32
            master weights would be the swapped parameters themselves, stepped on the device).
    """
    zero = config.zero_optimization
    if zero.offload_param.device == "nvme" and zero.offload_optimizer.device == "none":
        raise ValueError(
            f"{config.source}: {_PARAM}.device='nvme' needs {_OPT}.device 'cpu' or 'nvme' (the fp32 master "
            f"weights must live off the swapped parameters); set {_OPT}.device, or use {_PARAM}.device='cpu'"
        )


def make_offload_manager(config: ZeroConfig, env: Any, precision: Any) -> OffloadManager | None:
    """The manager for ``config``, or None when nothing is offloaded."""
    zero = config.zero_optimization
    if zero.offload_optimizer.device == "none" and zero.offload_param.device == "none":
        return None
    check_offload_config(config)
    return OffloadManager(config, env, precision)


def shard_group(mesh: Any, world: int) -> tuple[int, Any]:
    """``(ranks a parameter is sharded over, their process group)`` for FSDP2 on ``mesh``.

    A flat mesh (or none) shards over the whole world: the default group (None), as the fill from
    rank 0 uses it too. A 2-D ``(replicate, shard)`` mesh (``mics_shard_size``) shards over its
    ``shard`` dimension and replicates across the other.
    """
    if mesh is None or mesh.ndim == 1:
        return (world if mesh is None else mesh.size()), None
    if mesh.ndim != 2:
        raise OffloadError(f"offload supports a 1-D or a 2-D (replicate, shard) mesh, got a {mesh.ndim}-D one")
    return mesh.size(1), mesh.get_group(1)


def _partition(params: list[nn.Parameter], world: int) -> dict[int, int]:
    """Stage 1 ownership: largest parameters first, each to the least-loaded rank (whole
    parameters, as ZeroRedundancyOptimizer does, so checkpoints stay per parameter name)."""
    load = [0] * world
    owner: dict[int, int] = {}
    for index in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[id(params[index])] = rank
        load[rank] += params[index].numel()
    return owner


class OffloadManager:
    """Offload backends of one engine (see the module docstring for when each method runs)."""

    def __init__(self, config: ZeroConfig, env: Any, precision: Any):
        from hf_zero.distributed.collectives import broadcast_object

        zero = config.zero_optimization
        self.config = config
        self.env = env
        self.precision = precision
        self.stage = zero.stage
        self.opt_cfg = zero.offload_optimizer
        self.param_cfg = zero.offload_param
        self.sub_group_size = int(zero.sub_group_size)
        self.aio = config.aio
        self.run_id: str | None = None
        if "nvme" in (self.opt_cfg.device, self.param_cfg.device):
            from hf_zero.offload.nvme import new_run_id

            self.run_id = broadcast_object(new_run_id() if env.rank == 0 else None)
        self.optimizer: OffloadedOptimizer | None = None
        self.params: Any = None
        self._masters: dict[str, torch.Tensor] = {}
        self._host_names: set[str] = set()
        self._fill_masters: set[str] = set()  # fp32 masters the fill from rank 0 hands over (take)
        self._planned = False  # _host_names chosen (prepare_fsdp; after_fsdp when a stage skipped it)
        self._fsdp_modules: list[nn.Module] = []
        self._model: nn.Module | None = None
        self._ddp: nn.parallel.DistributedDataParallel | None = None
        self._swap_dirs: dict[str, Any] = {}
        self._closed = False
        if env.is_main:
            logger.info(
                "hf_zero: offload optimizer=%s%s params=%s, sub_group_size=%d",
                self.opt_cfg.device,
                f" (ratio {self.opt_cfg.ratio})" if self.opt_cfg.ratio < 1 else "",
                self.param_cfg.device,
                self.sub_group_size,
            )

    @property
    def owns_optimizer(self) -> bool:
        """Whether the optimizer is an :class:`OffloadedOptimizer` (its state dict is ours)."""
        return self.optimizer is not None

    @property
    def comm_device(self) -> torch.device:
        return collective_device()

    # ------------------------------------------------------------------------------ stages 2/3
    def prepare_fsdp(self, model: nn.Module, units: list[nn.Module], mesh: Any = None) -> dict[str, Any]:
        """Before ``fully_shard``: extra keyword arguments for it (FSDP2's CPU offload policy when
        ``offload_param`` is set). ``mesh``: the one ``fully_shard`` gets (None: flat over the world)."""
        kwargs: dict[str, Any] = {}
        shard_size, _ = shard_group(mesh, self.env.world_size)
        if self.opt_cfg.device != "none":
            self._host_names = self._plan_ratio(model, units)
            self._planned = True
            self._cast_before_sharding(model)
        if self.param_cfg.device != "none":
            from hf_zero.offload.param_offload import fsdp_cpu_offload_policy

            half = self.precision.compute_dtype in (torch.float16, torch.bfloat16)
            # Only an offloaded optimizer casts the shards to 16 bit (after_fsdp) and takes every
            # gradient in a hook (with a ratio below 1 the device part has none).
            host_step = self.opt_cfg.device != "none"
            kwargs["offload_policy"] = fsdp_cpu_offload_policy(
                self.param_cfg, model, shard_size, 2 if half and host_step else None,
                grads_hooked=host_step and self.opt_cfg.ratio >= 1)
        return kwargs

    def _cast_before_sharding(self, model: nn.Module) -> None:
        """Before ``fully_shard``: the offloaded parameters become 16-bit where they are, and their
        fp32 master weights never reach the accelerator.

        ``fully_shard`` moves parameters to the accelerator in the dtype they have, so casting
        after it (:meth:`_to_compute_dtype`) put a full fp32 copy of every offloaded shard on the
        accelerator first: on one H100, a 1.5B-parameter model peaked at 12.0 GiB, 4.1 GiB above
        its training steps' peak, against 7.5 GiB for DeepSpeed; a 7B model in one process would
        need 28 GiB of fp32 shards there (by arithmetic), more than a 24 GB card has.
        Meta parameters (rank 0's weights are scattered after ``fully_shard``) are cast for free
        and receive their fp32 masters from the fill (:meth:`wants` / :meth:`take`); real ones
        (a single process, which keeps its own weights) are this rank's whole shard: their masters
        are copied to the host here, then they are cast on their own device.
        """
        compute = self.precision.compute_dtype
        if compute not in (torch.float16, torch.bfloat16):
            return
        targets: set[int] = set()
        for name, param in model.named_parameters():
            if name not in self._host_names or param.dtype == compute or id(param) in targets:
                continue
            if param.is_meta:
                self._fill_masters.add(name)
            elif self.env.world_size == 1:
                self._masters[name] = param.detach().to("cpu", torch.float32, copy=True).contiguous()
            else:
                continue  # real weights on several ranks: cast after fully_shard (_to_compute_dtype)
            targets.add(id(param))
        if targets:
            with torch.no_grad():
                model._apply(lambda t: t.to(compute) if id(t) in targets else t)

    def wants(self, name: str) -> bool:
        """For the fill from rank 0 (``rank0_shards``): whether ``name``'s shard is needed in fp32."""
        return name in self._fill_masters

    def take(self, name: str, shard: torch.Tensor) -> None:
        """For the fill from rank 0: this rank's fp32 shard of ``name``, kept on the host as its master."""
        self._masters[name] = shard.detach().to("cpu", torch.float32, copy=True).contiguous()

    def _to_compute_dtype(self, model: nn.Module) -> None:
        """Capture this rank's fp32 shard of each offloaded parameter (the master weights), then
        make the parameter a 16-bit shard.

        This runs after ``fully_shard`` (and after the stage filled the shards, e.g. from rank 0
        with low-memory loading), through ``nn.Module._apply``: FSDP2's ``_apply`` re-pads its
        shards and re-reads their dtype at the first forward, and keeps parameter identity and
        weight tying. The cast goes unit by unit (:meth:`_plan_ratio`), since FSDP2 wants one
        dtype for a unit's trainable parameters. In fp32 training nothing is cast.
        """
        compute = self.precision.compute_dtype
        targets: set[int] = set()
        for name, param in model.named_parameters():
            if name not in self._host_names or name in self._masters:
                continue  # (masters captured before fully_shard or by the fill: _cast_before_sharding)
            local = param.to_local() if hasattr(param, "to_local") else param
            self._masters[name] = local.detach().to("cpu", torch.float32, copy=True).contiguous()
            if param.dtype != compute:
                targets.add(id(param))
        if targets:
            with torch.no_grad():
                model._apply(lambda t: t.to(compute) if id(t) in targets else t)

    def _plan_ratio(self, model: nn.Module, units: list[nn.Module]) -> set[str]:
        """FQNs of the trainable parameters whose optimizer state goes to the host.

        ``ratio`` < 1 (partial offload, stage 3) offloads whole FSDP units -- FSDP2 needs one
        dtype for a unit's trainable parameters, and offloaded ones are 16-bit -- in forward
        order (blocks, then the root's embeddings and head) until the next unit would pass the
        ratio of trainable elements; the rest keep fp32 shards stepped on the accelerator.
        """
        names = {id(p): n for n, p in model.named_parameters()}
        in_unit: dict[int, int] = {}
        for i, unit in enumerate(units):
            for p in unit.parameters():
                in_unit.setdefault(id(p), i)
        buckets: list[list[str]] = [[] for _ in range(len(units) + 1)]
        sizes = [0] * (len(units) + 1)
        for n, p in model.named_parameters():
            if not p.requires_grad:
                continue
            i = in_unit.get(id(p), len(units))
            buckets[i].append(n)
            sizes[i] += p.numel()
        ratio = float(self.opt_cfg.ratio)
        if ratio >= 1.0:
            return {n for b in buckets for n in b}
        total = sum(sizes)
        chosen: set[str] = set()
        taken = 0
        for bucket, size in zip(buckets, sizes):
            if taken + size <= ratio * total:
                chosen.update(bucket)
                taken += size
        if self.env.is_main:
            logger.info(
                "hf_zero: %s.ratio=%s offloads %.1f%% of the trainable elements (whole FSDP units)",
                _OPT, ratio, 100.0 * taken / max(total, 1),
            )
        del names
        return chosen

    def after_fsdp(self, model: nn.Module, units: list[nn.Module]) -> None:
        """After ``fully_shard`` (and after the shards hold their values): fp32 masters captured
        and 16-bit device shards for the offloaded parameters, then the parameter-offload backend."""
        self._model = model
        self._fsdp_modules = [*units, model]
        if self.opt_cfg.device != "none":
            if not self._planned:  # (prepare_fsdp planned them unless the stage skipped it)
                self._host_names = self._plan_ratio(model, units)
                self._planned = True
            missing = sorted(self._fill_masters - self._masters.keys())
            if missing:  # their shards are 16-bit already: masters taken from them would be rounded
                raise OffloadError(
                    f"the fill from rank 0 gave no fp32 master weights for {missing[:3]} ({len(missing)} parameters); "
                    "this is a bug in hf_zero, please report it"
                )
            self._to_compute_dtype(model)
        if self.param_cfg.device == "cpu":
            from hf_zero.offload.param_offload import CpuParamOffload

            self.params = CpuParamOffload(model)
        elif self.param_cfg.device == "nvme":
            from hf_zero.offload.param_offload import NvmeParamSwapper

            error: BaseException | None = None
            try:
                swap_dir = self._swap_dir(self.param_cfg.nvme_path, f"{_PARAM}.nvme_path")
                self.params = NvmeParamSwapper(model, self._fsdp_modules, self.param_cfg, self.aio, swap_dir)
            except BaseException as exc:  # noqa: BLE001 -- agreed on, then raised on every rank
                error = exc
            try:
                agree_on_error(error, f"setting up {_PARAM}.device=nvme")
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------------------ stage 1
    def prepare_ddp(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Stage 1: the DDP wrapper; the offloaded optimizer registers its comm hook on it (the
        stage must not register the precision's compression hook: the feed runs it itself)."""
        self._ddp = ddp

    # ------------------------------------------------------------------------------ optimizer
    def _swap_dir(self, nvme_path: str | None, setting: str) -> Any:
        from hf_zero.offload.nvme import SwapDir

        if not nvme_path:
            raise OffloadError(f"{setting} is required when the device is nvme")
        key = str(nvme_path)
        if key not in self._swap_dirs:
            self._swap_dirs[key] = SwapDir(nvme_path, self.run_id, self.env.rank, setting)
        return self._swap_dirs[key]

    def build_optimizer(self, recipe: Any, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer the engine steps: an :class:`OffloadedOptimizer` when the optimizer is
        offloaded, else the recipe's own (``offload_param`` only: FSDP2's CPU policy already put
        the shards, and so the optimizer's state, in host memory)."""
        groups = recipe.param_groups(model)
        if self.opt_cfg.device == "none":
            return recipe.build(groups)
        probe = recipe.build(groups)
        names = {id(p): n for n, p in model.named_parameters()}
        trainable = [p for g in probe.param_groups for p in g["params"]]
        rank, world = self.env.rank, self.env.world_size
        if self.stage in (0, 1):
            owner = _partition(trainable, world)
            plan = ParamPlan(host=[p for p in trainable if owner[id(p)] == rank], owner=owner)
        else:
            host = [p for p in trainable if names[id(p)] in self._host_names]
            masters = {}
            for p in host:
                master = self._masters[names[id(p)]]
                local = p.to_local() if hasattr(p, "to_local") else p
                if tuple(master.shape) != tuple(local.shape):
                    raise OffloadError(
                        f"{names[id(p)]}: fully_shard gave this rank a {tuple(local.shape)} shard, but hf_zero "
                        f"captured {tuple(master.shape)} for its master weights (torch changed how it shards?)"
                    )
                masters[id(p)] = master
            plan = ParamPlan(host=host, device=[p for p in trainable if names[id(p)] not in self._host_names],
                             masters=masters)
        self._masters = {}
        cfg = HostOffloadConfig(
            device=self.opt_cfg.device,
            sub_group_size=self.sub_group_size,
            pin_memory=bool(self.opt_cfg.pin_memory),
            buffer_count=int(self.opt_cfg.buffer_count),
            nvme_path=self.opt_cfg.nvme_path,
            aio=self.aio,
            run_id=self.run_id,
        )
        writer = getattr(self.params, "write_param", None) if self.param_cfg.device == "nvme" else None
        swap_dir = None
        if self.opt_cfg.device == "nvme":
            swap_dir = lambda: self._swap_dir(self.opt_cfg.nvme_path, f"{_OPT}.nvme_path")
        # Stages 2/3: FSDP2 shards over the mesh's shard group (all ranks on a flat mesh, the
        # mics_shard_size ranks of a replicate x shard one); the gradient feed's offsets and the
        # norm's reduction follow it. Which slice a rank holds is FSDP2's own (its local shard).
        mesh = next((p.device_mesh for p in trainable if hasattr(p, "device_mesh")), None)
        shard_size, norm_group = shard_group(mesh, world) if self.stage >= 2 else (world, None)
        optimizer = OffloadedOptimizer(
            probe, recipe.build, names, cfg, plan,
            rank=rank, world_size=world, comm_device=self.comm_device, param_writer=writer, swap_dir=swap_dir,
            norm_group=norm_group,
        )
        del probe
        if self.stage >= 2:
            feed = FsdpGradFeed(optimizer, self._fsdp_modules, plan.host, shard_size)
            optimizer.add_feed(feed)
            optimizer.pre_step_checks.append(feed.verify_layout)
        else:
            if self._ddp is None:
                raise OffloadError("stage 1 optimizer offload needs the DDP wrapper (prepare_ddp was not called)")
            optimizer.add_feed(DdpGradFeed(optimizer, self._ddp, {id(p) for p in plan.host},
                                            self.precision.reduce_dtype))
        if self.param_cfg.device == "nvme" and self.params is not None:
            optimizer.pre_step_checks.append(self.params.raise_if_failed)
            optimizer.post_step_actions.append(self.params.write_behind)
        self.optimizer = optimizer
        return optimizer

    # ------------------------------------------------------------------------------ engine
    def backends(self) -> list[OffloadBackend]:
        return [b for b in (self.optimizer, self.params) if b is not None]

    def claimed_params(self) -> set[int]:
        out: set[int] = set()
        for b in self.backends():
            out |= b.claimed_params()
        return out

    @contextlib.contextmanager
    def resident(self, write_back: bool = True) -> Iterator[None]:
        """Every swapped parameter shard in host memory inside the block (a no-op unless
        ``offload_param`` is nvme). Hold it around code that reads or writes parameter values
        outside the forward/backward, e.g. a 16-bit export."""
        if self.params is None:
            yield
            return
        with self.params.resident(write_back=write_back) if self.param_cfg.device == "nvme" else contextlib.nullcontext():
            yield

    def checkpoint_state(self, state: dict[str, Any], *, saving: bool = False) -> None:
        """Complete ``engine.state_dict()``'s ``state`` in place: the optimizer entry (when the
        optimizer is offloaded), fp32 masters in place of the 16-bit model entries, and host copies
        of NVMe-swapped parameters.

        At stages 0/1 every rank holds the whole (16-bit) model but only a parameter's owner holds
        its fp32 master. With ``saving`` the entry of each trainable parameter is then kept on its
        owner only, as the master: DCP writes a key held by several ranks from any one of them, so
        a 16-bit copy could otherwise stand in for the master in the checkpoint. A load template
        (``saving=False``) keeps every entry on every rank (the owner's is its master, so it is
        read in fp32); each rank's 16-bit parameters then get the master rounded."""
        module_state = state.get("module", {})
        replaced: set[str] = set()
        if self.optimizer is not None:
            optim_state, masters = self.optimizer.checkpoint_state()
            state["optimizer"] = optim_state
            aliases = self._aliases()
            owners = self.optimizer.owners()
            for name, master in masters.items():
                for alias in aliases.get(name, [name]):
                    if alias in module_state:
                        module_state[alias] = master
                        replaced.add(alias)
            if owners is not None and saving:
                for name, owner in owners.items():
                    if owner != self.env.rank:
                        for alias in aliases.get(name, [name]):
                            module_state.pop(alias, None)
        if self.param_cfg.device == "nvme" and self.params is not None:
            self.params.materialize(module_state, skip=replaced)

    def fp32_masters(self) -> tuple[dict[str, torch.Tensor], dict[str, int] | None]:
        """The fp32 master weights the offloaded optimizer holds on this rank, for an fp32 export of
        the live model (the model itself holds their 16-bit copies): ``({name: master}, owners)``,
        each name of a tied parameter listed. Stages 2/3: every rank holds the masters of its
        shards, as DTensors shaped like their parameters (``owners`` None). Stages 0/1: whole
        masters of the parameters this rank owns; ``owners`` names the rank holding each one.
        Empty when the optimizer is not offloaded."""
        if self.optimizer is None:
            return {}, None
        _, masters = self.optimizer.checkpoint_state()
        aliases = self._aliases()
        tensors = {alias: m for name, m in masters.items() for alias in aliases.get(name, [name])}
        owners = self.optimizer.owners()
        if owners is not None:
            owners = {alias: r for name, r in owners.items() for alias in aliases.get(name, [name])}
        return tensors, owners

    def _aliases(self) -> dict[str, list[str]]:
        if self._model is None:
            return {}
        by_id: dict[int, list[str]] = {}
        for name, p in self._model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
        return {names[0]: names for names in by_id.values()}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """The optimizer part of ``engine.load_state_dict`` when the optimizer is offloaded: state,
        hyper-parameters and the fp32 masters (from the model entries)."""
        assert self.optimizer is not None
        module_state = state.get("module", {})
        names = {slot.name for slot in self.optimizer.slots}
        masters = {n: module_state[n] for n in names if n in module_state}
        with self.resident():
            self.optimizer.load_checkpoint_state(state["optimizer"], masters)

    def swap_files(self) -> list[str]:
        files = []
        for b in self.backends():
            files.extend(getattr(b, "swap_files", list)())
        return files

    def swap_dirs(self) -> list[str]:
        return [d.path for d in self._swap_dirs.values()]

    def close(self) -> None:
        """Stop threads, remove hooks and delete this rank's swap files (idempotent)."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for backend in self.backends():
            try:
                backend.close()
            except BaseException as exc:  # noqa: BLE001 -- keep closing the others
                errors.append(exc)
        for swap_dir in self._swap_dirs.values():
            swap_dir.close()
        if errors:
            raise errors[0]
