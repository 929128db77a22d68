"""The same code on a CUDA GPU (marked `cuda`; skipped, with the reason, where there is none):
the LoRDO step, reference and batched, equals the reference's CPU run to fp32 rounding, bf16-autocast training lowers the loss, and
a worker + aggregator round on the GPU matches the CPU one within bf16 tolerance, and a one-rank
node through either intra-node wrapper (DDP or FSDP2, over NCCL) equals the bare worker.

`benchmarks/gpu_check.py` runs these on a GPU machine (`pytest -m cuda`). To check the tests
themselves without a GPU, `LORDO_FED_TEST_GPU=cpu pytest tests/gpu/test_cuda.py` runs them with the
CPU standing in for the GPU (every comparison then holds exactly or nearly so)."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

from lordo_fed.data import TokenShard
from lordo_fed.rounds.methods import lowrank_ranks, make_aggregator, make_worker, resolve_method
from lordo_fed.model import DEFAULT_LOWRANK_PATTERN, ModelConfig, build_model, lowrank_parameter_names
from lordo_fed.optim import BatchedLoRDO, LoRDO
from lordo_fed.optim.config import InnerConfig
from lordo_fed.rounds.outer import OuterConfig
from lordo_fed.optim.projection import get_projection_method, projection_side
from lordo_fed.rounds.config import RoundConfig

GPU = os.environ.get("LORDO_FED_TEST_GPU", "cuda")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(GPU.startswith("cuda") and not torch.cuda.is_available(),
                       reason="needs a CUDA GPU: benchmarks/gpu_check.py runs these on a GPU machine"),
]
VOCAB, BATCH, SEQ, RANK = 256, 4, 32, 8


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(preset="tiny"), VOCAB)


def shard() -> TokenShard:
    """A learnable stream (a period-17 pattern with noise): the loss can fall well below ln 256."""
    rng = np.random.default_rng(0)
    tokens = (np.arange(16384) % 17) * 7 + 32
    noise = rng.random(16384) < 0.1
    tokens[noise] = rng.integers(0, VOCAB, size=int(noise.sum()))
    return TokenShard(tokens, shard_id=0)


OPTIONS = [
    dict(),  # the paper: global basis, fp32 EF, QH outside, svd
    dict(ef_dtype="bf16"),
    dict(qh_placement="inside"),
    dict(error_feedback=False, omega=1.0),
    dict(ef_decay=0.9, full_rank_term="gradient"),
    dict(proj_method="rsvd"),
    dict(proj_method="dct"),
    dict(projection_source="local", proj_interval=3),
    dict(ef_density=0.1),  # the compressed buffer (top-k, int8)
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "paper")
def test_lordo_step_on_the_gpu_equals_the_cpu_step(options):
    """Eight steps on the same gradients from the same state: the reference LoRDO and the batched
    step on the GPU both agree with the reference on the CPU to fp32 rounding (relative 1e-4);
    under a global source every side gets the same stored projection."""
    torch.manual_seed(0)
    shapes = [(48, 32), (48, 32), (32, 80), (16,)]  # two of a shape: a stack of two on the batched side
    params = {"cpu": [torch.randn(s) for s in shapes]}
    params["gpu"] = [p.clone().to(GPU) for p in params["cpu"]]
    params["gpu batched"] = [p.clone().to(GPU) for p in params["cpu"]]
    kwargs = {"lr": 1e-2, "omega": 0.9, "weight_decay": 0.01, **options}
    opts = {side: (BatchedLoRDO if "batched" in side else LoRDO)(
        [{"params": ps[:3], "rank": RANK}, {"params": ps[3:]}], **kwargs) for side, ps in params.items()}
    if options.get("projection_source", "global") == "global":
        method = get_projection_method(options.get("proj_method", "svd"))
        for i, p in enumerate(params["cpu"][:3]):
            stored = method.fit(torch.randn(p.shape), RANK, projection_side(p.shape), seed=i)
            for side, ps in params.items():
                opts[side].set_projection(ps[i], stored.to(ps[i].device))
    for step in range(8):
        grads = [torch.randn(s) for s in shapes]
        for side, ps in params.items():
            for p, g in zip(ps, grads):
                p.grad = g.to(p.device)
            opts[side].step()
    for side in ("gpu", "gpu batched"):
        for cpu, gpu in zip(params["cpu"], params[side]):
            torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-5, msg=lambda m: f"{side}: {m}")


def _worker_and_aggregator(device: str, method: str = "lordo_global", ranks=None):
    inner = InnerConfig(rank=RANK)
    settings = resolve_method(method, inner, RoundConfig(local_steps=8), OuterConfig(), total_steps=64)
    model = tiny_model(0).to(device)
    lowrank = lowrank_parameter_names(model)
    node_ranks, ranks = ranks, lowrank_ranks(model, DEFAULT_LOWRANK_PATTERN, RANK, settings.inner.name)
    aggregator = make_aggregator(model, settings, ranks, seed=0)  # first: FSDP2 shards the worker's model
    worker = make_worker(0, model, settings, shard(), lowrank, 200, BATCH, SEQ, seed=0, ranks=node_ranks)
    aggregator.init_projections([worker.gradient(aggregator.gradient_request(), sorted(ranks))])
    return worker, aggregator


def test_bf16_autocast_training_lowers_the_loss_on_the_gpu():
    worker, aggregator = _worker_and_aggregator(GPU)
    losses = []
    for _ in range(6):
        update = worker.train_round(copy.deepcopy(aggregator.global_state()))
        losses.append(update.metrics["train_loss"])
        aggregator.aggregate([update])
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.3, losses


def test_a_worker_and_aggregator_round_on_the_gpu_matches_the_cpu():
    """Two rounds each way from the same θ0 and data: the GPU's pseudo-gradients point the same
    way as the CPU's (cosine > 0.98, norms within 5%: bf16 autocast on the GPU, fp32 on the CPU),
    and the aggregated θ agree to within the size of one round's step."""
    runs = {}
    for device in ("cpu", GPU):
        worker, aggregator = _worker_and_aggregator(device)
        deltas = []
        for _ in range(2):
            update = worker.train_round(copy.deepcopy(aggregator.global_state()))
            assert all(d.device.type == "cpu" for d in update.delta.values())  # what crosses the wire
            deltas.append(torch.cat([d.flatten() for _, d in sorted(update.delta.items())]))
            aggregator.aggregate([update])
        runs[device] = (deltas, {n: p.clone() for n, p in aggregator.params.items()})
    for cpu, gpu in zip(runs["cpu"][0], runs[GPU][0]):
        cosine = torch.nn.functional.cosine_similarity(cpu, gpu, dim=0)
        assert cosine > 0.98 and abs(gpu.norm() / cpu.norm() - 1) < 0.05, (float(cosine), float(gpu.norm() / cpu.norm()))
    step = runs["cpu"][0][-1].norm()
    theta_gap = torch.cat([(runs[GPU][1][n] - runs["cpu"][1][n]).flatten() for n in sorted(runs["cpu"][1])]).norm()
    assert theta_gap < 0.5 * step, (float(theta_gap), float(step))


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_a_one_rank_node_through_its_wrapper_equals_the_bare_worker_on_the_gpu(tmp_path, wrapper):
    """A node's intra-node wrapper (lordo_fed.node.ranks: DDP or FSDP2, NCCL on the GPU) with one
    rank changes nothing: two rounds of LoRDO-Global give the bare worker's Δ."""
    import torch.distributed as dist

    from lordo_fed.node.ranks import LocalRanks

    backend = "nccl" if torch.device(GPU).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        deltas = {}
        for name, ranks in (("bare", None), (wrapper, LocalRanks(0, 1, wrapper))):
            worker, aggregator = _worker_and_aggregator(GPU, ranks=ranks)
            deltas[name] = []
            for _ in range(2):
                update = worker.train_round(copy.deepcopy(aggregator.global_state()))
                deltas[name].append(update.delta)
                aggregator.aggregate([update])
    finally:
        dist.destroy_process_group()
    for bare, wrapped in zip(deltas["bare"], deltas[wrapper]):
        for n in bare:
            torch.testing.assert_close(wrapped[n], bare[n], rtol=0, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", ["svd", "rsvd", "dct"])
def test_the_aggregators_projection_fits_on_the_gpu_match_the_cpu(name):
    """`fit_projections` on the GPU (batched, as a server with a GPU runs it) spans the same
    subspaces as on the CPU, and hands back CPU tensors."""
    from lordo_fed.rounds.bases import fit_projections

    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (96, 64), "b": (96, 64), "c": (64, 160)}
    deltas = {}
    for n, (p, q) in shapes.items():  # a decaying spectrum: an unambiguous top-RANK subspace
        deltas[n] = (torch.randn(p, 12, generator=gen) * torch.linspace(10, 1, 12)) @ torch.randn(12, q, generator=gen)
    ranks = {n: RANK for n in shapes}
    method = get_projection_method(name)
    cpu = fit_projections(deltas, ranks, method, seed=5)
    gpu = fit_projections(deltas, ranks, method, seed=5, device=GPU)
    for n, shape in shapes.items():
        assert gpu[n].device.type == "cpu" and gpu[n].dtype == cpu[n].dtype
        side = projection_side(shape)
        pg, pc = (method.basis(x, shape, side) for x in (gpu[n], cpu[n]))
        proj = (lambda b: b.T @ b) if side == "right" else (lambda b: b @ b.T)
        torch.testing.assert_close(proj(pg), proj(pc), rtol=0, atol=1e-4)
