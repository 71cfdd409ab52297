"""Jitted steps under torch.distributed (issue 7): 2 processes, gloo, loopback only."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

DEMOS = str(Path(__file__).resolve().parent.parent / "demos")
WORLD, UNROLL, BATCH, ITERATIONS = 2, 2, 4, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, out: str) -> None:
    sys.path.insert(0, DEMOS)
    import learned_correction as demo

    import phi_torch_jit as ptj

    # the default engine with aot_eager: a spawned process knows no test-only engine
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PHI_TORCH_JIT_ENGINE="auto:aot_eager"
    )
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        u0, targets, k = demo.training_data(8, UNROLL, BATCH, seed=0)
        share = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        torch.manual_seed(0)
        net = demo.Source()
        trainer = demo.Trainer(net, UNROLL)
        model = DistributedDataParallel(trainer)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(ITERATIONS):
            optimizer.zero_grad()
            model(u0[share], targets[:, share], k).backward()
            optimizer.step()
        # the unsupported pattern: DDP called inside the jitted function (traced once the
        # background compile of the trainer's loss is done: a first call meanwhile runs eagerly)
        trainer.loss.wait_compiled()
        inner = demo.make_corrected_step(DistributedDataParallel(net))
        unsupported = ptj.jit(demo.make_unrolled_loss(inner, UNROLL), engine="auto")
        try:
            unsupported(u0[share], targets[:, share], k)
            error = ""
        except ptj.TraceError as raised:
            error = str(raised)
        result = {
            "params": [p.detach() for p in net.parameters()],
            "traces": trainer.loss.num_traces,
            "error": error,
        }
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _single_process_reference() -> list[torch.Tensor]:
    sys.path.insert(0, DEMOS)
    import learned_correction as demo

    u0, targets, k = demo.training_data(8, UNROLL, BATCH, seed=0)
    torch.manual_seed(0)
    net = demo.Source()
    loss = demo.make_unrolled_loss(demo.make_corrected_step(net), UNROLL)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(ITERATIONS):
        optimizer.zero_grad()
        loss(u0, targets, k).backward()
        optimizer.step()
    return [p.detach() for p in net.parameters()]


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_two_ranks_train_like_one_process_on_the_combined_batch(tmp_path: Path) -> None:
    context = mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.terminate()
            pytest.fail("distributed workers did not finish within 120 s")
    results: list[dict[str, Any]] = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)  # identical on both ranks
    for got, want in zip(results[0]["params"], _single_process_reference()):
        assert torch.allclose(got, want, atol=1e-6)  # gradients averaged as on one batch
    assert [r["traces"] for r in results] == [1, 1]  # compiled once per rank
    for r in results:  # the unsupported pattern is refused, not silently wrong
        assert "calls a DistributedDataParallel module" in r["error"]


def test_data_parallel_inside_a_jitted_function_is_refused() -> None:
    import phi_torch_jit as ptj

    wrapped = nn.DataParallel(nn.Linear(2, 2))
    with pytest.raises(ptj.TraceError, match=r"calls a DataParallel module.*docs/distributed\.md"):
        ptj.jit(lambda x: wrapped(x))(torch.ones(1, 2))


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_demo_trains_under_torchrun_with_two_processes(tmp_path: Path) -> None:
    import subprocess

    demo = str(Path(DEMOS) / "learned_correction.py")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        demo, "--size", "8", "--iters", "2", "--batch", "2", "--unroll", "2",
    ]  # fmt: skip
    # the default engine, compiling with aot_eager (the processes know no test-only engine)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PHI_TORCH_JIT_ENGINE": "auto:aot_eager"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    # a rank's own error (an abort: "terminate called ...") comes before torchrun's report
    words = ("terminate", "what()", "Error", "Abort", "Fatal")
    said = [line for line in done.stderr.splitlines() if any(w in line for w in words)]
    assert done.returncode == 0, "\n".join(said[:20]) + "\n" + done.stderr[-1500:]
    assert "2 ranks x 2 ICs" in done.stdout and "iterations per second (2 processes)" in done.stdout
