"""Muon for the matrices, AdamW for the rest, as DeepSpeed 0.19's ``optimizer.type: "Muon"`` runs it.

What DeepSpeed 0.19.8 does (``deepspeed/__init__.py`` ``set_optimizer_flags``,
``runtime/engine.py`` ``_muon_param_groups``, ``runtime/zero/muon/original_muon.py``
``muon_update``, ``runtime/zero/muon/muon_optimizer.py`` ``MuonWithAuxAdam``), and so this module:

- **Which parameters.** A parameter is Muon's when its layer shape has 2 or more dimensions and its
  name (lower case) contains neither ``embed`` nor ``lm_head`` (:func:`uses_muon`); everything
  else (embeddings, the output head, norms, biases) is stepped by Adam. Each incoming param group
  is split into a Muon half and an Adam half (:func:`muon_param_groups`), keeping the group's own
  settings (a Trainer-style ``weight_decay: 0`` group stays undecayed).
- **Muon's update**, per matrix ``W`` with gradient ``G``, momentum ``M`` (``momentum`` = beta)::

      M = lerp(M, G, 1 - beta)                      # M = beta*M + (1-beta)*G
      U = lerp(G, M, beta)                          # Nesterov (always on in DeepSpeed)
      O = NS5(U) * sqrt(max(1, rows / cols))        # rows, cols = the last two dimensions
      W = W * (1 - lr * weight_decay) - lr * O

  ``NS5`` is the quintic Newton-Schulz iteration: ``X = U / (||U||_F + 1e-7)`` (transposed so that
  rows <= cols), then 5 times ``A = X X^T; X = a X + (b A + c A A) X`` with
  ``(a, b, c) = (3.4445, -4.7750, 2.0315)``. ``ns_method: "gram"`` (DeepSpeed's default) iterates
  on the Gram matrix ``X X^T`` instead (Tri Dao's Gram Newton-Schulz, restarted at iteration 2):
  the same polynomial, fewer FLOPs for wide matrices. A 4-D weight (conv) is viewed as
  ``[out, -1]`` (DeepSpeed 0.19.8 intends this but fails there: its ``torch.where`` meets the 2-D
  update with the 4-D gradient); other shapes with more than 2 dimensions are a batch of
  matrices. A step whose gradient is not finite leaves the momentum unchanged (DeepSpeed's
  loss-scaler guard).
- **Adam's update** is ``torch.optim.AdamW`` (``adam_w_mode: false``: ``torch.optim.Adam``, L2
  decay), the numbers of DeepSpeed's FusedAdam; its defaults are Muon's: ``betas (0.9, 0.95)``,
  ``eps 1e-10``.
- **Settings read from ``optimizer.params``**: ``lr`` (both halves), ``muon_lr`` / ``adam_lr``
  (one half each, overriding ``lr``), ``momentum``, ``weight_decay`` (both), ``ns_method``,
  ``betas``, ``eps``, ``adam_w_mode``. Defaults when absent: Muon ``lr 0.02``, ``momentum 0.95``,
  Adam ``lr 3e-4``, ``weight_decay 0``. DeepSpeed does not read ``ns_steps`` or ``nesterov``
  (always 5 and true); the constructor here takes them for direct use.

Where hf_zero differs, on purpose:

- **Newton-Schulz precision.** DeepSpeed runs the iteration in fp16 (``gram``) or bf16
  (``standard``) where the accelerator has them -- including its CPU accelerator. hf_zero does so on
  an accelerator; on CPU (its test path) it runs fp32, so a CPU run is exact against the formula.
  ``ns_dtype`` (constructor only) chooses explicitly.
- **Clipping comes first.** hf_zero clips the raw gradients (and reports their norm) before the
  optimizer step at every stage, as DeepSpeed does at fp32 stage 0 and in its BF16 optimizer
  (stage 1 with ``data_types.grad_accum_dtype: "fp32"``); DeepSpeed's ZeRO-1/2/3 optimizers
  instead orthogonalize first and clip the Muon update together with Adam's gradients. With
  ``gradient_clipping: 0`` the two agree.
- **Parameters without a gradient are skipped**, as by every torch optimizer; DeepSpeed steps them
  with a zero gradient.

Why not ``torch.optim.Muon``: it runs Newton-Schulz in bf16 always (DeepSpeed's ``gram`` default is
fp16, and its CPU path fp32 here), normalises by ``max(||U||, eps)`` instead of ``||U|| + eps``,
has no Gram variant, takes 2-D parameters only, and on a sharded DTensor it would orthogonalize
each rank's shard instead of the matrix. Its momentum, Nesterov blend, ``sqrt(max(1, A/B))``
scaling and decoupled decay are the same as DeepSpeed's and as here (a unit test compares the two
in bf16). The Adam half *is* torch's AdamW: it steps the Adam groups over this optimizer's state,
which is how DeepSpeed runs FusedAdam inside its ``MuonWithAuxAdam``.

Sharding. Newton-Schulz needs the whole matrix, and DeepSpeed gathers it: at ZeRO-1/2 every rank
holds the averaged full gradient of each matrix that touches its partition and orthogonalizes it
whole, keeping its slice; at ZeRO-3 the gradient partitions are all-gathered per sub-group, each
rank orthogonalizes a round-robin share and the results are all-gathered back. hf_zero does the
equivalent on its layouts:

- stage 0 (DDP) and stage 1 (``ZeroRedundancyOptimizer``: each rank steps whole parameters it
  owns): parameters and gradients are whole tensors; nothing to gather.
- stages 2/3 (FSDP2, dim-0 ``Shard`` DTensors over a 1-D mesh): momentum and the Nesterov blend
  are computed on the local shards (element-wise). The matrices are then taken in rounds of one
  per rank, as DeepSpeed's ZeRO-3 does: an ``all_to_all`` brings rank ``j`` every shard of the
  round's ``j``-th matrix, rank ``j`` orthogonalizes it, and a second ``all_to_all`` returns each
  rank its rows. Each rank holds one full matrix at a time and the momentum stays sharded; per
  step every matrix crosses the network twice in total (not once per rank, as an all-gather would
  send it), and each Newton-Schulz runs on one rank only.
- any other DTensor layout: the blend is gathered with ``full_tensor()``, every rank
  orthogonalizes it and keeps its own part.

Optimizer offload (``offload_optimizer``) is refused with Muon (``config/refused.py``): hf_zero's
offloaded optimizer steps flat host chunks of each rank's shard, not matrices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from hf_zero.optim.fused_kernels import fused_supported

__all__ = [
    "MuonWithAuxAdam",
    "NS_COEFFICIENTS",
    "NS_METHODS",
    "muon_param_groups",
    "newton_schulz",
    "orthogonalize",
    "uses_muon",
]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""``(a, b, c)`` of the quintic ``a X + b (X X^T) X + c (X X^T)^2 X`` (Keller Jordan's Muon)."""
NS_STEPS = 5
NS_EPS = 1e-7
"""Added to the Frobenius norm before dividing by it (DeepSpeed; torch clamps the norm instead)."""
NS_METHODS = ("gram", "standard")
_NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GRAM_RESTART = 2
"""The Gram iteration re-forms ``X`` and ``X X^T`` at this iteration (half-precision stability)."""
_NOT_MUON_NAMES = ("embed", "lm_head")


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """Whether DeepSpeed gives ``param`` (called ``name`` in the model) to Muon.

    DeepSpeed's ``set_optimizer_flags``: 2 or more dimensions, and no ``embed`` / ``lm_head`` in the
    lower-cased name. A sharded DTensor reports its global shape, so the answer is the same at
    every stage.
    """
    return param.ndim >= 2 and not any(word in name.lower() for word in _NOT_MUON_NAMES)


def muon_param_groups(groups: Iterable[dict[str, Any]], names: Mapping[int, str]) -> list[dict[str, Any]]:
    """Split each param group into a Muon half and an Adam half (``use_muon`` True / False).

    Each half keeps the group's other keys (its ``lr``, ``weight_decay``, ...), as DeepSpeed's
    ``_muon_param_groups`` does; an empty half is dropped. Groups that already say ``use_muon``
    are kept as they are.

    Args:
        groups: Param-group dicts (``{"params": [...], ...}``).
        names: ``id(param) -> name`` in the model, for :func:`uses_muon`.

    Returns:
        The new groups: for each input group, its Muon half, then its Adam half.
    """
    out: list[dict[str, Any]] = []
    for group in groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        params = list(group["params"])
        if "use_muon" in hyper:
            out.append({**hyper, "params": params})
            continue
        for flag in (True, False):
            half = [p for p in params if uses_muon(names.get(id(p), ""), p) is flag]
            if half:
                out.append({**hyper, "params": half, "use_muon": flag})
    return out


# ------------------------------------------------------------------------------- Newton-Schulz
def _normalized(x: torch.Tensor) -> torch.Tensor:
    return x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)


def _quintic(x: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def _gram_quintic(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic on ``R = X X^T`` (n x n, n <= m): ``X_k = Q_k X_0`` with ``Q`` a polynomial in
    ``R``, the same iterate as :func:`_quintic` in exact arithmetic. Restarted at iteration 2
    (``X = Q X``, ``R`` re-formed), as DeepSpeed's ``zeropower_via_gram_newtonschulz``."""
    a, b, c = NS_COEFFICIENTS
    r = x @ x.mT
    q: torch.Tensor | None = None
    for i in range(steps):
        if i == _GRAM_RESTART and q is not None:
            x = q @ x
            r = x @ x.mT
            q = None
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != _GRAM_RESTART:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    return q @ x


def newton_schulz(g: torch.Tensor, steps: int, method: str, dtype: torch.dtype) -> torch.Tensor:
    """Orthogonalize the last two dimensions of ``g`` (``U S V^T -> U S' V^T``, ``S'`` near 1).

    Args:
        g: A matrix, or a batch of matrices in its last two dimensions.
        steps: Iterations (DeepSpeed: 5).
        method: ``"standard"`` (normalise in ``dtype``, iterate on ``X``) or ``"gram"`` (normalise
            in ``g``'s dtype -- fp32 for an fp16 input -- then iterate on ``X X^T``).
        dtype: The dtype the iteration runs in.

    Returns:
        The orthogonalized tensor, in ``dtype``, shaped like ``g``.
    """
    if method not in NS_METHODS:
        raise ValueError(f"Newton-Schulz method must be one of {', '.join(NS_METHODS)}, got {method!r}")
    tall = g.size(-2) > g.size(-1)
    if method == "standard":
        x = g.to(dtype)
        x = _normalized(x.mT if tall else x)
        x = _quintic(x, steps)
    else:
        # fp16 tops out at 65504: normalise before the cast (DeepSpeed's comment on loss-scaled input).
        x = g.to(torch.float32 if g.dtype == torch.float16 else g.dtype)
        x = _normalized(x.mT if tall else x).to(dtype)
        # A square matrix gains nothing from the Gram form; DeepSpeed runs the plain loop there.
        x = _quintic(x, steps) if x.size(-1) <= x.size(-2) else _gram_quintic(x, steps)
    return x.mT if tall else x


def orthogonalize(update: torch.Tensor, steps: int, method: str, dtype: torch.dtype) -> torch.Tensor:
    """Muon's update for one parameter: Newton-Schulz, then ``sqrt(max(1, rows / cols))``.

    As DeepSpeed's ``muon_update``: a 4-D tensor is viewed as ``[shape[0], -1]`` for the iteration,
    the scale uses the last two dimensions of the parameter's own shape, and the result comes back
    in ``update``'s dtype and shape.
    """
    rows, cols = update.size(-2), update.size(-1)
    x = update.reshape(update.size(0), -1) if update.ndim == 4 else update
    out = newton_schulz(x, steps, method, dtype)
    if rows > cols:
        out = out * math.sqrt(rows / cols)
    return out.to(update.dtype).reshape(update.shape)


def _compute_dtype(method: str, choice: str | None, device: torch.device) -> torch.dtype:
    """DeepSpeed's ``ns_compute_dtype`` on an accelerator (gram: fp16, standard: bf16 where
    supported); fp32 on CPU (see the module docstring); ``choice`` overrides."""
    if choice is not None:
        return _NS_DTYPES[choice]
    from hf_zero.distributed import device as accel

    if not accel.is_accelerator(device):
        return torch.float32
    if method == "gram":
        return torch.float16
    return torch.bfloat16 if accel.bf16_supported(device.index) else torch.float32


# ------------------------------------------------------------------------------- sharded tensors
def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "device_mesh")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _full(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole matrix whose shard on this rank is ``local`` (sharded like ``like``).

    A collective: every rank of ``like``'s mesh calls it for the same parameter. ``from_local``
    moves a host shard (FSDP2's CPU offload) to the mesh's device first, as NCCL needs.
    """
    if not _is_dtensor(like):
        return local
    from torch.distributed.tensor import DTensor

    sharded = DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                 shape=like.shape, stride=like.stride())
    return sharded.full_tensor()


def _own_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full`` in ``like``'s layout (Replicate -> Shard is a local slice)."""
    if not _is_dtensor(like):
        return full
    from torch.distributed.tensor import DTensor, Replicate

    mesh = like.device_mesh
    whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, like.placements).to_local()


# ------------------------------------------------------------------------------- the optimizer
class MuonWithAuxAdam(torch.optim.Optimizer):
    """Muon for the groups with ``use_muon: True``, Adam(W) for the groups with ``use_muon: False``.

    Every param group must say ``use_muon`` (:func:`muon_param_groups` splits a model's groups the
    way DeepSpeed does). Muon groups hold matrices (2 or more dimensions). A group's own ``lr``,
    ``weight_decay``, ``momentum``, ``betas``, ``eps`` override the defaults below; an Adam group
    without ``lr`` takes ``adam_lr``.

    Args:
        params: Param-group dicts, each with ``use_muon``.
        lr: Muon's learning rate (DeepSpeed's default 0.02).
        momentum: Muon's momentum (beta), in [0, 1).
        weight_decay: Decoupled weight decay of both halves (Adam's is L2 when ``adam_w_mode`` is
            false).
        ns_method: ``"gram"`` (DeepSpeed's default) or ``"standard"`` Newton-Schulz.
        adam_lr: The Adam groups' learning rate (DeepSpeed's default 3e-4).
        betas: Adam's betas (DeepSpeed's Muon default ``(0.9, 0.95)``).
        eps: Adam's epsilon (DeepSpeed's Muon default ``1e-10``).
        adam_w_mode: True: AdamW (decoupled decay); False: Adam with L2 decay.
        nesterov: Nesterov momentum (DeepSpeed: always true).
        ns_steps: Newton-Schulz iterations (DeepSpeed: always 5).
        ns_dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` for the iteration; None: fp16
            (gram) or bf16 (standard) on an accelerator, fp32 on CPU.

    Example::

        >>> names = {id(p): n for n, p in model.named_parameters()}
        >>> groups = muon_param_groups([{"params": list(model.parameters())}], names)
        >>> opt = MuonWithAuxAdam(groups, lr=0.02, adam_lr=3e-4, weight_decay=0.01)
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_method: str = "gram",
        adam_lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-10,
        adam_w_mode: bool = True,
        nesterov: bool = True,
        ns_steps: int = NS_STEPS,
        ns_dtype: str | None = None,
    ) -> None:
        _check_hyper(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_method=ns_method, adam_lr=adam_lr,
                     betas=betas, eps=eps, ns_steps=ns_steps, ns_dtype=ns_dtype)
        self._aux: torch.optim.Optimizer | None = None
        # defaults' keys are exactly __init__'s keyword arguments, so ZeroRedundancyOptimizer (stage 1)
        # can build each rank's local optimizer from them.
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_method=ns_method, adam_lr=adam_lr,
                        betas=tuple(betas), eps=eps, adam_w_mode=adam_w_mode, nesterov=nesterov,
                        ns_steps=int(ns_steps), ns_dtype=ns_dtype)
        super().__init__(params, defaults)
        self._link_aux()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; it must say ``use_muon`` (an Adam group without ``lr`` takes ``adam_lr``)."""
        if "use_muon" not in param_group:
            raise ValueError(
                "MuonWithAuxAdam: every param group needs a use_muon key (True: Muon, False: Adam); "
                "split the parameters with hf_zero.optim.muon.muon_param_groups(groups, names)"
            )
        if not param_group["use_muon"]:
            param_group.setdefault("lr", self.defaults["adam_lr"])
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["use_muon"]:
            flat = [p for p in group["params"] if p.ndim < 2]
            if flat:
                raise ValueError(
                    f"MuonWithAuxAdam: a use_muon group holds a parameter of shape {tuple(flat[0].shape)}; "
                    "Muon orthogonalizes matrices, so give vectors and scalars to a use_muon=False group"
                )
            if group["ns_method"] not in NS_METHODS:
                raise ValueError(f"MuonWithAuxAdam: ns_method must be one of {', '.join(NS_METHODS)}, "
                                 f"got {group['ns_method']!r}")
        if getattr(self, "_aux", None) is not None:
            self._link_aux()

    def _link_aux(self) -> None:
        """Point the Adam optimizer at this optimizer's Adam groups and state (once built, and
        again after ``load_state_dict`` replaced the group dicts)."""
        groups = [g for g in self.param_groups if not g["use_muon"]]
        if self._aux is None:
            if not groups:
                return
            cls = torch.optim.AdamW if self.defaults["adam_w_mode"] else torch.optim.Adam
            tensors = [p for g in groups for p in g["params"]]
            # torch's fused kernel runs on CPU and CUDA, FSDP2's DTensor shards included.
            fast = dict(fused=True) if fused_supported(tensors) else {}  # build_optimizer's rule for AdamW
            d = self.defaults
            self._aux = cls(groups, lr=d["adam_lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                            **fast)
        for group in groups:
            for key, value in self._aux.defaults.items():
                group.setdefault(key, value)
        self._aux.param_groups = groups
        self._aux.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, then re-link the Adam optimizer to the new groups and state."""
        super().load_state_dict(state_dict)
        self._link_aux()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Update every parameter that has a gradient (Muon groups first, then Adam's).

        At stages 2/3 this is collective: every rank steps the same Muon parameters in the same
        order, which FSDP2's identical param groups guarantee.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
        if self._aux is not None:
            adam_groups = [g for g in self.param_groups if not g["use_muon"]]
            if len(adam_groups) != len(self._aux.param_groups) or any(
                a is not b for a, b in zip(adam_groups, self._aux.param_groups)
            ) or self._aux.state is not self.state:
                self._link_aux()
            self._aux.step()
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        sharded = [p for p in params if _row_sharded(p)]
        meshes = {id(p.device_mesh) for p in sharded}
        if len(meshes) > 1:  # not FSDP2's single mesh: gather every matrix instead
            sharded = []
        for p in params:
            if not any(p is q for q in sharded):
                self._muon_whole(p, group)
        if sharded:
            world = sharded[0].device_mesh.size()
            for start in range(0, len(sharded), world):
                self._muon_round(sharded[start:start + world], group)

    def _prepare(self, p: torch.Tensor, group: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """This rank's part of the parameter, momentum, new momentum and Nesterov blend.

        Element-wise, so on a DTensor parameter it runs on the local shard (FSDP2 gives parameter,
        gradient and state the same layout)."""
        if p.grad.is_sparse:
            raise RuntimeError("MuonWithAuxAdam does not support sparse gradients")
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        weight, grad, buf = _local(p), _local(p.grad), _local(state["momentum_buffer"])
        if grad.shape != weight.shape or buf.shape != weight.shape:
            raise RuntimeError(
                f"MuonWithAuxAdam: gradient {tuple(grad.shape)} / momentum {tuple(buf.shape)} are not laid out "
                f"like the parameter's shard {tuple(weight.shape)}"
            )
        beta = group["momentum"]
        new_buf = buf.lerp(grad, 1.0 - beta)
        blend = grad.lerp(new_buf, beta) if group["nesterov"] else new_buf
        return weight, buf, new_buf, blend

    @staticmethod
    def _orthogonalized(full: torch.Tensor, group: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Muon's update of a whole matrix, and whether it is finite. A non-finite blend keeps the
        old momentum and passes through as the update, as in DeepSpeed's ``muon_update``."""
        dtype = _compute_dtype(group["ns_method"], group["ns_dtype"], full.device)
        ortho = orthogonalize(full, group["ns_steps"], group["ns_method"], dtype)
        finite = torch.isfinite(full).all()
        return torch.where(finite, ortho, full), finite

    @staticmethod
    def _apply(weight, buf, new_buf, mine, finite, group) -> None:
        buf.copy_(torch.where(finite.to(buf.device), new_buf, buf))
        lr, wd = group["lr"], group["weight_decay"]
        if wd != 0.0:
            weight.mul_(1.0 - lr * wd)
        weight.add_(mine.to(weight.device, weight.dtype), alpha=-lr)

    def _muon_whole(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        """One matrix: whole already (stages 0/1), or gathered with ``full_tensor()`` on every rank
        (a DTensor in another layout than FSDP2's)."""
        weight, buf, new_buf, blend = self._prepare(p, group)
        ortho, finite = self._orthogonalized(_full(blend, p), group)
        mine = _own_part(ortho, p)
        if mine.shape != weight.shape:
            raise RuntimeError(
                f"MuonWithAuxAdam: this rank's part of the update is {tuple(mine.shape)}, its shard "
                f"{tuple(weight.shape)} (placements {getattr(p, 'placements', None)})"
            )
        self._apply(weight, buf, new_buf, mine, finite, group)

    def _muon_round(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """Up to one matrix per rank, FSDP2's dim-0 shards: rank ``j`` gathers matrix ``j``, runs
        Newton-Schulz on it and sends each rank its rows back (two ``all_to_all``), as DeepSpeed's
        ZeRO-3 shares the orthogonalizations round-robin. Each rank's rows travel with a finite flag."""
        import torch.distributed as dist

        mesh = params[0].device_mesh
        pg, world, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        local = [self._prepare(p, group) for p in params]
        rows = [_shard_rows(p.shape[0], world) for p in params]
        cols = [math.prod(p.shape[1:]) for p in params]
        for p, (weight, *_), r in zip(params, local, rows):
            if weight.shape[0] != r[me]:
                raise RuntimeError(f"MuonWithAuxAdam: shard of {tuple(p.shape)} has {weight.shape[0]} rows on rank "
                                   f"{me}, expected {r[me]} (torch.chunk's dim-0 split)")
        blends = [blend for *_, blend in local]
        device = _exchange_device(blends[0], mesh.device_type)
        dtype = blends[0].dtype
        for b in blends[1:]:
            dtype = torch.promote_types(dtype, b.dtype)
        count, mine = len(params), me < len(params)

        send = torch.cat([b.reshape(-1).to(device, dtype) for b in blends])
        send_sizes = [r[me] * c for r, c in zip(rows, cols)] + [0] * (world - count)
        recv_sizes = [n * cols[me] for n in rows[me]] if mine else [0] * world
        recv = send.new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=pg)

        if mine:
            ortho, finite = self._orthogonalized(recv.view(params[me].shape), group)
            flag = finite.to(dtype).reshape(1)
            pieces = ortho.reshape(params[me].shape[0], -1).split(rows[me], dim=0)
            back = torch.cat([t for piece in pieces for t in (piece.reshape(-1), flag)])
        else:
            back = send.new_empty(0)
        back_sizes = [n * cols[me] + 1 for n in rows[me]] if mine else [0] * world
        home_sizes = [r[me] * c + 1 for r, c in zip(rows, cols)] + [0] * (world - count)
        home = send.new_empty(sum(home_sizes))
        dist.all_to_all_single(home, back, home_sizes, back_sizes, group=pg)

        for (weight, buf, new_buf, _), part in zip(local, home.split(home_sizes[:count])):
            self._apply(weight, buf, new_buf, part[:-1].view(weight.shape), part[-1] > 0.5, group)


def _row_sharded(p: torch.Tensor) -> bool:
    """FSDP2's layout: a DTensor sharded on dim 0 over a 1-D mesh."""
    if not _is_dtensor(p) or p.device_mesh.ndim != 1 or len(p.placements) != 1:
        return False
    placement = p.placements[0]
    return placement.is_shard() and placement.dim == 0


def _shard_rows(total: int, world: int) -> list[int]:
    """Rows of each rank's dim-0 shard: ``torch.chunk``'s split (chunks of ``ceil(total / world)``),
    empty for ranks past the last chunk -- DTensor's ``Shard(0)`` and FSDP2's layout."""
    chunk = -(-total // world)
    return [max(0, min(chunk, total - i * chunk)) for i in range(world)]


def _exchange_device(t: torch.Tensor, mesh_type: str) -> torch.device:
    """Where the exchange runs: the tensor's device, or the accelerator when the shard is in host
    memory (FSDP2's CPU offload) and the mesh is not (NCCL takes device tensors only)."""
    if t.device.type == mesh_type:
        return t.device
    from hf_zero.distributed import device as accel

    return accel.current_device()


def _check_hyper(*, lr, momentum, weight_decay, ns_method, adam_lr, betas, eps, ns_steps, ns_dtype) -> None:
    problems = []
    if not lr >= 0.0:
        problems.append(f"lr must be >= 0, got {lr}")
    if not adam_lr >= 0.0:
        problems.append(f"adam_lr must be >= 0, got {adam_lr}")
    if not 0.0 <= momentum < 1.0:
        problems.append(f"momentum must be in [0, 1), got {momentum}")
    if not weight_decay >= 0.0:
        problems.append(f"weight_decay must be >= 0, got {weight_decay}")
    if ns_method not in NS_METHODS:
        problems.append(f"ns_method must be one of {', '.join(NS_METHODS)}, got {ns_method!r}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        problems.append(f"betas must be two numbers in [0, 1), got {betas}")
    if not eps >= 0.0:
        problems.append(f"eps must be >= 0, got {eps}")
    if isinstance(ns_steps, bool) or int(ns_steps) != ns_steps or ns_steps < 1:
        problems.append(f"ns_steps must be a whole number >= 1, got {ns_steps}")
    if ns_dtype is not None and ns_dtype not in _NS_DTYPES:
        problems.append(f"ns_dtype must be None or one of {', '.join(_NS_DTYPES)}, got {ns_dtype!r}")
    if problems:
        raise ValueError("MuonWithAuxAdam: " + "; ".join(problems))
