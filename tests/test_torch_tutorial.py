"""PyTorch's tutorial "Writing Distributed Applications with PyTorch" on minipar's facade: its
programs as it writes them, with ``import torch.distributed as dist`` changed to
``import minipar.distributed as dist`` (the tensors stay torch's, on the CPU), on 2 and 4 ranks,
give torch's values. The synchronous SGD, the tutorial's own MNIST network, is checked against a
serial torch twin that averages the ranks' gradients. MNIST cannot be downloaded here (no network):
synthetic data of its shape (1 × 28 × 28 images, 10 classes) takes its place.
"""
import inspect
import math
import os
import time
import warnings
from random import Random

import pytest

from minipar.testing import run_on_ranks

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.optim as optim  # noqa: E402

import minipar.distributed as dist  # noqa: E402  (was: import torch.distributed as dist)


def init_process(rank, size, fn, backend="gloo"):
    """ Initialize the distributed environment. """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group(backend, rank=rank, world_size=size)
    return fn(rank, size)


# -- point-to-point --------------------------------------------------------------------------
def run_blocking(rank, size):
    """Blocking point-to-point communication."""
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        dist.send(tensor=tensor, dst=1)
    else:
        # Receive tensor from process 0
        dist.recv(tensor=tensor, src=0)
    print("Rank ", rank, " has data ", tensor[0])
    return tensor.tolist()


def run_nonblocking(rank, size):
    """Non-blocking point-to-point communication."""
    tensor = torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        req = dist.isend(tensor=tensor, dst=1)
        print("Rank 0 started sending")
    else:
        # Receive tensor from process 0
        req = dist.irecv(tensor=tensor, src=0)
        print("Rank 1 started receiving")
    req.wait()
    print("Rank ", rank, " has data ", tensor[0])
    return tensor.tolist()


def run_any_source(rank, size):
    """recv and irecv without src: the sender is whoever comes first (torch returns it)."""
    got = []
    if rank == 0:
        for _ in range(size - 1):
            tensor = torch.zeros(1)
            sender = dist.recv(tensor)
            got.append((sender, tensor.item()))
        tensor = torch.zeros(1)
        work = dist.irecv(tensor, tag=7)
        work.wait()
        got.append((work._source_rank(), tensor.item()))
    else:
        dist.send(torch.tensor([float(rank)]), dst=0)
        if rank == size - 1:
            dist.send(torch.tensor([float(rank)]), dst=0, tag=7)
    return sorted(got)


# -- collectives -----------------------------------------------------------------------------
def run_group_all_reduce(rank, size):
    """ Simple collective communication. """
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print("Rank ", rank, " has data ", tensor[0])
    return tensor.tolist()


def allreduce(send, recv):
    """ Implementation of a ring-reduce with addition. """
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = send.clone()
    recv_buff = send.clone()
    accum = send.clone()

    left = ((rank - 1) + size) % size
    right = (rank + 1) % size

    for i in range(size - 1):
        if i % 2 == 0:
            # Send send_buff
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            # Send recv_buff
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send_buff[:]
        send_req.wait()
    recv[:] = accum[:]


def run_ring(rank, size):
    send = torch.arange(5, dtype=torch.float32) * (rank + 1)
    recv = torch.zeros(5)
    allreduce(send, recv)
    return recv.tolist()


def run_collectives(rank, size):
    """Each collective the tutorial lists, on the group of every rank."""
    group = dist.new_group(list(range(size)))
    out = {}
    tensor = torch.tensor([float(rank)])
    dist.broadcast(tensor, 0, group)
    out["broadcast"] = tensor.tolist()
    weight = nn.Parameter(torch.full((2, 2), float(rank)))  # a model's weight, as DDP sends it
    dist.broadcast(weight, 0, group)
    out["broadcast_parameter"] = weight.tolist()
    tensor = torch.tensor([float(rank + 1)])
    dist.reduce(tensor, 0, dist.ReduceOp.SUM, group)
    out["reduce"] = tensor.tolist() if rank == 0 else None
    tensor = torch.tensor([float(rank + 1)])
    dist.all_reduce(tensor, dist.ReduceOp.PRODUCT, group)
    out["all_reduce"] = tensor.tolist()

    tensor = torch.empty(1)
    if rank == 0:
        scatter_list = [torch.tensor([i + 1], dtype=torch.float32) for i in range(size)]
        dist.scatter(tensor, scatter_list=scatter_list, src=0, group=group)
    else:
        dist.scatter(tensor, scatter_list=[], src=0, group=group)
    out["scatter"] = tensor.tolist()

    tensor = torch.tensor([float(rank * 10)])
    if rank == 0:
        gather_list = [torch.zeros(1) for _ in range(size)]
        dist.gather(tensor, gather_list, dst=0, group=group)
        out["gather"] = [t.item() for t in gather_list]
    else:
        dist.gather(tensor, [], dst=0, group=group)

    tensor = torch.tensor([float(rank * 10)])
    gather_list = [torch.zeros(1) for _ in range(size)]
    dist.all_gather(gather_list, tensor, group=group)
    out["all_gather"] = [t.item() for t in gather_list]
    dist.barrier(group)

    inputs = list((torch.arange(size) + rank * size).chunk(size))
    output = list(torch.empty([size], dtype=torch.int64).chunk(size))
    dist.all_to_all(output, inputs, group=group)
    out["all_to_all"] = [t.tolist() for t in output]

    # uneven splits: j + 1 rows to rank j, so rank r gets r + 1 rows from each rank
    rows = sum(range(1, size + 1))
    single_in = (torch.arange(rows * 2).reshape(rows, 2) + 100 * rank).to(torch.float64)
    single_out = torch.zeros((size * (rank + 1), 2), dtype=torch.float64)
    dist.all_to_all_single(single_out, single_in, [rank + 1] * size,
                           [j + 1 for j in range(size)], group=group)
    out["all_to_all_single"] = single_out.tolist()
    return out


def run_objects(rank, size):
    out = {}
    gathered = [None] * size
    dist.all_gather_object(gathered, {"rank": rank, "name": f"r{rank}"})
    out["all_gather_object"] = gathered
    objects = ["foo", 12, {"key": "value"}] if rank == 0 else [None, None, None]
    dist.broadcast_object_list(objects, src=0)
    out["broadcast_object_list"] = objects
    gathered = [None] * size if rank == 0 else None
    dist.gather_object(("from", rank), gathered, dst=0)
    out["gather_object"] = gathered
    output = [None]
    dist.scatter_object_list(output, [{"to": r} for r in range(size)] if rank == 0 else None,
                             src=0)
    out["scatter_object_list"] = output
    return out


def run_batch_isend_irecv(rank, size):
    send_tensor = torch.arange(2, dtype=torch.float32) + 2 * rank
    recv_tensor = torch.randn(2, dtype=torch.float32)
    send_op = dist.P2POp(dist.isend, send_tensor, (rank + 1) % size)
    recv_op = dist.P2POp(dist.irecv, recv_tensor, (rank - 1 + size) % size)
    reqs = dist.batch_isend_irecv([send_op, recv_op])
    for req in reqs:
        req.wait()
    return recv_tensor.tolist()


# -- synchronous SGD -------------------------------------------------------------------------
class Partition(object):
    """ Dataset-like object, but only access a subset of it. """

    def __init__(self, data, index):
        self.data = data
        self.index = index

    def __len__(self):
        return len(self.index)

    def __getitem__(self, index):
        data_idx = self.index[index]
        return self.data[data_idx]


class DataPartitioner(object):
    """ Partitions a dataset into different chuncks. """

    def __init__(self, data, sizes=[0.7, 0.2, 0.1], seed=1234):
        self.data = data
        self.partitions = []
        rng = Random()
        rng.seed(seed)
        data_len = len(data)
        indexes = [x for x in range(0, data_len)]
        rng.shuffle(indexes)

        for frac in sizes:
            part_len = int(frac * data_len)
            self.partitions.append(indexes[0:part_len])
            indexes = indexes[part_len:]

    def use(self, partition):
        return Partition(self.data, self.partitions[partition])


class Net(nn.Module):
    """ Network architecture. """

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x)


def dataset():
    """MNIST's place (it cannot be downloaded here): 256 normalised 1 × 28 × 28 images, 10
    classes, as datasets.MNIST with ToTensor and Normalize gives them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (256,), generator=g)
    return [(x[i], y[i]) for i in range(256)]


def partition_dataset(rank=None, size=None):
    """ Partitioning MNIST """
    size = dist.get_world_size() if size is None else size
    rank = dist.get_rank() if rank is None else rank
    bsz = 128 // size
    partition_sizes = [1.0 / size for _ in range(size)]
    partition = DataPartitioner(dataset(), partition_sizes)
    partition = partition.use(rank)
    train_set = torch.utils.data.DataLoader(partition, batch_size=bsz, shuffle=True)
    return train_set, bsz


def average_gradients(model):
    """ Gradient averaging. """
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


EPOCHS = 3


def run_sgd(rank, size):
    """ Distributed Synchronous SGD Example """
    torch.manual_seed(1234)
    train_set, bsz = partition_dataset()
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.5)

    num_batches = math.ceil(len(train_set.dataset) / float(bsz))
    losses = []
    for epoch in range(EPOCHS):
        epoch_loss = 0.0
        for data, target in train_set:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            epoch_loss += loss.item()
            loss.backward()
            average_gradients(model)
            optimizer.step()
        print("Rank ", dist.get_rank(), ", epoch ", epoch, ": ", epoch_loss / num_batches)
        losses.append(epoch_loss / num_batches)
    return {"params": [p.detach().tolist() for p in model.parameters()], "losses": losses}


def serial_sgd(size):
    """The serial twin: each rank's batches (the same seeds, so the same shuffles), one model,
    the gradient of each step the mean of the ranks' gradients, as average_gradients makes it.
    Each rank's loader and dropout masks draw from that rank's torch generator, so the twin keeps
    one generator state per rank and runs each rank's draws in it, in the rank's order."""
    loaders, states = [], []
    for rank in range(size):
        torch.manual_seed(1234)
        train_set, _ = partition_dataset(rank, size)
        Net()  # the rank's model draws from the same generator before its loader shuffles
        loaders.append(train_set)
        states.append(torch.get_rng_state())

    def as_rank(rank, work):
        torch.set_rng_state(states[rank])
        result = work()
        states[rank] = torch.get_rng_state()
        return result

    torch.manual_seed(1234)
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    losses = [[0.0] * EPOCHS for _ in range(size)]  # each rank prints its own batches' mean
    for epoch in range(EPOCHS):
        # a loader draws its shuffle when its iteration starts, before the epoch's first forward
        batches = [as_rank(rank, lambda: list(loaders[rank])) for rank in range(size)]
        steps = len(batches[0])
        for step in range(steps):
            optimizer.zero_grad()
            for rank in range(size):
                data, target = batches[rank][step]
                loss = F.nll_loss(as_rank(rank, lambda: model(data)), target)
                losses[rank][epoch] += loss.item() / steps
                (loss / size).backward()
            optimizer.step()
    return [p.detach().tolist() for p in model.parameters()], losses


def start():
    """The tutorial's MPI start (rank and size 0, ignored): the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        init_process(0, 0, lambda rank, size: None, backend="mpi")
    return [str(w.message) for w in caught]


def run_programs(programs, late=()):
    """{name: program(rank, size)} of each program in turn on this rank; the ranks in ``late``
    start each one a second after the others (the order a loaded machine may give)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, program in programs:
        if rank in late:
            time.sleep(1.0)
        out[name] = program(rank, size)
        # the tutorial launches each program on its own; here they share one launch, so the
        # ranks meet between them: else a rank done early sends the next program's tag-0
        # messages while rank 0 still receives run_any_source's from any rank, and takes them
        dist.barrier()
    return out


PROGRAMS = (("any_source", run_any_source), ("group_all_reduce", run_group_all_reduce),
            ("ring", run_ring), ("collectives", run_collectives), ("objects", run_objects),
            ("batch", run_batch_isend_irecv), ("sgd", run_sgd))


def tutorial_body():
    """Every program on this rank, after the tutorial's MPI start."""
    out = {"warning": start()}
    if dist.get_world_size() == 2:  # the tutorial's point-to-point programs are for two processes
        out.update(run_programs((("blocking", run_blocking), ("nonblocking", run_nonblocking))))
    out.update(run_programs(PROGRAMS))
    dist.destroy_process_group()
    return out


def late_body():
    """run_any_source, then the ring, with ranks 1 and 2 late to both."""
    start()
    out = run_programs((("any_source", run_any_source), ("ring", run_ring)), late=(1, 2))
    dist.destroy_process_group()
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("size", [2, 4])
def test_the_tutorial_runs_with_only_the_import_changed(size):
    results = run_on_ranks(tutorial_body, size, timeout=240)
    for rank, got in enumerate(results):
        assert got["warning"] == [f"init_process_group: for the MPI backend, world_size and rank "
                                  f"are assigned by the MPI launch: world_size=0 ignored, the "
                                  f"launch says {size}" + ("" if rank == 0 else
                                                           f", rank=0 ignored, the launch says "
                                                           f"{rank}")]
        if size == 2:
            assert got["blocking"] == got["nonblocking"] == [1.0]
        # results come back as JSON: tuples read as lists
        senders = [[r, float(r)] for r in range(1, size)] + [[size - 1, size - 1.0]]
        assert got["any_source"] == (senders if rank == 0 else [])
        assert got["group_all_reduce"] == ([2.0] if rank < 2 else [1.0])
        assert got["ring"] == [i * size * (size + 1) / 2 for i in range(5)]
        c = got["collectives"]
        assert c["broadcast"] == [0.0]
        assert c["broadcast_parameter"] == [[0.0, 0.0], [0.0, 0.0]]
        assert c["reduce"] == ([size * (size + 1) / 2] if rank == 0 else None)
        assert c["all_reduce"] == [float(math.factorial(size))]
        assert c["scatter"] == [rank + 1.0]
        if rank == 0:
            assert c["gather"] == [10.0 * r for r in range(size)]
        assert c["all_gather"] == [10.0 * r for r in range(size)]
        assert c["all_to_all"] == [[rank + j * size] for j in range(size)]
        start = sum(range(1, rank + 1))  # where rank's rows begin in every sender's input
        assert c["all_to_all_single"] == [[2.0 * i + 100 * j, 2.0 * i + 1 + 100 * j]
                                          for j in range(size)
                                          for i in range(start, start + rank + 1)]
        o = got["objects"]
        assert o["all_gather_object"] == [{"rank": r, "name": f"r{r}"} for r in range(size)]
        assert o["broadcast_object_list"] == ["foo", 12, {"key": "value"}]
        assert o["gather_object"] == ([["from", r] for r in range(size)] if rank == 0 else None)
        assert o["scatter_object_list"] == [{"to": rank}]
        left = (rank - 1 + size) % size
        assert got["batch"] == [2.0 * left, 2.0 * left + 1]
    params, losses = serial_sgd(size)
    for rank, got in enumerate(results):
        for p, w in zip(got["sgd"]["params"], params):
            assert torch.allclose(torch.tensor(p), torch.tensor(w), atol=1e-6), rank
        assert got["sgd"]["losses"] == pytest.approx(losses[rank], abs=1e-6)


@pytest.mark.mpi
def test_a_rank_late_to_receive_from_any_rank_gets_only_that_programs_messages():
    """Rank 0 receives run_any_source's messages from whichever rank sends first; ranks 1 and 2
    send theirs late, and rank 3, done, starts the ring, whose first message to rank 0 (tag 0,
    20 bytes) arrives before theirs. Once, under load in CI, rank 0 took it: "message from rank
    3 is larger than the 4-byte receive buffer". Each program's messages stay in it."""
    size = 4
    for rank, got in enumerate(run_on_ranks(late_body, size, timeout=120)):
        senders = [[r, float(r)] for r in range(1, size)] + [[size - 1, size - 1.0]]
        assert got["any_source"] == (senders if rank == 0 else [])
        assert got["ring"] == [i * size * (size + 1) / 2 for i in range(5)]


def test_the_tutorial_network_runs_on_minipar_layers():
    """The same Net, its source run with ``import minipar.nn as nn`` and ``import
    minipar.functional as F``: Dropout2d and the rest are minipar's. In eval mode its loss and
    gradients equal torch's Net with the same weights (float64); in training its dropouts drop."""
    import numpy as np

    import minipar
    import minipar.functional
    import minipar.nn

    namespace = {"nn": minipar.nn, "F": minipar.functional}
    exec(inspect.getsource(Net), namespace)  # the class text above, minipar's imports
    ours, theirs = namespace["Net"]().double(), Net().double()
    theirs.load_state_dict({name: torch.tensor(minipar.to_numpy(value))
                            for name, value in ours.state_dict().items()})
    images, labels = zip(*dataset()[:16])
    x, t = torch.stack(images).double(), torch.stack(labels)
    for model in (ours, theirs):
        model.eval()
    output = ours(minipar.tensor(x.numpy()))
    loss = minipar.functional.nll_loss(output, t.numpy())
    loss_t = F.nll_loss(theirs(x), t)
    loss.backward()
    loss_t.backward()
    assert loss.item() == pytest.approx(loss_t.item(), abs=1e-12)
    for (name, p), p_t in zip(ours.named_parameters(), theirs.parameters()):
        np.testing.assert_allclose(minipar.to_numpy(p.grad), p_t.grad.numpy(), atol=1e-12,
                                   err_msg=name)
    ours.train()
    assert not np.allclose(ours(minipar.tensor(x.numpy())).numpy(), output.numpy())
