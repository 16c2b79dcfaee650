"""The names the README, the lessons and users' scripts import keep working when code moves:
the packages export them, and the old module paths removed at 0.x stay removed."""
import importlib

import pytest

PUBLIC = {
    "minipar": "tensor Tensor no_grad manual_seed to_numpy concat embedding gather masked_fill "
               "split stack where",
    "minipar.nn": "GPT GPTConfig Block Linear LayerNorm Embedding Sequential Module",
    "minipar.optim": "SGD Adam AdamW",
    "minipar.amp": "autocast is_autocast_enabled get_autocast_dtype GradScaler",
    "minipar.checkpoint": "checkpoint checkpoint_sequential recomputing is_recomputing",
    "minipar.comm": "world Communicator Request ALGORITHMS OPS CommError chunk_bounds cuda_aware",
    "minipar.testing": "run_on_ranks serial_losses",
    "minipar.parallel.pipeline": "build validate simulate unit_cost bubble_theory Pipeline "
                                 "partition split_after makespan bubble_fraction text_gantt",
    "minipar.parallel.pipeline.actions": "Action Schedule F B W SENDS RECVS OPT_STEP",
    "minipar.parallel.tensor": "ColumnParallelLinear RowParallelLinear VocabParallelEmbedding "
                               "vocab_parallel_cross_entropy TensorParallelGPT shard_from_serial "
                               "gather_to_serial",
    "minipar.parallel.data": "DistributedDataParallel DistributedSampler local_batch_size ZeRO "
                             "ParameterServer busiest_link",
    "minipar.parallel.groups": "RankGrid ParallelGroups",
    "minipar.parallel.context": "ring_attention split_sequence gather_sequence RingLog",
    "minipar.parallel.hybrid": "Trainer3D",
    "minipar.backend": "device asarray xp to_numpy dtype is_floating finfo bfloat16 float16",
    "minipar.cli": "main build_parser SUBCOMMANDS",
}

# old paths removed at 0.x (issue 20): importing one fails, so nobody reads a shell module
REMOVED = ("minipar.comm.collectives", "minipar.parallel.sampler", "minipar.parallel.zero",
           "minipar.parallel.param_server", "minipar.parallel.tensor_gpt", "minipar.trace",
           "minipar.schedule_cli", "minipar.groups_cli", "minipar.lessons_index")


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_are_exported(module):
    loaded = importlib.import_module(module)
    missing = [name for name in PUBLIC[module].split() if not hasattr(loaded, name)]
    assert not missing, f"{module} lacks {missing}"


@pytest.mark.parametrize("old", REMOVED)
def test_old_module_paths_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
