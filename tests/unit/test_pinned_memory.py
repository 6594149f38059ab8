"""Pinned host memory (review F9): planned with the host caching allocator's power-of-two rounding,
checked against the container's headroom before anything is pinned, and taken in a few blocks.

The rounding rule is torch's own (``ATen/core/CachingHostAllocator.h``: ``PowerOf2Ceil(size)`` for
every pinned allocation unless ``pinned_max_round_threshold`` is set, and freed blocks stay
cached). The engine runs under the fake accelerator (tests/fake_accelerator.py), which records
every pinned allocation.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

import hf_zero
from hf_zero.checkpoint.export16 import gather_full_state_dict
from hf_zero.distributed import device as accel
from hf_zero.offload import pinned
from hf_zero.offload.pinned import (
    HostArena,
    plan_blocks,
    planned_pinned_bytes,
    pinning_fits,
    pow2_ceil,
    rounded_per_buffer_bytes,
)
from hf_zero.utils.host_memory import cgroup_memory, host_headroom
from tests.fake_accelerator import NoAccelerator, fake_accelerator

MiB = 1 << 20


def test_pow2_ceil_is_the_allocators_rounding():
    assert [pow2_ceil(n) for n in (0, 1, 2, 3, 4, 5, 4096, 4097)] == [0, 1, 2, 4, 4, 8, 4096, 8192]


def test_blocks_are_powers_of_two_filled_largest_first():
    # 3 + 3 MiB fill a 8 MiB block only up to 6; the next 3 MiB does not fit and opens the last
    # block, which is the power of two of what it holds (3 MiB -> 4 MiB).
    assert plan_blocks([3 * MiB, 3 * MiB, 3 * MiB], block=8 * MiB) == [8 * MiB, 4 * MiB]
    # largest first: the 1 MiB buffers fill the 6 MiB one's block
    blocks, places = pinned.plan_layout([1 * MiB, 6 * MiB, 1 * MiB], block=8 * MiB)
    assert blocks == [8 * MiB] and places == [(0, 6 * MiB), (0, 0), (0, 7 * MiB)]
    # a buffer larger than the block size widens every block to its own power of two
    assert plan_blocks([5 * MiB, 1 * MiB], block=4 * MiB) == [8 * MiB]
    # each view starts 64-byte aligned: 10 bytes take 64
    assert plan_blocks([10, 10]) == [128]
    assert plan_blocks([]) == []


def test_arena_on_a_7b_shaped_shard_costs_a_fraction_of_per_buffer_pinning():
    """Qwen2-7B's parameters (hidden 3584, MLP 18944, 28 layers, vocab 152064, KV 512), fp32
    shards of 2 ranks: one pinned buffer each is rounded to ~1.5x the bytes; the arena to less than
    1.1x (its blocks are as large as the largest shard, the embedding's 1 GiB, rounded to 2 GiB)."""
    h, mlp, kv, vocab = 3584, 18944, 512, 152064
    layer = [h * h, h, h * kv, kv, h * kv, kv, h * h, h * mlp, h * mlp, mlp * h, h, h]
    numels = [vocab * h] + layer * 28 + [h, vocab * h]
    sizes = [4 * -(-n // 2) for n in numels]
    raw = sum(sizes)
    arena = planned_pinned_bytes(sizes)
    each = rounded_per_buffer_bytes(sizes)
    assert raw <= arena < 1.1 * raw, arena / raw
    assert each > 1.4 * raw, each / raw  # what per-parameter pinning reserved
    print(f"raw {raw / 2**30:.2f} GiB, per-buffer {each / 2**30:.2f} GiB, arena {arena / 2**30:.2f} GiB")


def test_arena_views_are_separate_and_zeroed():
    arena = HostArena([3, 5, 0, 7], torch.float32, pin=False, setting="x")
    for i, v in enumerate(arena.views):
        assert v.dtype == torch.float32 and v.numel() == [3, 5, 0, 7][i] and v.is_contiguous()
        assert torch.equal(v, torch.zeros_like(v))
        v.fill_(i + 1)
    assert [float(v.sum()) for v in arena.views] == [3.0, 10.0, 0.0, 28.0]  # no overlap
    assert all(v.data_ptr() % 64 == 0 for v in arena.views if v.numel())


def test_pinning_fits_compares_the_node_total_with_the_headroom(caplog):
    assert pinning_fits(4 * MiB, "offload_optimizer.pin_memory", headroom=(100 * MiB, "test"), ranks=2)
    assert pinning_fits(4 * MiB, "s", headroom=(None, "unknown"), ranks=8)  # nothing to check against
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        ok = pinning_fits(40 * MiB, "offload_optimizer.pin_memory", headroom=(100 * MiB, "the container's limit"),
                          ranks=4)
    assert not ok
    text = caplog.text
    assert "offload_optimizer.pin_memory" in text and "160.0 MiB" in text and "pageable" in text, text
    assert "the container's limit" in text


def _tree(root: Path, files: dict[str, str]) -> str:
    for rel, text in files.items():
        path = root / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def test_headroom_is_the_tighter_of_memavailable_and_the_cgroup(tmp_path):
    # Slurm/Kubernetes style: the job's cgroup (a) is limited to 1 GiB, the leaf (a/b) is "max".
    root = _tree(tmp_path, {
        "/proc/self/cgroup": "0::/a/b\n",
        "/proc/meminfo": "MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n",
        "/sys/fs/cgroup/a/memory.max": str(1 << 30),
        "/sys/fs/cgroup/a/memory.current": str(768 * MiB),
        "/sys/fs/cgroup/a/b/memory.max": "max",
        "/sys/fs/cgroup/memory.max": "max",
    })
    cg = cgroup_memory(root)
    assert cg.limit == 1 << 30 and cg.usage == 768 * MiB and cg.source.endswith("/a/memory.max")
    assert host_headroom(root) == (256 * MiB, f"the container's memory limit minus its usage ({cg.source})")
    # no cgroup limit: MemAvailable bounds it
    root2 = _tree(tmp_path / "free", {"/proc/self/cgroup": "0::/\n", "/proc/meminfo": "MemAvailable: 1024 kB\n",
                                      "/sys/fs/cgroup/memory.max": "max"})
    assert host_headroom(root2) == (1 << 20, "MemAvailable in /proc/meminfo")


# ---------------------------------------------------------------------------- the engine, pinned
def _train(cfg: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    engine = hf_zero.initialize(model, cfg)
    gen = torch.Generator().manual_seed(1)
    losses = []
    try:
        for _ in range(3):
            ids = torch.randint(0, 64, (2, 8), generator=gen)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        weights = {k: v.float().clone() for k, v in gather_full_state_dict(engine).items()}
    finally:
        engine.close()
    return losses, weights


def _config(stage: int, param: bool = False) -> dict:
    zo: dict = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if param:
        zo["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"zero_optimization": zo, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _recording(fake) -> list[int]:
    sizes: list[int] = []
    original = fake.pinned_empty

    def pinned_empty(nbytes: int) -> torch.Tensor:
        sizes.append(nbytes)
        return original(nbytes)

    fake.pinned_empty = pinned_empty
    return sizes


@pytest.mark.parametrize("stage", [1, 2])
def test_offloaded_optimizer_pins_one_block_per_kind(stage):
    """Gradients and fp32 masters of every offloaded parameter: 2 pinned allocations (were 2 per
    parameter: 42 for this model), training unchanged."""
    with accel.use_runtime(NoAccelerator()):
        plain = _train(_config(stage))
    with fake_accelerator() as fake:
        sizes = _recording(fake)
        got = _train(_config(stage))
    assert len(sizes) == 2 and all(s == pow2_ceil(s) for s in sizes), sizes
    assert got[0] == plain[0]
    for name, value in plain[1].items():
        assert torch.equal(got[1][name], value), name


def test_no_pinning_when_the_plan_does_not_fit(monkeypatch, caplog):
    """A headroom smaller than the plan: pageable buffers and a warning instead of an OOM kill;
    the same training."""
    with accel.use_runtime(NoAccelerator()):
        plain = _train(_config(3, param=True))
    monkeypatch.setattr(pinned, "host_headroom", lambda: (64 << 10, "the container's memory limit minus its usage"))
    with fake_accelerator() as fake, caplog.at_level(logging.WARNING, logger="hf_zero"):
        sizes = _recording(fake)
        got = _train(_config(3, param=True))
    assert sizes == [], f"pinned {sizes} although the plan did not fit"
    assert "offload_optimizer.pin_memory" in caplog.text and "offload_param.pin_memory" in caplog.text, caplog.text
    assert got[0] == plain[0]
    for name, value in plain[1].items():
        assert torch.equal(got[1][name], value), name


def test_gradient_layout_check_raises_before_the_update(monkeypatch):
    """The check that FSDP2's fp32 reduce-scatter output is laid out as hf_zero reads it (now on
    the device, verdict read once before the step; it used to synchronize per gradient) still
    stops a wrong layout before any parameter changes."""
    from hf_zero.offload import grad_feeds
    from hf_zero.offload.base import OffloadError

    cfg = _config(2)
    cfg["bf16"] = {"enabled": True}
    # every read one element behind the last: in bounds, wrong values
    monkeypatch.setattr(grad_feeds, "padded_shard_numel", lambda param, world: max(1, param.numel() - 1))
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    engine = hf_zero.initialize(model, cfg)
    try:
        before = {k: v.float().clone() for k, v in gather_full_state_dict(engine).items()}
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        with pytest.raises(OffloadError, match="not laid out as hf_zero expects"):
            engine.step()
        after = gather_full_state_dict(engine)
        assert all(torch.equal(after[k].float(), v) for k, v in before.items())
    finally:
        engine.close()


# ---------------------------------------------------------------------------- pinned memory outside the optimizer
def _shard_bytes(model, world: int, itemsize: int | None = None, *, trainable: bool = False) -> int:
    """What FSDP2 pins for ``model``'s shards, from the model alone: each parameter's dim-0 shard
    (rows rounded up to a multiple of ``world``, divided by it) in ``itemsize`` bytes per element,
    one allocation each, rounded to a power of two by the host caching allocator."""
    total = 0
    for p in model.parameters():
        if trainable and not p.requires_grad:
            continue
        numel = -(-p.shape[0] // world) * (p.numel() // p.shape[0])
        total += 1 << (numel * (itemsize or p.element_size()) - 1).bit_length()
    return total


def test_planned_shard_bytes_count_fsdp2s_gradient_copies_and_the_stored_dtype():
    """Review N6: FSDP2's own pinned gradient shards are in the plan when it pins them; a frozen
    model's shards are planned in the dtype they are stored in (N5)."""
    from torch import nn

    from hf_zero.offload.param_offload import planned_shard_bytes

    model = nn.Sequential(nn.Linear(10, 6), nn.Linear(6, 5))  # weights 6x10, 5x6; biases 6, 5
    # world 2, fp32: shards of 3x10, 3, 3x6, 3 elements -> 120, 12, 72, 12 bytes -> 128+16+128+16
    assert planned_shard_bytes(model, 2) == 288 == _shard_bytes(model, 2)
    # + one gradient shard per trainable parameter, same sizes
    assert planned_shard_bytes(model, 2, gradients=True) == 576
    model[1].requires_grad_(False)
    assert planned_shard_bytes(model, 2, gradients=True) == 288 + 144
    # an offloaded optimizer casts the shards to bf16 after sharding: both copies, and the
    # gradients come in bf16 (60, 6 bytes -> 64, 8)
    model.requires_grad_(True)
    assert planned_shard_bytes(model, 2, 2) == 288 + 64 + 8 + 64 + 8
    assert planned_shard_bytes(model, 2, 2, gradients=True) == 288 + 2 * (64 + 8 + 64 + 8)
    # a frozen model stored in bf16: one bf16 copy, no gradient
    model.requires_grad_(False)
    assert planned_shard_bytes(model, 2, stored_itemsize=2, gradients=True) == 144 == _shard_bytes(model, 2, 2)


def test_fsdp2_pins_gradients_unless_hooked_on_a_torch_that_copies_hooked_ones_synchronously():
    """Whether FSDP2 pins gradient copies, against the installed torch's own code: it gates its
    non_blocking copy on post-accumulate-grad hooks (pytorch#180666) exactly when hf_zero says
    hooked gradients are not pinned."""
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from hf_zero.offload.param_offload import fsdp_pins_gradients

    gated = "_post_accumulate_grad_hooks" in inspect.getsource(_fsdp_collectives.foreach_reduce)
    assert fsdp_pins_gradients(grads_hooked=False)
    assert fsdp_pins_gradients(grads_hooked=True) == (not gated)


def _params_only_config(stage: int = 3) -> dict:
    return {"zero_optimization": {"stage": stage, "offload_param": {"device": "cpu", "pin_memory": True}},
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def test_parameter_offload_without_optimizer_offload_plans_fsdp2s_gradient_copies(monkeypatch, caplog):
    """Review N6: ``offload_param: cpu`` pinned, optimizer on the device: FSDP2 pins the shards and,
    every step, a gradient shard per parameter (``.to("cpu", non_blocking=True)``). With a headroom
    that holds the shards but not the gradients too, the shards stay pageable with a warning
    (they were pinned: the plan counted the shards only); training is the plain run's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with accel.use_runtime(NoAccelerator()):
        plain = _train(_params_only_config())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    shards = _shard_bytes(model, 1)
    # pinning_fits pins up to 90% of the headroom: room for 1.5 x the shards, not 2 x
    headroom = int(shards * 1.5 / pinned.SAFETY)
    monkeypatch.setattr(pinned, "host_headroom", lambda: (headroom, "the container's memory limit minus its usage"))
    with fake_accelerator() as fake, caplog.at_level(logging.WARNING, logger="hf_zero"):
        sizes = _recording(fake)
        got = _train(_params_only_config())
    assert sizes == [], f"pinned {sum(sizes)} bytes although shards and gradients ({2 * shards}) do not fit"
    assert "offload_param.pin_memory" in caplog.text and "pageable" in caplog.text, caplog.text
    assert got[0] == plain[0]
    for name, value in plain[1].items():
        assert torch.equal(got[1][name], value), name


@pytest.mark.parametrize("fits", [True, False])
def test_a_frozen_models_pinned_shards_are_planned(fits, monkeypatch, caplog):
    """Review N5: a frozen (reference) model with ``offload_param: cpu`` pinned its shards outside
    any plan. They are pinned when they fit the headroom (exactly the planned bytes: bf16, the
    dtype frozen shards are stored in) and stay pageable with a warning naming the model when
    they do not; its outputs are the model's either way."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {**_params_only_config(), "bf16": {"enabled": True}}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():  # the same model with bf16 parameters (buffers as they are), one rank
        for p in ref.parameters():
            p.data = p.data.to(torch.bfloat16)
        want = ref(input_ids=ids).logits.float()
    planned = _shard_bytes(model, 1, 2)  # world 1, bf16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    headroom = planned * 4 if fits else planned // 2
    monkeypatch.setattr(pinned, "host_headroom", lambda: (headroom, "the container's memory limit minus its usage"))
    with fake_accelerator() as fake, caplog.at_level(logging.WARNING, logger="hf_zero"):
        sizes = _recording(fake)
        frozen = hf_zero.prepare_frozen_model(model, cfg)
        with torch.no_grad():
            got = frozen(input_ids=ids).logits.float()
    if fits:
        assert sum(pow2_ceil(s) for s in sizes) == planned, (sizes, planned)
        assert "pin_memory" not in caplog.text
    else:
        assert sizes == []
        assert "offload_param.pin_memory" in caplog.text and "the frozen LlamaForCausalLM" in caplog.text, caplog.text
    torch.testing.assert_close(got, want, rtol=0, atol=0)
