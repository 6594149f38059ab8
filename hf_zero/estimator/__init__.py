"""Memory estimator: bytes per GPU, per node of host RAM and per node of NVMe for ZeRO stages 0-3.

Pure arithmetic on named constants (``constants.py``: the numbers; ``terms.py``: the formulas;
``memory.py``: every configuration of ``choices.py`` added up); a model is read from its config on
the meta device, never from its weights (``model_spec.py``). With activations off it reproduces the
ZeRO paper's model-state formulas exactly.

Example:
    >>> from hf_zero.estimator import estimate_memory
    >>> rows = estimate_memory("7.5e9", num_gpus=64, include_activations=False)
    >>> rows[3]
    {'stage': 3, 'offload_optimizer': 'none', 'offload_param': 'none', 'gpu_bytes': 1875000000, 'cpu_bytes': 0, 'nvme_bytes': 0, 'fits': True}
"""

from hf_zero.estimator.calibration import MeasuredMemory, MeasurementComparison, compare_with_measurement
from hf_zero.estimator.errors import EstimatorError
from hf_zero.estimator.choices import PRECISIONS, SPEED_ORDER, Precision, ZeroChoice, is_valid_choice
from hf_zero.estimator import constants
from hf_zero.estimator.constants import *  # noqa: F403 - every named constant (constants.__all__)
from hf_zero.estimator.memory import Estimate, Row, estimate, estimate_memory
from hf_zero.estimator.terms import (
    ActivationEstimate,
    Breakdown,
    activation_bytes,
    implementation_terms,
    model_state_bytes,
    working_buffer_bytes,
)
from hf_zero.estimator.model_spec import (
    ALL_LINEAR,
    LinearLayer,
    ModelSpec,
    closed_form_spec,
    load_model_spec,
    lora_param_count,
    lora_target_layers,
)
from hf_zero.estimator.report import DEFAULT_NVME_PATH, nothing_fits_message, render_report, zero_config_for
from hf_zero.estimator.units import format_bytes, format_count, parse_memory_size, parse_param_count

__all__ = [
    *constants.__all__,
    "ALL_LINEAR",
    "DEFAULT_NVME_PATH",
    "PRECISIONS",
    "SPEED_ORDER",
    "ActivationEstimate",
    "Breakdown",
    "Estimate",
    "EstimatorError",
    "LinearLayer",
    "MeasuredMemory",
    "MeasurementComparison",
    "ModelSpec",
    "Precision",
    "Row",
    "ZeroChoice",
    "activation_bytes",
    "closed_form_spec",
    "compare_with_measurement",
    "estimate",
    "estimate_memory",
    "format_bytes",
    "format_count",
    "implementation_terms",
    "is_valid_choice",
    "load_model_spec",
    "lora_param_count",
    "lora_target_layers",
    "model_state_bytes",
    "nothing_fits_message",
    "parse_memory_size",
    "parse_param_count",
    "render_report",
    "working_buffer_bytes",
    "zero_config_for",
]
