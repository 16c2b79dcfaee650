"""The planner (issue 26), so far its formulas, each checked against its paper
(tests/test_plan_papers.py; docs/plan.md): a GPT's shapes and parameter count (``GPTShape``,
named ``PRESETS``); model-state bytes per device by kind under ZeRO, tp and pp, from the
optimizer's own rule (``model_state_bytes``); Megatron's activation bytes per layer
(``megatron_activation_bytes``); FLOPs per iteration and the Megatron-LM paper's training-time
estimate (``flops_per_iteration``, ``training_seconds``). Not yet: the step time, the layout
search, the ``minipar plan`` command. Pure Python, no MPI.

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
