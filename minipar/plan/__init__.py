"""The planner (issue 26): a GPT's shapes and parameter count (``GPTShape``, ``PRESETS``);
model-state bytes by kind under ZeRO, tp and pp (``model_state_bytes``); Megatron's activation
bytes per layer; FLOPs per iteration; each checked against its paper (docs/plan.md). Pure
Python, no MPI. The step time by kind and memory per GPU of a layout (``plan.time.predict``),
the GPU profiles (``plan.gpus``; this machine's, ``plan.hardware``), the layout search
(``plan.search``) and one real rank's model-state bytes (``plan.layout_bytes``) use the comm
and pipeline libraries, which load mpi4py: import them by module.

    from minipar.plan import PRESETS, flops_per_iteration, model_state_bytes
    gpt3 = PRESETS["gpt3-175b"].shape
    model_state_bytes(gpt3.parameters(), "bf16", zero=1, dp=64, tp=8, pp=8)
"""
from .flops import flops_per_iteration, training_seconds
from .memory import bytes_per_parameter, megatron_activation_bytes, model_state_bytes
from .models import PRESETS, GPTShape, Preset, preset

__all__ = ["GPTShape", "Preset", "PRESETS", "preset", "bytes_per_parameter",
           "model_state_bytes", "megatron_activation_bytes", "flops_per_iteration",
           "training_seconds"]
