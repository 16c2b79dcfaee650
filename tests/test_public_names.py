"""The names the README, the lessons and users' scripts import keep working when code moves:
the new homes export them, and every old module path still gives the very same objects."""
import importlib

import pytest

PUBLIC = {
    "minipar": "tensor Tensor no_grad manual_seed to_numpy concat embedding gather masked_fill "
               "split stack where",
    "minipar.nn": "GPT GPTConfig Block Linear LayerNorm Embedding Sequential Module",
    "minipar.optim": "SGD Adam AdamW",
    "minipar.checkpoint": "checkpoint checkpoint_sequential recomputing is_recomputing",
    "minipar.comm": "world Communicator Request ALGORITHMS OPS CommError chunk_bounds cuda_aware",
    "minipar.testing": "run_on_ranks serial_losses",
    "minipar.parallel.pipeline": "build validate simulate unit_cost bubble_theory Pipeline "
                                 "partition split_after makespan bubble_fraction text_gantt",
    "minipar.parallel.pipeline.schedules": "Action Schedule F B W SENDS RECVS OPT_STEP",
    "minipar.parallel.tensor": "ColumnParallelLinear RowParallelLinear VocabParallelEmbedding "
                               "vocab_parallel_cross_entropy TensorParallelGPT shard_from_serial "
                               "gather_to_serial",
    "minipar.parallel.data": "DistributedDataParallel DistributedSampler local_batch_size ZeRO "
                             "ParameterServer busiest_link",
    "minipar.parallel.groups": "RankGrid ParallelGroups",
    "minipar.parallel.hybrid": "Trainer3D ParallelGroups",
    "minipar.backend": "device asarray xp to_numpy",
    "minipar.cli": "main build_parser SUBCOMMANDS",
}

OLD_PATHS = {  # old module -> (new module, names that must be the same objects)
    "minipar.parallel.sampler": ("minipar.parallel.data", "DistributedSampler local_batch_size"),
    "minipar.parallel.zero": ("minipar.parallel.data", "ZeRO"),
    "minipar.parallel.param_server": ("minipar.parallel.data", "ParameterServer busiest_link"),
    "minipar.parallel.tensor_gpt": ("minipar.parallel.tensor",
                                    "TensorParallelGPT shard_from_serial gather_to_serial"),
    "minipar.trace": ("minipar.parallel.pipeline",
                      "Event Tracer makespan bubble_fraction peak_inflight text_gantt"),
    "minipar.schedule_cli": ("minipar.cli.schedule", "add_arguments run"),
    "minipar.groups_cli": ("minipar.cli.groups", "add_arguments run"),
    "minipar.lessons_index": ("minipar.cli.lessons", "add_arguments run"),
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_are_exported(module):
    loaded = importlib.import_module(module)
    missing = [name for name in PUBLIC[module].split() if not hasattr(loaded, name)]
    assert not missing, f"{module} lacks {missing}"


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_module_paths_give_the_same_objects(old):
    new, names = OLD_PATHS[old]
    before, after = importlib.import_module(old), importlib.import_module(new)
    differ = [n for n in names.split() if getattr(before, n, None) is not getattr(after, n)]
    assert not differ, f"{old}: {differ} are not {new}'s"
