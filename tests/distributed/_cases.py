"""Test cases: which stage/precision/accumulation/model to run, and the hf_zero config for each."""

from __future__ import annotations

from dataclasses import asdict, dataclass

LR = 5e-3


@dataclass(frozen=True)
class Case:
    stage: int
    dtype: str  # fp32 | bf16 | fp16
    gas: int
    model: str  # qwen2_tied | llama | qwen2_moe
    steps: int = 4
    micro: int = 2
    seq: int = 16
    clip: float = 1.0
    scheduler: bool = True
    mics: int = -1  # zero_optimization.mics_shard_size (-1: off)
    hpz: int = 1  # zero_optimization.zero_hpz_partition_size (1: off)

    @property
    def name(self) -> str:
        extra = (f"-mics{self.mics}" if self.mics > 0 else "") + (f"-hpz{self.hpz}" if self.hpz > 1 else "")
        return f"s{self.stage}-{self.dtype}-gas{self.gas}-{self.model}{extra}"

    def to_dict(self) -> dict:
        return asdict(self)

    def zero_config(self) -> dict:
        cfg = {
            "train_micro_batch_size_per_gpu": self.micro,
            "gradient_accumulation_steps": self.gas,
            "gradient_clipping": self.clip,
            "zero_optimization": {"stage": self.stage, **({"mics_shard_size": self.mics} if self.mics > 0 else {}),
                                  **({"zero_hpz_partition_size": self.hpz} if self.hpz > 1 else {})},
            "bf16": {"enabled": self.dtype == "bf16"},
            "fp16": {"enabled": self.dtype == "fp16", "initial_scale_power": 8},
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
            },
        }
        if self.scheduler:
            cfg["scheduler"] = {
                "type": "WarmupDecayLR",
                "params": {
                    "warmup_min_lr": 0.0,
                    "warmup_max_lr": LR,
                    "warmup_num_steps": 2,
                    "total_num_steps": self.steps + 2,
                    "warmup_type": "linear",
                },
            }
        return cfg


def parity_cases() -> list[Case]:
    """Every stage in fp32 and bf16 with accumulation 1 and 2, fp16 at stages 2 and 3, MoE at
    stage 3; tied and untied embeddings alternate so each stage sees both."""
    cases = []
    for stage in range(4):
        for i, (dtype, gas) in enumerate([("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2)]):
            cases.append(Case(stage=stage, dtype=dtype, gas=gas, model="qwen2_tied" if (i + stage) % 2 else "llama"))
    cases.append(Case(stage=2, dtype="fp16", gas=2, model="qwen2_tied"))
    cases.append(Case(stage=3, dtype="fp16", gas=1, model="llama"))
    # MoE blocks (routing is per token, so splitting the batch over ranks changes nothing).
    cases.append(Case(stage=3, dtype="fp32", gas=2, model="qwen2_moe"))
    return cases
