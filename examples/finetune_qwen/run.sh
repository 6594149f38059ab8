#!/usr/bin/env bash
# The launch script of the openMind DeepSpeed guide (source 000: Qwen1.5-7B-Chat, full fine-tune,
# 8 NPUs/GPUs), with `hf-zero run` in place of `torchrun`: same output folder handling, same flags
# (--bf16, cosine schedule, --warmup_ratio, --evaluation_strategy "no" ...), no DeepSpeed install.
#
#   bash examples/finetune_qwen/run.sh                  # the guide's run (set MODEL, DATA, NPROC for yours)
#   CPU_DEMO=1 bash examples/finetune_qwen/run.sh       # the bundled tiny model on a CPU, about a minute
#
# CPU_DEMO=1 picks CPU-friendly values: assets/tiny-qwen2 and assets/data/alpaca_tiny.json, 2
# processes, 20 steps, a checkpoint every 10 steps, learning rate 1e-3 (the tiny model's weights are
# random), and --bf16 only when a GPU is present (on a CPU-only machine transformers refuses bf16).
# Every value can be set from the environment: MODEL, DATA, DS_CONFIG, OUTPUT_DIR, NPROC,
# MASTER_PORT, MAX_STEPS, SAVE_STEPS, LR, BF16. Extra arguments are passed on to finetune.py, e.g.
#   bash examples/finetune_qwen/run.sh --gradient_accumulation_steps 4
# DS_CONFIG is one of the guide's configs next to this script: ds_config_zero1.json, ds_config_zero2.json,
# ds_config_zero3.json (the default) or ds_config_zero3_offload.json.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"

if [ "${CPU_DEMO:-0}" = "1" ]; then
    : "${MODEL:=$REPO/assets/tiny-qwen2}"
    : "${DATA:=$REPO/assets/data/alpaca_tiny.json}"
    : "${NPROC:=2}"
    : "${MAX_STEPS:=20}"
    : "${SAVE_STEPS:=10}"
    : "${LR:=1e-3}"
    if [ -z "${BF16:-}" ]; then
        # bf16 needs an accelerator here; plain transformers stops at --bf16 on a CPU-only machine.
        if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
            BF16=True
        else
            BF16=False
        fi
    fi
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
: "${MODEL:=PyTorch-NPU/qwen1.5_7b_chat}"
: "${DATA:=alpaca_data.json}"
: "${DS_CONFIG:=$HERE/ds_config_zero3.json}"
: "${OUTPUT_DIR:=./test/output}"
: "${NPROC:=8}"
: "${MASTER_PORT:=29500}"
: "${MAX_STEPS:=2000}"
: "${SAVE_STEPS:=3000}"
: "${LR:=1e-6}"
: "${BF16:=True}"

# The guide's output folder handling: start from an empty folder.
if [ -d "$OUTPUT_DIR" ]; then
    rm -rf "$OUTPUT_DIR"
    mkdir -p "$OUTPUT_DIR"
else
    mkdir -p "$OUTPUT_DIR"
fi

# The guide starts this in the background (`> $OUTPUT_DIR/train.log 2>&1 &`); here it runs in the
# foreground and the log goes to the terminal and to train.log (use nohup ... & for a long run).
# master_port: set it for your machine (MASTER_PORT).
hf-zero run --nproc_per_node="$NPROC" --master_port="$MASTER_PORT" "$HERE/finetune.py" \
    --model_name_or_path "$MODEL" \
    --data_path "$DATA" \
    --deepspeed "$DS_CONFIG" \
    --bf16 "$BF16" \
    --output_dir "$OUTPUT_DIR" \
    --max_steps "$MAX_STEPS" \
    --per_device_train_batch_size 1 \
    --evaluation_strategy "no" \
    --save_strategy "steps" \
    --save_steps "$SAVE_STEPS" \
    --save_total_limit 1 \
    --learning_rate "$LR" \
    --weight_decay 0. \
    --warmup_ratio 0.03 \
    --lr_scheduler_type "cosine" \
    --seed 1234 \
    --logging_steps 1 \
    "$@" 2>&1 | tee "$OUTPUT_DIR/train.log"
